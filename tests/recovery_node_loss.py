"""Node loss, then replacement on a simulated cluster: the lost node's ranks are re-placed on a spare node.

Runs as a subprocess driver (``python -m tests.recovery_node_loss``; one cluster connection per
process): a CPU-less head plus three 2-CPU raylets on 127.0.0.1, a 4-rank group (dp 4) on the
first two, ``remove_node`` of the second, then a call with ``on_rank_death="replace"``: the dead
ranks are replaced, Ray having re-placed their bundles on the spare third node, and the call
returns the undisturbed result.  Prints one ``REPORT {json}`` line.  Used by
``tests/test_recovery_multinode.py`` and ``scripts/fault_drill.py``.
"""

from __future__ import annotations

import time

from tests.drivers import print_report
from tests.reliability_node_loss import FAST_HEALTH_CHECKS


def run() -> dict:
    import ray

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.simulated import loopback_cluster
    from rankmesh.mesh import RankMesh
    from tests.recovery_workers import StateWorker

    report: dict = {}
    cluster, nodes = loopback_cluster(
        [{"num_cpus": 2, "object_store_memory": 80 << 20} for _ in range(3)],
        head_args={"_system_config": FAST_HEALTH_CHECKS},
        logging_level="ERROR",
    )
    try:
        wg = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False), RayClassWithInitArgs(StateWorker, scale=1),
                            mesh=RankMesh(dp=4), on_rank_death="replace", call_timeout_s=120)
        by_node = {n.node_id: i for i, n in enumerate(nodes)}
        before = wg.whoami()
        placed = [by_node[wg.node_of(r)] for r in range(4)]
        victim_index = placed[2]
        report["ranks_on_victim"] = [r for r in range(4) if placed[r] == victim_index]
        cluster.remove_node(nodes[victim_index], allow_graceful=False)
        removed = time.monotonic()
        report["result"] = wg.world_sum([1.0, 2.0, 3.0, 4.0])  # undisturbed: 10.0 on every rank
        report["seconds"] = time.monotonic() - removed
        rep = wg.replacements[-1] if wg.replacements else None
        report["replaced"] = rep.ranks if rep else []
        report["format"] = rep.format() if rep else ""
        report["timings"] = {k: getattr(rep, k) for k in ("detected_s", "drain_s", "start_s", "import_s", "init_s",
                                                            "restore_s", "total_s")} if rep else {}
        after = wg.whoami()
        report["nodes_after"] = [by_node.get(wg.node_of(r)) for r in range(4)]
        report["nodes_before"] = placed
        report["victim"] = victim_index
        report["survivor_pids_kept"] = all(after[r]["pid"] == before[r]["pid"] for r in range(4)
                                           if r not in report["replaced"])
        wg.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


def main() -> None:
    print_report(run())


if __name__ == "__main__":
    main()
