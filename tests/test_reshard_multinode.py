"""Resharding across simulated nodes: same-node pairs read each other directly, the others use the object store.

Two raylets on 127.0.0.1 (``ray.cluster_utils.Cluster``), 4 CPUs each; a tp2·pp2 source group and
a tp1·dp4 destination group, each placed 2 + 2 over the two nodes.  As in
tests/test_ray_multinode.py the cluster runs in a subprocess driver (one Ray connection per
process) that prints one JSON report; the tests check it.  Expected direct bytes come from the
plan's transfers and the node each rank reported, not from the reshard's own bookkeeping, and the
weights are compared with megatron's cut (tests/reshard_workers.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _scenario() -> dict:
    import numpy as np
    import ray

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.reshard import plan_between, reshard
    from rankmesh.backends.ray.simulated import loopback_cluster
    from tests.reshard_workers import ShardHolder, full_tensor, megatron_cut
    from tests.test_reshard_ray import GEN, LAYOUTS, PIPE, PIPE_LAYOUTS

    def matches(group, layouts, mesh, seed) -> bool:
        for rank, got in enumerate(group.shards()):
            want = {p.name: megatron_cut(full_tensor(p, seed), p, mesh, rank) for p in layouts
                    if p.pp_stage is None or mesh.coords(rank).pp_rank == p.pp_stage}
            if sorted(got) != sorted(want) or not all(np.array_equal(got[n], want[n]) for n in want):
                return False
        return True

    cluster, _ = loopback_cluster([{"num_cpus": 4, "object_store_memory": 96 << 20} for _ in range(2)])
    report: dict = {}
    try:
        src = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False), RayClassWithInitArgs(ShardHolder, PIPE_LAYOUTS, seed=3),
                             mesh=PIPE)
        dst = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False), RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=None),
                             mesh=GEN)
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
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


if __name__ == "__main__":
    print("REPORT " + json.dumps(_scenario()))


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.test_reshard_multinode"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"driver failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("REPORT "):])


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
