"""A node removed from a simulated cluster: its ranks are replaced on the spare node, survivors kept.

The scenario runs in a subprocess driver (``tests/recovery_node_loss.py``, through
``tests.drivers.run_module``) because the test session already holds its one Ray connection; it
removes a node, so it owns its cluster rather than using the shared one.
"""

from __future__ import annotations

import pytest

from tests.drivers import run_module


@pytest.mark.timeout(240)
def test_removed_node_ranks_are_re_placed_on_a_node_with_room():
    pytest.importorskip("ray")
    report = run_module("tests.recovery_node_loss", timeout=220)
    # Two ranks per node (pool [2, 2]) on two of the three nodes; the third is the spare.
    assert len(report["ranks_on_victim"]) == 2 and report["replaced"] == report["ranks_on_victim"], report
    assert report["result"] == [10.0] * 4, report  # 1 + 2 + 3 + 4 on every rank: the undisturbed result
    spare = ({0, 1, 2} - set(report["nodes_before"])).pop()
    assert all(report["nodes_after"][r] == spare for r in report["replaced"]), report
    assert report["survivor_pids_kept"], report
