#!/usr/bin/env python
"""Group calls through a call session against the Ray task-per-rank path, side by side in one run.

Two groups of ``N`` ranks on this node run the same worker: one opens a call session
(``rankmesh.backends.ray.session``: one message per call through a shared-memory ring), the
other has ``RANKMESH_CONTROL=ray`` (one Ray task per rank).  Their calls alternate in blocks of
``--block`` in one run (the machine is shared and noisy).  For each N this prints:

* p50 and p99 of a no-op round trip (``wg.noop()``, a real ``@register`` method);
* the controller's CPU per call (``time.process_time`` of the controller process over the blocks);
* start skew: the spread of the ranks' entry times into ``stamp()``;
* the first call after ``--idle-s`` of idleness, and the ranks' CPU over ``--idle-cpu-s``
  after their last call (largest N only).

``--kill`` adds the failure drill: a rank SIGKILLed mid-call (time to the group's error), and
the controller SIGKILLed (time until its ranks' processes are gone), with ``/dev/shm`` listed
before and after.

    python scripts/bench_control_plane.py                      # N = 1, 2, 4, 8, 16; 1000 calls each
    python scripts/bench_control_plane.py --ranks 8 --calls 200 --kill
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402

PATHS = ("session", "ray")


def make_group(ranks: int, path: str):
    """A group of ``ranks`` ControlWorkers whose calls take ``path``."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.control_workers import ControlWorker

    before = os.environ.get("RANKMESH_CONTROL")
    os.environ["RANKMESH_CONTROL"] = "auto" if path == "session" else "ray"
    try:
        wg = RayWorkerGroup(RayResourcePool([ranks], use_gpu=False), RayClassWithInitArgs(ControlWorker))
    finally:
        if before is None:
            os.environ.pop("RANKMESH_CONTROL", None)
        else:
            os.environ["RANKMESH_CONTROL"] = before
    wg.noop()  # opens the session
    paths = set(wg._executor.control_paths())
    if paths != {path}:
        raise SystemExit(f"a {path} group of {ranks} ranks reports control paths {paths}")
    return wg


def pids(wg) -> list[int]:
    return [info["pid"] for info in wg._hosts.info]


def cpu_s(pid_list: list[int]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pid_list)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def block(wg, n: int) -> tuple[list[float], float]:
    """``n`` back-to-back no-op calls: their round trips, and the controller's CPU seconds."""
    times = []
    cpu = time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        wg.noop()
        times.append(time.perf_counter() - start)
    return times, time.process_time() - cpu


def skew(wg, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        stamps = wg.stamp()
        out.append((max(stamps) - min(stamps)) / 1e6)
    return out


def measure(ranks: int, args: argparse.Namespace, idle: bool) -> list[dict]:
    groups = {path: make_group(ranks, path) for path in PATHS}
    try:
        for wg in groups.values():
            block(wg, args.block)  # warm up
        times = {p: [] for p in PATHS}
        cpu = {p: 0.0 for p in PATHS}
        skews = {p: [] for p in PATHS}
        for _ in range(max(1, args.calls // args.block)):
            for path, wg in groups.items():
                t, c = block(wg, args.block)
                times[path] += t
                cpu[path] += c
                skews[path] += skew(wg, 10)
        rows = []
        for path, wg in groups.items():
            row = {"ranks": ranks, "path": path, "p50_ms": 1e3 * statistics.median(times[path]),
                   "p99_ms": 1e3 * pct(times[path], 0.99), "controller_cpu_ms": 1e3 * cpu[path] / len(times[path]),
                   "skew_p50_ms": statistics.median(skews[path]), "skew_p99_ms": pct(skews[path], 0.99)}
            if idle:
                after = []
                for _ in range(args.idle_samples):
                    time.sleep(args.idle_s)
                    start = time.perf_counter()
                    wg.noop()
                    after.append(time.perf_counter() - start)
                row["after_idle_ms"] = 1e3 * statistics.median(after)
            rows.append(row)
        if idle:  # both groups idle together, so the figures share the machine's noise
            before = {p: cpu_s(pids(wg)) for p, wg in groups.items()}
            time.sleep(args.idle_cpu_s)
            for row in rows:
                used = cpu_s(pids(groups[row["path"]])) - before[row["path"]]
                row["idle_cpu_per_rank"] = used / args.idle_cpu_s / ranks
        return rows
    finally:
        for wg in groups.values():
            wg.shutdown()


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def kill_rank_drill() -> dict:
    """SIGKILL rank 1 of a 4-rank session group inside a 10 s call: how long until the call raises."""
    from rankmesh.errors import WorkerDiedError

    before = shm()
    wg = make_group(4, "session")
    victim = pids(wg)[1]
    killed = {}

    def kill() -> None:
        time.sleep(0.5)
        killed["at"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    try:
        wg.sleep(10.0)
        raise SystemExit("the call outlived its killed rank")
    except WorkerDiedError as exc:
        error_s = time.monotonic() - killed["at"]
        ranks = exc.ranks
    wg.shutdown()
    time.sleep(1.0)
    return {"error_after_s": error_s, "ranks": list(ranks), "dev_shm_new": sorted(shm() - before)}


CONTROLLER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.control_workers import ControlWorker
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ControlWorker))
    wg.noop()
    print(" ".join(str(i["pid"]) for i in wg._hosts.info), wg._executor.control_paths()[0], flush=True)
    time.sleep(600)
""")


def kill_controller_drill() -> dict:
    """SIGKILL a controller whose 4 ranks wait in their session: how long until their processes are gone."""
    import ray

    before = shm()
    code = CONTROLLER.format(repo=str(REPO), address=ray.get_runtime_context().gcs_address)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    ranks, path = [int(p) for p in line[:-1]], line[-1]
    threads_before = {p: psutil.Process(p).num_threads() for p in ranks}
    start = time.monotonic()
    proc.kill()
    proc.wait()
    gone_after = None
    while time.monotonic() - start < 30:
        if not any(psutil.pid_exists(p) for p in ranks):
            gone_after = time.monotonic() - start
            break
        time.sleep(0.05)
    time.sleep(1.0)
    return {"path": path, "processes_gone_after_s": gone_after, "threads_before": threads_before,
            "dev_shm_new": sorted(shm() - before)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8,16", help="group sizes (default 1,2,4,8,16)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per path and group size")
    ap.add_argument("--block", type=int, default=100, help="calls per block; the paths alternate by block")
    ap.add_argument("--idle-s", type=float, default=1.0, help="idleness before each 'after idle' call")
    ap.add_argument("--idle-samples", type=int, default=5)
    ap.add_argument("--idle-cpu-s", type=float, default=10.0, help="how long the ranks' idle CPU is measured")
    ap.add_argument("--kill", action="store_true", help="also run the SIGKILL drills")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    from rankmesh.backends.ray.runtime import ensure_ray

    sizes = [int(n) for n in args.ranks.split(",") if n]
    ensure_ray(num_cpus=2 * max(sizes) + 4, logging_level="ERROR", log_to_driver=False)
    rows = []
    for ranks in sizes:
        rows += measure(ranks, args, idle=ranks == max(sizes))
    print("session: one message per call through a shared-memory ring; ray: one Ray task per rank (RANKMESH_CONTROL=ray)")
    print(f"{'ranks':>5} {'path':>8} {'p50 ms':>8} {'p99 ms':>8} {'ctl CPU ms':>10} {'skew p50':>9} {'skew p99':>9}"
          f" {'after idle':>10} {'idle CPU/rank':>13}")
    for r in rows:
        idle = f"{r['after_idle_ms']:10.3f} {r['idle_cpu_per_rank']:13.2%}" if "after_idle_ms" in r else ""
        print(f"{r['ranks']:5d} {r['path']:>8} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['controller_cpu_ms']:10.3f} "
              f"{r['skew_p50_ms']:9.3f} {r['skew_p99_ms']:9.3f} {idle}")
    for ranks in sizes:
        mine, ray_row = (next(r for r in rows if r["ranks"] == ranks and r["path"] == p) for p in PATHS)
        print(f"{ranks} ranks: session p50 {ray_row['p50_ms'] / mine['p50_ms']:.1f}x faster than Ray's, "
              f"controller CPU per call {ray_row['controller_cpu_ms'] / mine['controller_cpu_ms']:.1f}x less")
    out = {"rows": rows}
    if args.kill:
        out["kill_rank"] = kill_rank_drill()
        out["kill_controller"] = kill_controller_drill()
        print("rank SIGKILLed mid-call:", json.dumps(out["kill_rank"]))
        print("controller SIGKILLed:", json.dumps(out["kill_controller"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
