#!/usr/bin/env python
"""Ranks in Ray actors against ranks forked from a warm process: start-up and refit, side by side in one run.

For each round, and each process model in turn (``process_model="ray"``, then ``"fork"``, the
order swapped every round so that a change in machine load hits both alike), this starts a group
of ``--ranks`` CPU ranks of a plain worker (torch and rankmesh imported, no megatron-core) and
prints:

* **start**: seconds from the constructor to the group's first answer, and the CPU-seconds the
  whole machine spent meanwhile (``/proc/stat``: every process, Ray's own included; the machine
  should run nothing else);
* **first tensor call** through Ray's tasks (a non-blocking call with a tensor batch): a forked
  rank's holder imports torch when the first tensor reaches it, a Ray actor has it already;
* **first future passed along**: a non-blocking call's future from one group handed to a call of
  the other, seconds and the machine's CPU-seconds: a forked rank fetches its parts through its
  holder, which passes them on sealed (a holder that read the future itself imported torch);
* **call on Ray's tasks**: the median round trip of a small non-blocking call sent on Ray's
  tasks (``set_control("ray")``), in milliseconds: a forked rank's call goes through its node's
  holder;
* **refit**: a reshard of ``--mib`` MiB from a tp2 group to a dp group of the same process model,
  through Ray's object store (``transport="store"``: through the holders for forked ranks) and
  by direct reads (``"auto"``), median of ``--repeat``.

The first round's fork start includes the warm process's own imports (once per node and import
set); later rounds show a group starting on a warm node.  Ratios fork/ray are printed per round.

    python scripts/bench_process_models.py                   # 4 ranks, 3 rounds, 64 MiB refit
    python scripts/bench_process_models.py --ranks 8 --rounds 2 --mib 16
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import torch  # noqa: E402

from rankmesh.data import DataProto  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.reshard import ParamLayout, local_shape  # noqa: E402
from rankmesh.reshard.worker import ReshardWorker  # noqa: E402

logger = logging.getLogger("bench_process_models")
MODELS = ("ray", "fork")


class Weights(ReshardWorker):
    """This rank's shards of ``layouts``, every element ``fill``; a non-blocking data call to time."""

    def __init__(self, layouts: list[ParamLayout], fill: float) -> None:
        super().__init__()
        self.layouts = layouts
        self.tensors = {p.name: torch.full(local_shape(p, self.mesh), fill) for p in layouts}

    def reshard_layouts(self) -> list[ParamLayout]:
        return self.layouts

    def reshard_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @register(Dispatch.ONE_TO_ALL)
    def total(self) -> float:
        return float(sum(t.double().sum() for t in self.tensors.values()))

    @register(Dispatch.ONE_TO_ALL)
    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def rows_nb(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict({"n": torch.full((len(batch),), float(self.rank))})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def rows(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict({"n": batch.batch["n"] + 1})


def machine_cpu_s() -> float:
    """CPU-seconds every process of the machine has used since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def start(model: str, ranks: int, layouts: list[ParamLayout], mesh: RankMesh, fill: float):
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    cpu, t = machine_cpu_s(), time.perf_counter()
    group = RayWorkerGroup(RayResourcePool([ranks], use_gpu=False), RayClassWithInitArgs(Weights, layouts, fill),
                           mesh=mesh, process_model=model)
    group.total()
    return group, time.perf_counter() - t, machine_cpu_s() - cpu


def first_tensor_call(group, ranks: int) -> float:
    batch = DataProto.from_dict({"x": torch.zeros(ranks * 4, 8)})
    t = time.perf_counter()
    group.rows_nb(batch).get()
    return time.perf_counter() - t


def first_future(src, dst, ranks: int) -> tuple[float, float]:
    """The first call of ``dst`` given a future of ``src``: seconds, and the machine's CPU-seconds."""
    future = src.rows_nb(DataProto.from_dict({"x": torch.zeros(ranks * 4, 8)}))
    future.get()  # the source's outputs are in: what is timed is the handing over
    cpu, t = machine_cpu_s(), time.perf_counter()
    out = dst.rows(future)
    took, cpu = time.perf_counter() - t, machine_cpu_s() - cpu
    if len(out) != ranks * 4:
        raise SystemExit(f"the future's call returned {len(out)} rows, not {ranks * 4}")
    return took, cpu


def tasks_call_ms(group, ranks: int, calls: int = 30) -> float:
    """Median milliseconds of a small non-blocking call sent on Ray's tasks (not the call session)."""
    batch = DataProto.from_dict({"x": torch.zeros(ranks, 8)})
    group.set_control("ray")
    try:
        group.rows_nb(batch).get()
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            group.rows_nb(batch).get()
            times.append(time.perf_counter() - t)
    finally:
        group.set_control("auto")
    return 1e3 * statistics.median(times)


def refit(src, dst, mesh: RankMesh, transport: str, repeat: int) -> float:
    from rankmesh.reshard.run import plan_between, reshard

    plan = plan_between(src, dst, dst_mesh=mesh)
    reshard(src, dst, plan, transport=transport)  # warm-up: each process's first object-store use
    times = []
    for _ in range(repeat):
        dst.zero()
        t = time.perf_counter()
        reshard(src, dst, plan, transport=transport)
        times.append(time.perf_counter() - t)
        # Every destination rank holds the whole model, every element 1.0 (the sources' fill).
        want = float(sum(p.nbytes // p.itemsize for p in plan.dst_params.values()))
        if dst.total() != [want] * len(dst.total()):
            raise SystemExit(f"refit over {transport} left {dst.total()} on the destinations, not {want} each")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="ranks per group, even (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both models (default %(default)s)")
    parser.add_argument("--mib", type=float, default=64.0, help="refit size in MiB (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="timed refits per transport (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from rankmesh.backends.ray import ensure_ray

    ensure_ray(num_cpus=4 * args.ranks + 4, object_store_memory=int(max(1 << 30, 8 * args.mib * (1 << 20))))
    side = max(64, int((args.mib * (1 << 20) / 4) ** 0.5) // 64 * 64)
    layouts = [ParamLayout("w", (side, side), tp_dim=0), ParamLayout("b", (side,))]
    src_mesh, dst_mesh = RankMesh(tp=2, dp=args.ranks // 2), RankMesh(dp=args.ranks)
    logger.info("%d ranks a group, %.0f MiB refit (tp2 -> dp%d), %d cores, load %.1f", args.ranks,
                sum(p.nbytes for p in layouts) / (1 << 20), args.ranks, os.cpu_count(), os.getloadavg()[0])
    for round_ in range(args.rounds):
        row: dict[str, dict[str, float]] = {}
        for model in (MODELS if round_ % 2 == 0 else MODELS[::-1]):
            src, start_s, start_cpu = start(model, args.ranks, layouts, src_mesh, fill=1.0)
            dst, _, _ = start(model, args.ranks, layouts, dst_mesh, fill=0.0)
            try:
                future_s, future_cpu_s = first_future(src, dst, args.ranks)
                row[model] = {"start_s": start_s, "start_cpu_s": start_cpu, "first_tensor_s": first_tensor_call(dst, args.ranks),
                              "first_future_s": future_s, "first_future_cpu_s": future_cpu_s,
                              "tasks_call_ms": tasks_call_ms(dst, args.ranks),
                              "store_s": refit(src, dst, dst_mesh, "store", args.repeat),
                              "direct_s": refit(src, dst, dst_mesh, "auto", args.repeat)}
            finally:
                src.shutdown()
                dst.shutdown()
        for key in row["ray"]:
            logger.info("round %d  %-15s ray %7.2f   fork %7.2f   fork/ray %5.2f", round_ + 1, key, row["ray"][key],
                        row["fork"][key], row["fork"][key] / row["ray"][key])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
