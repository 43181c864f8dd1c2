#!/usr/bin/env python
"""Dispatch cost of a rankmesh RayWorkerGroup against the same calls hand-written in plain Ray.

Workloads (8 ranks, one group on a tp2·pp2·dp2 mesh, echo methods that return their input):

* ``noop``     ONE_TO_ALL, no payload;
* ``dp``       DP_COMPUTE_PROTO: 8 pieces, every rank returns its piece;
* ``mesh``     MEGATRON_COMPUTE_PROTO: 2 dp pieces, each sent to 4 ranks, collected from tp0/last pp;
* ``pp_as_dp`` MEGATRON_PP_AS_DP_PROTO: 4 pieces (pp x dp), collected from every tp0 rank;
* ``traced``   the ``noop`` call with a trace recording (``rankmesh.tracing``) against the same
  call untraced, alternated in one run: here the "floor" column is the untraced call, so the
  ratio is the cost of tracing (target: at most 1.05).

The floor is the same call in plain Ray: as many plain actors (one CPU each, on the same node),
one ``ray.put`` per distinct piece as a numpy view, replicas sharing the reference, only the
collect ranks returning data, the controller fetching only those and concatenating them (the
caller gets one batch, as from rankmesh).  Floor workers read their piece zero-copy and
read-only; rankmesh workers get a private writable view (the isolation rule: copy-on-write by
default, a private copy on the fallback path or with ``receive="copy"``).  ``copy ms`` is what
the copying receive would cost: one copy of every rank's piece, done serially here (on N cores
the workers do it in parallel); the copy-on-write path does not pay it.

``--workers-write``: every worker writes its whole input once (floor workers copy their read-only
input first, then write).  Each data workload then prints two rows: ``mesh`` as written (the
default copy-on-write receive: the writes copy page by page) and ``mesh:copy``, the same method
declaring ``@register(..., receive="copy")`` (one private copy up front, as the floor does).  ``--meshes tp2pp2dp2,tp4dp2,tp8dp1``: repeat the rows on other 8-rank meshes (the
replica count of a dp piece is tp·pp).

Also prints micro figures: DataProto ``chunk`` and ``concat`` of a 256 MiB batch against
``numpy.concatenate``, and the in-band pickle size of a 256 MiB batch.

    python scripts/bench_dispatch.py                       # 0, 1, 64, 256 MiB
    python scripts/bench_dispatch.py --quick --json out.json
    python scripts/bench_dispatch.py --sizes 64 --workloads mesh --repeat 10
    python scripts/bench_dispatch.py --sizes 64 --workloads mesh --meshes tp2pp2dp2,tp4dp2,tp8dp1
    python scripts/bench_dispatch.py --sizes 64 --workloads dp,mesh --workers-write
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import pickle
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

MIB = 1 << 20
ROWS = 1024
WORLD = 8
WORKLOADS = ("noop", "dp", "mesh", "pp_as_dp", "traced")
MODE_OF = {"dp": "DP_COMPUTE_PROTO", "mesh": "MEGATRON_COMPUTE_PROTO", "pp_as_dp": "MEGATRON_PP_AS_DP_PROTO"}


@dataclass
class Result:
    mesh: str
    workload: str
    mib: float
    rankmesh_ms: float
    floor_ms: float
    ratio: float
    mb_per_s: float | None
    copy_ms: float
    repeat: int


def median_ms(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def paired_ms(fn_a, fn_b, repeat: int, warmup: int = 2) -> tuple[float, float]:
    """Medians of ``fn_a`` and ``fn_b``, timed alternately so that load drift hits both alike."""
    for _ in range(warmup):
        fn_a()
        fn_b()
    a, b = [], []
    for _ in range(repeat):
        for fn, out in ((fn_a, a), (fn_b, b)):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1000)
    return statistics.median(a), statistics.median(b)


def _bench_worker():
    """The rankmesh worker class (built here so that ``--help`` imports neither torch nor ray)."""
    from rankmesh.data import DataProto
    from rankmesh.dispatch import Dispatch, register
    from rankmesh.worker import Worker

    copy = {"receive": "copy"} if "receive" in inspect.signature(register).parameters else {}

    class DispatchBenchWorker(Worker):
        def __init__(self, write: bool = False) -> None:
            self.write = write

        def _echo(self, data: DataProto) -> DataProto:
            if self.write:
                data.batch["x"].add_(0.0)  # writes every byte of the input, in place
            return data

        @register(Dispatch.ONE_TO_ALL)
        def noop(self) -> None:
            return None

        @register(Dispatch.DP_COMPUTE_PROTO)
        def echo_dp(self, data: DataProto) -> DataProto:
            return self._echo(data)

        @register(Dispatch.MEGATRON_COMPUTE_PROTO)
        def echo_mesh(self, data: DataProto) -> DataProto:
            return self._echo(data)

        @register(Dispatch.MEGATRON_PP_AS_DP_PROTO)
        def echo_pp_as_dp(self, data: DataProto) -> DataProto:
            return self._echo(data)

        # The same methods declaring that they overwrite their input: one private copy up front.
        # (A rankmesh without receive= -- measuring an older tree -- runs them as plain echoes.)
        @register(Dispatch.DP_COMPUTE_PROTO, **copy)
        def echo_dp_copy(self, data: DataProto) -> DataProto:
            return self._echo(data)

        @register(Dispatch.MEGATRON_COMPUTE_PROTO, **copy)
        def echo_mesh_copy(self, data: DataProto) -> DataProto:
            return self._echo(data)

        @register(Dispatch.MEGATRON_PP_AS_DP_PROTO, **copy)
        def echo_pp_as_dp_copy(self, data: DataProto) -> DataProto:
            return self._echo(data)

    return DispatchBenchWorker


def _floor_actor():
    import ray

    @ray.remote(num_cpus=1)
    class FloorActor:
        def __init__(self, write: bool = False) -> None:
            self.write = write

        def noop(self) -> None:
            return None

        def echo(self, collect: bool, piece):
            if self.write:  # the input is read-only: copy, then write every byte
                piece = piece.copy()
                piece += 0.0
            return piece if collect else None

    return FloorActor


def make_batch(mib: float):
    import torch

    from rankmesh.data import DataProto

    cols = int(mib * MIB / 4 / ROWS)
    return DataProto.from_dict({"x": torch.randn(ROWS, cols) if cols else torch.empty(ROWS, 0)})


class Floor:
    """The hand-written plain-Ray version of each workload."""

    def __init__(self, mesh, write: bool = False) -> None:
        import ray

        from rankmesh.dispatch.modes import DEFAULT_REGISTRY

        cls = _floor_actor()
        self.actors = [cls.remote(write) for _ in range(WORLD)]
        ray.get([a.noop.remote() for a in self.actors])
        self.plans = {w: DEFAULT_REGISTRY.resolve(m).plan(mesh) for w, m in MODE_OF.items()}

    def noop(self) -> None:
        import ray

        ray.get([a.noop.remote() for a in self.actors])

    def echo(self, workload: str, arr):
        import numpy as np
        import ray

        plan = self.plans[workload]
        refs = [ray.put(p) for p in np.split(arr, plan.n_pieces)]
        collect = set(plan.collect_ranks)
        out = {
            r: self.actors[r].echo.remote(r in collect, refs[plan.piece_of_rank[r]]) for r in plan.run_ranks
        }
        parts = ray.get([out[r] for r in plan.collect_ranks])
        return np.concatenate(parts)


def isolation_copy_ms(workload: str, arr, plans) -> float:
    """Serial time of the copies a copying receive makes (one per rank and piece; the fallback path)."""
    import numpy as np

    if workload == "noop" or arr.nbytes == 0:
        return 0.0
    plan = plans[workload]
    pieces = np.split(arr, plan.n_pieces)

    def copy_all():
        for r in plan.run_ranks:
            pieces[plan.piece_of_rank[r]].copy()

    return median_ms(copy_all, 3, warmup=1)


def traced_call(fn):
    """``fn`` run with a trace recording (the recorder is installed for the call only)."""
    from rankmesh.tracing import Recorder, install

    recorder = Recorder()

    def call():
        previous = install(recorder)
        try:
            return fn()
        finally:
            install(previous)

    return call


def run_dispatch(args: argparse.Namespace, processes: Any = None) -> list[Result]:
    """Every mesh's rows.  ``processes``: where the rankmesh group runs (``start``/``stop``; default a
    new pool per group, :class:`~rankmesh.backends.ray.group.PoolPerGroup`)."""
    import ray

    from rankmesh.backends.ray import PoolPerGroup, RayClassWithInitArgs
    from rankmesh.backends.ray.runtime import ensure_ray
    from rankmesh.mesh import RankMesh

    store = max(512, int(6 * max(args.sizes) + 256)) * MIB
    conn = ensure_ray(num_cpus=2 * WORLD + 2, object_store_memory=store)
    processes = processes if processes is not None else PoolPerGroup()
    results = []
    try:
        for mesh_name in args.meshes:
            mesh = RankMesh(**parse_mesh(mesh_name))
            init = RayClassWithInitArgs(_bench_worker(), args.workers_write)
            wg = processes.start([WORLD], init, mesh)
            floor = Floor(mesh, args.workers_write)
            try:
                results += run_mesh(args, mesh_name, wg, floor)
            finally:
                processes.stop(wg)
                for a in floor.actors:
                    ray.kill(a)
    finally:
        if conn.started_here:
            ray.shutdown()
    return results


def parse_mesh(name: str) -> dict[str, int]:
    """``tp2pp2dp2`` -> ``{"tp": 2, "pp": 2, "dp": 2}``; the sizes must multiply to 8."""
    import re

    parts = re.findall(r"(tp|pp|dp|cp)(\d+)", name)
    if "".join(a + b for a, b in parts) != name:
        raise SystemExit(f"--meshes: cannot read {name!r}; write it like tp2pp2dp2 or tp8dp1")
    sizes = {a: int(b) for a, b in parts}
    if __import__("math").prod(sizes.values()) != WORLD:
        raise SystemExit(f"--meshes: {name} has {__import__('math').prod(sizes.values())} ranks, the benchmark uses {WORLD}")
    return sizes


def run_mesh(args: argparse.Namespace, mesh_name: str, wg, floor) -> list[Result]:
    import numpy as np

    results = []
    for mib in args.sizes:
        batch = make_batch(mib)
        arr = batch.batch["x"].numpy()
        repeat = args.repeat if args.repeat else (10 if mib < 64 else 5)
        for workload in args.workloads:
            if workload == "noop":
                if mib != args.sizes[0]:
                    continue
                rm, fl = paired_ms(wg.noop, floor.noop, max(repeat, 20), warmup=5)
                res = Result(mesh_name, "noop", 0, rm, fl, rm / fl, None, 0.0, max(repeat, 20))
            elif workload == "traced":
                if mib != args.sizes[0]:
                    continue
                n = max(repeat, 40)
                traced, plain = paired_ms(traced_call(wg.noop), wg.noop, n, warmup=5)
                res = Result(mesh_name, "traced", 0, traced, plain, traced / plain, None, 0.0, n)
            else:
                # --workers-write: each data workload twice, as written (copy-on-write receive,
                # the writes copy page by page) and declaring receive="copy" (one copy up front).
                for suffix in ("", "_copy") if args.workers_write else ("",):
                    method = getattr(wg, f"echo_{workload}{suffix}")
                    out = method(batch)
                    assert len(out) == ROWS and out.batch["x"].shape == batch.batch["x"].shape
                    assert np.array_equal(floor.echo(workload, arr), arr)
                    del out
                    rm, fl = paired_ms(lambda: method(batch), lambda: floor.echo(workload, arr), repeat)
                    copy = isolation_copy_ms(workload, arr, floor.plans)
                    rate = mib * MIB / 1e6 / (rm / 1000) if mib else None
                    name = workload + (":copy" if suffix else "")
                    res = Result(mesh_name, name, mib, rm, fl, rm / fl, rate, copy, repeat)
                    results.append(res)
                    print(format_row(res), flush=True)
                continue
            results.append(res)
            print(format_row(res), flush=True)
    return results


def micro(mib: int) -> dict[str, float]:
    """chunk/concat of a ``mib`` batch vs numpy, and the in-band pickle size."""
    import numpy as np
    import torch

    from rankmesh.data import DataProto

    batch = make_batch(mib)
    x = batch.batch["x"]
    chunks = batch.chunk(WORLD)
    shared = all(c.batch["x"].untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for c in chunks)
    chunk_ms = median_ms(lambda: batch.chunk(WORLD), 5, warmup=1)
    concat_ms = median_ms(lambda: DataProto.concat(chunks), 5, warmup=1)
    arrays = [c.batch["x"].numpy() for c in chunks]
    np_ms = median_ms(lambda: np.concatenate(arrays), 5, warmup=1)
    cat = DataProto.concat(chunks)
    assert torch.equal(cat.batch["x"], x)
    buffers: list = []
    inband = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    oob = sum(b.raw().nbytes for b in buffers)
    return {
        "mib": mib,
        "chunk_ms": chunk_ms,
        "chunk_copies_nothing": shared,
        "concat_ms": concat_ms,
        "numpy_concatenate_ms": np_ms,
        "concat_ratio": concat_ms / np_ms,
        "inband_pickle_bytes": len(inband),
        "out_of_band_bytes": oob,
    }


def header() -> str:
    return f"{'mesh':<10} {'workload':<13} {'MiB':>5} {'rankmesh ms':>12} {'floor ms':>9} {'ratio':>6} {'MB/s':>8} {'copy ms':>8}"


def format_row(r: Result) -> str:
    rate = f"{r.mb_per_s:8.0f}" if r.mb_per_s else f"{'-':>8}"
    return f"{r.mesh:<10} {r.workload:<13} {r.mib:>5g} {r.rankmesh_ms:>12.2f} {r.floor_ms:>9.2f} {r.ratio:>6.2f} {rate} {r.copy_ms:>8.1f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    nums = lambda text: [float(x) for x in text.split(",") if x]  # noqa: E731
    names = lambda text: [x for x in text.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=nums, default=None, help="payload sizes in MiB (default 0,1,64,256)")
    p.add_argument("--workloads", type=names, default=list(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    p.add_argument("--repeat", type=int, default=0, help="timed calls per figure (default 10, 5 from 64 MiB)")
    p.add_argument("--micro-mib", type=int, default=256, help="batch size of the micro figures (0: skip them)")
    p.add_argument("--json", default=None, help="write results as JSON to this path ('-' for stdout)")
    p.add_argument("--meshes", type=names, default=["tp2pp2dp2"], help="8-rank meshes, e.g. tp2pp2dp2,tp4dp2,tp8dp1")
    p.add_argument("--workers-write", action="store_true", help="every worker writes its whole input once")
    p.add_argument("--quick", action="store_true", help="sizes 0,1,64, 3 repeats, 64 MiB micro figures")
    args = p.parse_args(argv)
    bad = set(args.workloads) - set(WORKLOADS)
    if bad:
        p.error(f"unknown workloads {sorted(bad)}")
    if args.quick:
        args.sizes = args.sizes or [0, 1, 64]
        args.repeat = args.repeat or 3
        args.micro_mib = min(args.micro_mib, 64)
    args.sizes = args.sizes if args.sizes is not None else [0, 1, 64, 256]
    return args


def main(argv: list[str] | None = None, processes: Any = None) -> int:
    """The command; ``processes`` as in :func:`run_dispatch`."""
    args = parse_args(argv)
    write = ", workers write their input" if args.workers_write else ""
    receive = os.environ.get("RANKMESH_RECEIVE", "auto")
    print(f"# rankmesh dispatch vs plain Ray, {WORLD} ranks, {os.cpu_count()} CPUs, receive={receive}{write}", flush=True)
    print(header(), flush=True)
    results = run_dispatch(args, processes)
    print("# ratio = rankmesh / floor; copy ms = serial cost of a copying receive (not paid by copy-on-write)")
    if "traced" in args.workloads:
        print("# traced: 'rankmesh ms' is the noop call traced, 'floor ms' the same call untraced")
    figures = micro(args.micro_mib) if args.micro_mib else None
    if figures:
        print(
            f"# micro ({figures['mib']} MiB): chunk {figures['chunk_ms']:.3f} ms "
            f"(copies nothing: {figures['chunk_copies_nothing']}), concat {figures['concat_ms']:.1f} ms vs "
            f"numpy.concatenate {figures['numpy_concatenate_ms']:.1f} ms ({figures['concat_ratio']:.2f}x), "
            f"in-band pickle {figures['inband_pickle_bytes']} B + {figures['out_of_band_bytes']} B out of band"
        )
    if args.json:
        payload = json.dumps({"results": [asdict(r) for r in results], "micro": figures}, indent=2)
        if args.json == "-":
            print(payload)
        else:
            with open(args.json, "w") as f:
                f.write(payload + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
