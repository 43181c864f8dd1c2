"""Node loss: killing a node during a call reads like dead workers.

Runs as a subprocess driver (``python -m tests.reliability_node_loss``; Ray allows one cluster
connection per process): a head without CPUs plus two 2-CPU nodes (raylets on 127.0.0.1 it
starts, or a namespaced cluster its test made: ``tests/node_faults.py``), a 4-rank group spread
over them, a call in which every rank sleeps, and the second node killed one second in.  Prints one ``REPORT {json}`` line: error class, message, dead ranks,
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


#: The scenario's two 2-CPU nodes (a CPU-less head besides).
NODES = [{"num_cpus": 2, "resources": {f"n{i}": 1}, "object_store_memory": 80 << 20} for i in range(2)]


def run() -> dict:
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.node_faults import nodes_for
    from tests.reliability_workers import FaultWorker

    report: dict = {}
    nodes = nodes_for(NODES, FAST_HEALTH_CHECKS)
    try:
        wg = RayWorkerGroup(RayResourcePool([2, 2], use_gpu=False), RayClassWithInitArgs(FaultWorker))
        victim = nodes.ids[1]
        report["ranks_on_victim"] = [r for r in range(wg.world_size) if wg.node_of(r) == victim]
        removed_at: list[float] = []

        def remove() -> None:
            time.sleep(1.0)
            removed_at.append(time.monotonic())
            nodes.kill(victim)

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
        nodes.close()
    return report


def main() -> None:
    print_report(run())


if __name__ == "__main__":
    main()
