"""Driver for test_user_ray_init: verl's pattern, ``ray.init(num_cpus=...)`` by the user, then pools.

Prints one ``REPORT`` line (tests/drivers.py) with what it observed.  Runs in its own process
(one Ray per process).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from rankmesh.compat.verl import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from tests.compat.workers import EnvWorker  # noqa: E402
from tests.drivers import print_report  # noqa: E402


def main() -> None:
    # as a verl driver does, on loopback (the project's rule for local clusters)
    ray.init(address="local", num_cpus=3, _node_ip_address="127.0.0.1", include_dashboard=False)
    seen: dict = {"cpus_before": ray.cluster_resources().get("CPU")}
    try:
        RayWorkerGroup(RayResourcePool([8], use_gpu=False, ready_timeout=3), RayClassWithInitArgs(cls=EnvWorker))
        seen["too_big"] = "accepted"
    except Exception as exc:  # noqa: BLE001 - the report is the point
        seen["too_big"] = f"{type(exc).__name__}: {exc}"[:300]
    seen["initialized_after_failure"] = ray.is_initialized()
    seen["cpus_after"] = ray.cluster_resources().get("CPU")
    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False, max_colocate_count=1), RayClassWithInitArgs(cls=EnvWorker))
    try:
        wg.env(123)  # a worker method that raises (iterating an int)
        seen["failed_call"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        seen["failed_call"] = type(exc).__name__
    seen["ranks"] = [e["RANK"] for e in wg.env(["RANK"])]
    wg.shutdown()
    seen["initialized_at_end"] = ray.is_initialized()
    print_report(seen)
    ray.shutdown()


if __name__ == "__main__":
    main()
