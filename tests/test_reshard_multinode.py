"""Resharding across simulated nodes: same-node pairs read each other directly, the others use the object store.

The shared simulated cluster (``simulated_cluster``, tests/drivers.py: raylets of 4, 4 and 2 CPUs
or their namespaced form); a tp2·pp2 source group and a tp1·dp4 destination group on one pool of
2 + 2 bundles over two nodes.  Each node holds one pp stage of the source, and every destination
rank needs both stages: some of its pieces come from its own node and some from the other.  As in tests/test_ray_multinode.py the scenario runs in the cluster's driver
process (one Ray connection per process), which returns one JSON report; the tests check it.
Expected direct bytes come from the plan's transfers and the node each rank reported, not from
the reshard's own bookkeeping, and the weights are compared with megatron's cut
(tests/reshard_workers.py).
"""

from __future__ import annotations

import pytest


def scenario(cluster) -> dict:
    """Runs inside the driver process, on the shared cluster: both transports, one report."""
    import numpy as np

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.reshard import plan_between, reshard
    from tests.reshard_workers import ShardHolder, full_tensor, megatron_cut
    from tests.test_reshard_ray import GEN, LAYOUTS, PIPE, PIPE_LAYOUTS

    def matches(group, layouts, mesh, seed) -> bool:
        for rank, got in enumerate(group.shards()):
            want = {p.name: megatron_cut(full_tensor(p, seed), p, mesh, rank) for p in layouts
                    if p.pp_stage is None or mesh.coords(rank).pp_rank == p.pp_stage}
            if sorted(got) != sorted(want) or not all(np.array_equal(got[n], want[n]) for n in want):
                return False
        return True

    report: dict = {}
    # One pool for both groups, each bundle of 2 CPUs: an entry (4 CPUs) fills node_a or node_b
    # (tests/drivers.py SHARED_NODES), so each group spans both.  With 1-CPU bundles Ray may
    # pack a group's two entries onto one node (STRICT_PACK binds within an entry only).
    pool = RayResourcePool([2, 2], use_gpu=False, max_colocate_count=2)
    src = RayWorkerGroup(pool, RayClassWithInitArgs(ShardHolder, PIPE_LAYOUTS, seed=3), mesh=PIPE)
    dst = RayWorkerGroup(pool, RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=None), mesh=GEN)
    plan = plan_between(src, dst)
    report["src_nodes"] = [i["node_id"] for i in src.node_info]
    report["dst_nodes"] = [i["node_id"] for i in dst.node_info]
    report["transfers"] = [[t.src_rank, t.dst_rank, t.nbytes] for t in plan.transfers if not t.local]
    report["bytes_moved"] = plan.bytes_moved
    for transport in ("auto", "store"):
        dst.refill(None)
        stats = reshard(src, dst, plan, transport=transport)
        report[transport] = {"bytes_direct": stats.bytes_direct, "bytes_put": stats.bytes_put,
                             "refused": stats.refused, "weights_ok": matches(dst, LAYOUTS, GEN, seed=3)}
    src.shutdown()
    dst.shutdown()
    return report


@pytest.fixture(scope="module")
def report(simulated_cluster) -> dict:
    return simulated_cluster.run("tests.test_reshard_multinode:scenario")


def test_groups_span_both_nodes(report) -> None:
    assert len(set(report["src_nodes"])) == 2 and len(set(report["dst_nodes"])) == 2


def test_same_node_pairs_read_directly_and_the_rest_use_the_store(report) -> None:
    same = sum(n for s, d, n in report["transfers"] if report["src_nodes"][s] == report["dst_nodes"][d])
    assert 0 < same < report["bytes_moved"]  # both kinds of pairs exist
    auto = report["auto"]
    assert auto["bytes_direct"] == same and auto["refused"] == 0 and auto["bytes_put"] > 0
    assert auto["weights_ok"]


def test_store_transport_moves_everything_through_the_store(report) -> None:
    store = report["store"]
    assert store["bytes_direct"] == 0 and store["bytes_put"] > 0 and store["weights_ok"]
