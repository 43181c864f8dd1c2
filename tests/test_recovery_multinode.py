"""A node lost: its ranks are replaced on the spare node, survivors kept; then, with no room
left, a group shrinks instead and grows back when a node joins.

The scenario runs in a subprocess driver (``tests/recovery_node_loss.py``) because the test
session already holds its one Ray connection; it kills nodes, so it gets a cluster of its own
rather than the shared one: namespaced where namespaces can be made, the test killing and adding
nodes at the driver's cues, else loopback raylets the driver changes itself
(``tests/node_faults.py``).
"""

from __future__ import annotations

import logging

import pytest

from rankmesh.mesh import RankMesh
from tests.node_faults import run_node_scenario

logger = logging.getLogger(__name__)


@pytest.mark.timeout(240)
def test_removed_node_ranks_are_re_placed_on_a_node_with_room():
    pytest.importorskip("ray")
    from tests.recovery_node_loss import NODES
    from tests.reliability_node_loss import FAST_HEALTH_CHECKS

    report, kind = run_node_scenario("tests.recovery_node_loss", NODES, FAST_HEALTH_CHECKS, timeout=220)
    logger.info("node loss, spares, shrink and grow on a %s cluster", kind)
    # Two ranks per node (pool [2, 2]) on two of the three nodes; the third is the spare.
    assert len(report["ranks_on_victim"]) == 2 and report["replaced"] == report["ranks_on_victim"], report
    assert report["result"] == [10.0] * 4, report  # 1 + 2 + 3 + 4 on every rank: the undisturbed result
    spare = ({0, 1, 2} - set(report["nodes_before"])).pop()
    assert all(report["nodes_after"][r] == spare for r in report["replaced"]), report
    assert report["survivor_pids_kept"], report
    # The spare node's agent was started during the replacement, and the retried call took it.
    assert report["agents_started"] == [spare] and report["agents_the_call_started"] == [], report

    # Then on_rank_death="replace_or_shrink" with one spare: a warm spare takes a dead rank's place;
    # when a node is lost with no spare left and no room, the group drops the replica (tp2·dp2 ->
    # tp2·dp1); a node added back lets grow(1) bring it back.
    shrink = report["shrink"]
    assert shrink["spare_on_small_node"] and shrink["result_spare"] == [10.0] * 4, shrink
    assert shrink["spare_taken"]["ranks"] == [3] == shrink["spare_taken"]["from_spares"], shrink
    # The spare's node had an agent standing by, which serves the rank now (no agent started for it).
    standby, serving = shrink["spare_node_agent"]
    assert standby is not None and serving == standby, shrink
    assert shrink["refill_on_victim"] and shrink["ranks_on_victim"] == [2], shrink
    assert shrink["shrink"]["lost_replicas"] == [1] and shrink["shrink"]["dead"] == [2], shrink
    assert shrink["result"] == [3.0, 3.0] and shrink["survivor_pids_kept"], shrink  # 1 + 2 on ranks 0, 1
    assert shrink["mesh_after_shrink"] == repr(RankMesh(tp=2, dp=1)), shrink
    assert shrink["grow"]["added"] == [2, 3] and shrink["grow"]["peers"] == {"2": 0, "3": 1}, shrink
    assert shrink["mesh_after_grow"] == repr(RankMesh(tp=2, dp=2)), shrink
    assert shrink["state_after_grow"] == [[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]] * 2, shrink  # copied by tp rank
    assert shrink["result_after_grow"] == [10.0] * 4, shrink
    # The grow kept the agents of the nodes it had, and started the added node's while it re-formed.
    grown = shrink["grow_agents"]
    assert grown["started"] == ["new"] == [grown["new_node"]] and grown["the_call_started"] == [], grown
    # Data calls through the node agents after the shrink and after the grow, a small batch (inside
    # the call) and a large one (pieces in the store): every rank tags its piece's rows (expected by
    # hand from DP_COMPUTE_PROTO's split of 8 rows over 2, then 4 ranks), the rows come back in
    # order, and the agents carried both calls.
    for key, tags in (("data_after_shrink", [0] * 4 + [1] * 4), ("data_after_grow", [0, 0, 1, 1, 2, 2, 3, 3])):
        data = shrink[key]
        for size in ("small", "large"):
            assert data[size] == {"rank": tags, "rows_back": True}, (key, data)
        assert data["carriers"] == {"agent": 2}, (key, data)
