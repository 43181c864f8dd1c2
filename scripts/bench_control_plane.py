#!/usr/bin/env python
"""Group calls through a call session against the Ray task-per-rank path, side by side in one run.

One group of ``N`` ranks on this node switches between its call session
(``rankmesh.backends.ray.session``: one message per call through a shared-memory ring) and the
Ray path (one Ray task per rank) with ``wg.set_control``, in blocks of ``--block`` calls within
one run (the machine is shared and noisy).  For each N this prints:

* p50 and p99 of a no-op round trip (``wg.noop()``, a real ``@register`` method);
* the controller's CPU per call (``time.process_time`` of the controller process over the blocks);
* start skew: the spread of the ranks' entry times into ``stamp()``;
* the first call after ``--idle-s`` of idleness, and the ranks' CPU over ``--idle-cpu-s``
  after their last call (largest N only).

``--cluster`` does the same on a simulated cluster (``ray.cluster_utils.Cluster`` on loopback)
for groups of NODES x RANKS, through node agents, and fits ``a + b·nodes + c·ranks`` to the
controller's CPU and to the p50 round trip, extrapolated to 1,024 nodes x 8 ranks.

``--kill`` adds the failure drill: a rank SIGKILLed mid-call (time to the group's error), and
the controller SIGKILLed (time until its ranks' processes are gone), with ``/dev/shm`` listed
before and after.

    python scripts/bench_control_plane.py                      # N = 1, 2, 4, 8, 16; 1000 calls each
    python scripts/bench_control_plane.py --ranks 8 --calls 200 --kill
    python scripts/bench_control_plane.py --cluster 1x2,2x2,4x2,8x2,2x4,4x4 --calls 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402

PATHS = ("session", "ray")


def make_group(pool_nodes: list[int]):
    """A group of ControlWorkers, ``pool_nodes[i]`` ranks on node entry ``i``, its session opened."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.control_workers import ControlWorker

    wg = RayWorkerGroup(RayResourcePool(pool_nodes, use_gpu=False), RayClassWithInitArgs(ControlWorker))
    wg.set_control("auto")
    wg.noop()  # opens the session (or the node agents)
    paths = set(wg._executor.control_paths())
    if paths == {"ray"}:
        raise SystemExit(f"no call session could be opened for a group on {pool_nodes}: {wg._executor.session_note}")
    return wg


def use(wg, path: str) -> str:
    """Switch ``wg`` to ``path`` (``session`` means the group's session or agents); the path it reports."""
    wg.set_control("ray" if path == "ray" else "auto")
    return wg._executor.control_paths()[0]


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
    """First to last rank entering ``stamp()`` (ms); the ranks share this machine's clock."""
    out = []
    for _ in range(samples):
        stamps = wg.stamp()
        out.append((max(stamps) - min(stamps)) / 1e6)
    return out


def measure(wg, label: dict, args: argparse.Namespace, idle: bool) -> list[dict]:
    """Both paths on one group, alternating by block: one row per path."""
    times = {p: [] for p in PATHS}
    cpu = {p: 0.0 for p in PATHS}
    skews = {p: [] for p in PATHS}
    reported = {}
    for path in PATHS:  # warm up
        use(wg, path)
        block(wg, args.block)
    for _ in range(max(1, args.calls // args.block)):
        for path in PATHS:
            reported[path] = use(wg, path)
            t, c = block(wg, args.block)
            times[path] += t
            cpu[path] += c
            skews[path] += skew(wg, 10)
    rows = []
    for path in PATHS:
        row = {**label, "path": reported[path], "p50_ms": 1e3 * statistics.median(times[path]),
               "p99_ms": 1e3 * pct(times[path], 0.99), "controller_cpu_ms": 1e3 * cpu[path] / len(times[path]),
               "skew_p50_ms": statistics.median(skews[path]), "skew_p99_ms": pct(skews[path], 0.99)}
        if idle:
            use(wg, path)
            after = []
            for _ in range(args.idle_samples):
                time.sleep(args.idle_s)
                start = time.perf_counter()
                wg.noop()
                after.append(time.perf_counter() - start)
            row["after_idle_ms"] = 1e3 * statistics.median(after)
            before = cpu_s(pids(wg))
            time.sleep(args.idle_cpu_s)
            row["idle_cpu_per_rank"] = (cpu_s(pids(wg)) - before) / args.idle_cpu_s / len(pids(wg))
        rows.append(row)
    return rows


def shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def kill_rank_drill() -> dict:
    """SIGKILL rank 1 of a 4-rank session group inside a 10 s call: how long until the call raises."""
    from rankmesh.errors import WorkerDiedError
    from tests.control_workers import kill_after

    before = shm()
    wg = make_group([4])
    killed = kill_after(pids(wg)[1], 0.5)
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
    """SIGKILL a controller whose 4 ranks wait in their session: when each rank's session thread
    ends (its thread count drops, or its process is gone), and when Ray has stopped them all."""
    import ray

    before = shm()
    code = CONTROLLER.format(repo=str(REPO), address=ray.get_runtime_context().gcs_address)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    ranks, path = [int(p) for p in line[:-1]], line[-1]
    threads = {p: psutil.Process(p).num_threads() for p in ranks}
    start = time.monotonic()
    proc.kill()
    proc.wait()
    left_loop: dict[int, float] = {}
    gone_after = None
    while time.monotonic() - start < 30 and gone_after is None:
        now = time.monotonic() - start
        alive = 0
        for p in ranks:
            try:
                fewer = psutil.Process(p).num_threads() < threads[p]
                alive += 1
            except psutil.NoSuchProcess:
                fewer = True
            if fewer:
                left_loop.setdefault(p, now)
        if not alive:
            gone_after = now
        time.sleep(0.01)
    time.sleep(1.0)
    return {"path": path, "session_threads_ended_after_s": max(left_loop.values()) if len(left_loop) == len(ranks) else None,
            "processes_gone_after_s": gone_after, "dev_shm_new": sorted(shm() - before)}


def fit(rows: list[dict], key: str) -> tuple[float, float, float]:
    """Least squares ``key ≈ a + b·nodes + c·ranks`` over ``rows``; returns (a, b, c) in ms."""
    import numpy as np

    x = np.array([[1.0, r["nodes"], r["ranks"]] for r in rows])
    y = np.array([r[key] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return tuple(float(c) for c in coef)


def print_rows(rows: list[dict], cluster: bool) -> None:
    first = f"{'nodes':>5} " if cluster else ""
    print(f"{first}{'ranks':>5} {'path':>8} {'p50 ms':>8} {'p99 ms':>8} {'ctl CPU ms':>10} {'skew p50':>9} {'skew p99':>9}"
          f" {'after idle':>10} {'idle CPU/rank':>13}")
    for r in rows:
        idle = f"{r['after_idle_ms']:10.3f} {r['idle_cpu_per_rank']:13.2%}" if "after_idle_ms" in r else ""
        first = f"{r['nodes']:5d} " if cluster else ""
        print(f"{first}{r['ranks']:5d} {r['path']:>8} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['controller_cpu_ms']:10.3f} "
              f"{r['skew_p50_ms']:9.3f} {r['skew_p99_ms']:9.3f} {idle}")


def one_node(args: argparse.Namespace) -> dict:
    from rankmesh.backends.ray.runtime import ensure_ray

    sizes = [int(n) for n in args.ranks.split(",") if n]
    ensure_ray(num_cpus=max(sizes) + 8, logging_level="ERROR", log_to_driver=False)
    rows = []
    for ranks in sizes:
        wg = make_group([ranks])
        try:
            rows += measure(wg, {"nodes": 1, "ranks": ranks}, args, idle=ranks == args.idle_ranks)
        finally:
            wg.shutdown()
    print("session: one message per call through the controller's shared-memory ring; ray: one Ray task per rank")
    print_rows(rows, cluster=False)
    for ranks in sizes:
        mine, ray_row = (next(r for r in rows if r["ranks"] == ranks and r["path"] == p) for p in PATHS)
        print(f"{ranks} ranks: session p50 {ray_row['p50_ms'] / mine['p50_ms']:.1f}x faster than Ray's; "
              f"controller CPU per call {mine['controller_cpu_ms']:.3f} ms vs {ray_row['controller_cpu_ms']:.3f} ms")
    out: dict = {"rows": rows}
    if args.kill:
        out["kill_rank"] = kill_rank_drill()
        out["kill_controller"] = kill_controller_drill()
        print("rank SIGKILLed mid-call:", json.dumps(out["kill_rank"]))
        print("controller SIGKILLed:", json.dumps(out["kill_controller"]))
    return out


def cluster(args: argparse.Namespace) -> dict:
    """Groups of ``n`` nodes x ``r`` ranks on a simulated cluster (the driver on the CPU-less head)."""
    from rankmesh.backends.ray.simulated import loopback_cluster

    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.cluster.split(",") if shape]
    nodes_needed = max(n for n, _ in shapes)
    cpus = max(r for _, r in shapes)
    loopback_cluster([{"num_cpus": cpus, "object_store_memory": 96 << 20}] * nodes_needed, logging_level="ERROR")
    rows = []
    for nodes, ranks_per_node in shapes:
        wg = make_group([ranks_per_node] * nodes)
        try:
            for row in measure(wg, {"nodes": nodes, "ranks": nodes * ranks_per_node}, args, idle=False):
                rows.append(row)
        finally:
            wg.shutdown()
    print("agent: one Ray task per node per call, each node's agent writes its ring; ray: one Ray task per rank")
    print_rows(rows, cluster=True)
    out: dict = {"rows": rows, "models": {}}
    for path in ("agent", "ray"):
        mine = [r for r in rows if r["path"] == path]
        for key in ("controller_cpu_ms", "p50_ms"):
            a, b, c = fit(mine, key)
            at_scale = a + b * 1024 + c * 8192
            out["models"][f"{path} {key}"] = {"a": a, "per_node": b, "per_rank": c, "1024x8": at_scale}
            print(f"{path:>5} {key:>17} ≈ {a:.3f} + {b:.3f}·nodes + {c:.3f}·ranks ms  -> 1,024 nodes x 8 ranks: "
                  f"{at_scale:.1f} ms (Monarch's cast: 5.76 ms p50)")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4,8,16", help="group sizes on this node (default 1,2,4,8,16)")
    ap.add_argument("--cluster", help="instead: shapes NODESxRANKS on a simulated cluster, e.g. 1x2,2x2,4x2,8x2,2x4,4x4")
    ap.add_argument("--calls", type=int, default=1000, help="calls per path and group size")
    ap.add_argument("--block", type=int, default=100, help="calls per block; the paths alternate by block")
    ap.add_argument("--idle-ranks", type=int, default=8, help="group size whose idle figures are measured")
    ap.add_argument("--idle-s", type=float, default=1.0, help="idleness before each 'after idle' call")
    ap.add_argument("--idle-samples", type=int, default=5)
    ap.add_argument("--idle-cpu-s", type=float, default=10.0, help="how long the ranks' idle CPU is measured")
    ap.add_argument("--kill", action="store_true", help="also run the SIGKILL drills (one node)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    out = cluster(args) if args.cluster else one_node(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
