"""Node loss on a simulated cluster: removing a node during a call reads like dead workers.

Runs as a subprocess driver (``python -m tests.reliability_node_loss``; Ray allows one cluster
connection per process): a head without CPUs plus two 2-CPU raylets on 127.0.0.1, a 4-rank
group spread over them, a call in which every rank sleeps, and ``remove_node`` of the second
raylet one second in.  Prints one ``REPORT {json}`` line: error class, message, dead ranks,
seconds to detection.  Used by ``tests/test_reliability_multinode.py`` and
``scripts/fault_drill.py``.

The head's health checks are tightened (0.5 s period, 3 misses) so that Ray declares the node
dead within seconds; with Ray's defaults that alone takes about 15 s.
"""

from __future__ import annotations

import threading
import time

from tests.drivers import print_report

#: Ray settings for the simulated head: how fast a vanished raylet is declared dead.
FAST_HEALTH_CHECKS = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}


def run() -> dict:
    import ray

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.simulated import loopback_cluster
    from tests.reliability_workers import FaultWorker

    report: dict = {}
    cluster, nodes = loopback_cluster(
        [{"num_cpus": 2, "resources": {f"n{i}": 1}, "object_store_memory": 80 << 20} for i in range(2)],
        head_args={"_system_config": FAST_HEALTH_CHECKS},
        logging_level="ERROR",
    )
    try:
        wg = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False), RayClassWithInitArgs(FaultWorker))
        victim = nodes[1].node_id
        report["ranks_on_victim"] = [r for r in range(wg.world_size) if wg.node_of(r) == victim]
        removed_at: list[float] = []

        def remove() -> None:
            time.sleep(1.0)
            removed_at.append(time.monotonic())
            cluster.remove_node(nodes[1], allow_graceful=False)

        threading.Thread(target=remove, daemon=True).start()
        try:
            wg.act(["sleep:60"] * wg.world_size)
            report["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported, judged by the caller
            report["error"] = type(exc).__name__
            report["message"] = str(exc).splitlines()[0]
            report["ranks"] = getattr(exc, "ranks", None)
            report["seconds"] = time.monotonic() - removed_at[0] if removed_at else None
        report["failed"] = wg.failed is not None
        wg.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    return report


def main() -> None:
    print_report(run())


if __name__ == "__main__":
    main()
