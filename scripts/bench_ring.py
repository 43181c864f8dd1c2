#!/usr/bin/env python
"""Round trips through the shared-memory command ring against a Ray actor fan-out, side by side in one run.

What a persistent local call path can cost before any rankmesh call format is on it: the
controller writes one small message into a ring (:mod:`rankmesh.ring`) that N reader processes
read; each answers on its own one-reader ring, and the round trip ends when all N answers are in.
A third path puts rankmesh's call format on the ring: a call header installed once per rank,
then slot numbers and arguments, run through ``invoke`` on a real ``Worker`` at each reader (``calls``).  Against them,
the same N-way round trip as Ray actor tasks (``ray.get([a.echo.remote(m) ...])``),
the path a group call takes today.  Both alternate in blocks within one run (the machine is
shared and noisy).  Printed, for each N: p50 and p99 of back-to-back round trips, the first
round trip after ``--idle-s`` of idleness, and the readers' CPU while idle.

    python scripts/bench_ring.py                 # N = 4 and 8, 1000 round trips each
    python scripts/bench_ring.py --ranks 8 --calls 200 --idle-s 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402

from rankmesh.backend import RankCall  # noqa: E402
from rankmesh.backends.ray.wire import encode_rank_call  # noqa: E402
from rankmesh.ring import Ring, RingSpec, receive_ring, send_ring  # noqa: E402
from tests import ring_workers  # noqa: E402


class RingGroup:
    """N echo readers on one ring, each answering on its own reply ring.

    ``calls``: a round trip is a rankmesh call instead of raw bytes: the first call installs its
    header (:func:`rankmesh.backends.ray.wire.encode_rank_call`, one for every rank of a broadcast
    call) under a slot, later calls send the slot and their arguments; each reader runs ``NoopWorker.noop`` through
    :func:`rankmesh.worker.invoke` and answers the pickled output, which the controller unpickles.
    """

    def __init__(self, ranks: int, calls: bool = False) -> None:
        self.calls = calls
        self.installed = False
        ctx = multiprocessing.get_context("spawn")
        self.ring = Ring.create(RingSpec(readers=ranks, slots=8, slot_bytes=4096))
        address = f"\0rankmesh-bench-ring-{uuid.uuid4().hex}"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(address)
        server.listen(ranks)
        self.procs = [ctx.Process(target=ring_workers.echo, args=(address, r, calls, ranks), daemon=True)
                      for r in range(ranks)]
        for p in self.procs:
            p.start()
        self.replies = []
        for _ in range(ranks):
            conn, _ = server.accept()
            send_ring(conn, self.ring)
            self.replies.append(receive_ring(conn, 0))
        server.close()
        self.ring.watch([p.pid for p in self.procs])

    def round_trip(self, payload: bytes) -> None:
        if self.calls:
            args = (len(payload),)
            if self.installed:  # the header is installed on every rank: send its slot and the arguments
                payload = pickle.dumps(("call", 0, args), protocol=5)
            else:  # a broadcast call: one header for every rank, installed as slot 0
                header = encode_rank_call(None, "noop", RankCall(0, args, {}))[0]
                payload = pickle.dumps(("install", 0, header), protocol=5)
                self.installed = True
        self.ring.write(payload, timeout=30)
        for reply in self.replies:
            out = reply.read(timeout=30)
            if self.calls:
                pickle.loads(out)

    def cpu_s(self) -> float:
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in self.procs)

    def close(self) -> None:
        self.ring.write(b"stop", timeout=5)
        for p in self.procs:
            p.join(10)
        self.ring.close()
        for reply in self.replies:
            reply.close()


class RayGroup:
    """N Ray actors; a round trip is one task on each, waited for together."""

    def __init__(self, ranks: int) -> None:
        import ray

        @ray.remote(num_cpus=0)
        class Echo:
            def echo(self, payload: bytes) -> bytes:
                return payload

            def pid(self) -> int:
                return os.getpid()

        self.ray = ray
        self.actors = [Echo.remote() for _ in range(ranks)]
        self.pids = ray.get([a.pid.remote() for a in self.actors])

    def round_trip(self, payload: bytes) -> None:
        self.ray.get([a.echo.remote(payload) for a in self.actors])

    def cpu_s(self) -> float:
        return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in self.pids)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)


def measure(group, calls: int, block: int) -> list[float]:
    times = []
    payload = b"x" * 64
    for _ in range(calls // block):
        for _ in range(block):
            start = time.perf_counter()
            group.round_trip(payload)
            times.append(time.perf_counter() - start)
    return times


def after_idle(group, idle_s: float, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        time.sleep(idle_s)
        start = time.perf_counter()
        group.round_trip(b"x" * 64)
        out.append(time.perf_counter() - start)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,8", help="reader counts (default 4,8)")
    ap.add_argument("--calls", type=int, default=1000, help="round trips per path and rank count")
    ap.add_argument("--block", type=int, default=100, help="round trips per block; the paths alternate by block")
    ap.add_argument("--idle-s", type=float, default=1.0, help="idleness before each 'after idle' round trip")
    ap.add_argument("--idle-samples", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)

    from rankmesh.backends.ray.runtime import ensure_ray

    ensure_ray(num_cpus=4, logging_level="ERROR", log_to_driver=False)
    rows = []
    for ranks in [int(n) for n in args.ranks.split(",") if n]:
        groups = {"ring": RingGroup(ranks), "calls": RingGroup(ranks, calls=True), "ray": RayGroup(ranks)}
        try:
            for g in groups.values():
                measure(g, args.block, args.block)  # warm up
            times: dict[str, list[float]] = {name: [] for name in groups}
            for _ in range(max(1, args.calls // args.block)):
                for name, g in groups.items():
                    times[name] += measure(g, args.block, args.block)
            idle = {name: after_idle(g, args.idle_s, args.idle_samples) for name, g in groups.items()}
            cpu = {}
            for name, g in groups.items():
                before = g.cpu_s()
                time.sleep(max(1.0, args.idle_s))
                cpu[name] = (g.cpu_s() - before) / max(1.0, args.idle_s) / ranks
            for name in groups:
                row = {"ranks": ranks, "path": name, "p50_ms": 1e3 * statistics.median(times[name]),
                       "p99_ms": 1e3 * pct(times[name], 0.99), "after_idle_ms": 1e3 * statistics.median(idle[name]),
                       "idle_cpu_per_rank": cpu[name]}
                rows.append(row)
        finally:
            for g in groups.values():
                g.close()
    print("ring: raw bytes through the ring; calls: rankmesh call headers decoded and run on a Worker at each rank; "
          "ray: one Ray actor task per rank")
    print(f"{'ranks':>5} {'path':>5} {'p50 ms':>8} {'p99 ms':>8} {'after idle ms':>14} {'idle CPU/rank':>14}")
    for r in rows:
        print(f"{r['ranks']:5d} {r['path']:>5} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['after_idle_ms']:14.3f} "
              f"{r['idle_cpu_per_rank']:14.2%}")
    for ranks in sorted({r["ranks"] for r in rows}):
        ray = next(r for r in rows if r["ranks"] == ranks and r["path"] == "ray")
        for name in ("ring", "calls"):
            mine = next(r for r in rows if r["ranks"] == ranks and r["path"] == name)
            print(f"{ranks} ranks: {name} p50 round trip {ray['p50_ms'] / mine['p50_ms']:.1f}x faster than Ray's")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
