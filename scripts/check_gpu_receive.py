#!/usr/bin/env python
"""Check, on a GPU machine, that a received batch goes host→device straight from the shared bytes.

Why a script and not a test: CI has no GPU.  The CPU suite proves the same rule by counting
host copies (``tests/test_receive_paths.py::test_to_device_reads_the_shared_bytes``); this
script runs it where ``.to("cuda")`` is real and also times what the copy-on-write receive
saves against ``receive="copy"``.

What it does (one local Ray on 127.0.0.1, 4 worker processes on a tp2·dp2 mesh):

1. ``move``: a MEGATRON_COMPUTE_PROTO method that moves its received batch to the device
   (``DataProto.to``) and returns per-row sums computed on the device.  The controller checks
   the sums against numpy on its own copy of the batch, and every rank reports its receive
   path, the host copies made during ``.to`` (must be 0), the anonymous (written or copied)
   KiB of its input after ``.to`` (must be 0 on the copy-on-write path) and the H2D time; then
   ``baselines`` times H2D of a private pageable copy and of a pinned copy of the same bytes.
2. ``move_copy``: the same method declaring ``receive="copy"`` (one private host copy before
   the worker runs).  Whole-call wall times of ``move`` and ``move_copy`` are alternated and
   their medians printed side by side.
3. A one-rank :class:`~rankmesh.megatron.MegatronWorker` group on the GPU (nccl, megatron-core
   ``parallel_state``) whose method calls ``self.to_device(data)``: it must land on ``cuda``
   with no host copy.  Skipped without megatron-core or CUDA.

The 4 ranks share GPU 0 of the machine: their pool asks Ray for no GPU, and Ray leaves the
visible devices of such a process alone, so each rank's ``cuda`` is the machine's first GPU (on
a real node a ``use_gpu=True`` pool gives each rank its own).  Without CUDA everything runs on the CPU
(useful only to check the script).  Exit status 0 when every check holds.

    python scripts/check_gpu_receive.py --mib 256 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rankmesh import sharedmem  # noqa: E402
from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.backends.ray.runtime import ensure_ray  # noqa: E402
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402

MIB = 1 << 20
ROWS = 64


def anonymous_kib(addr: int, size: int) -> int:
    """KiB of anonymous (written or copied) pages of this process overlapping ``[addr, addr+size)``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + size and addr < hi
            elif inside and head == "Anonymous:":
                total += int(line.split()[1])
    return total


def device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_h2d(x: torch.Tensor) -> float:
    sync()
    t0 = time.perf_counter()
    x.to(device())
    sync()
    return time.perf_counter() - t0


def row_sums(data: DataProto, report: dict) -> DataProto:
    """Move ``data`` to the device as MegatronWorker.to_device does; record what it cost."""
    x = data.batch["x"]
    copies = sharedmem.receive_info()["copies"]
    sync()
    t0 = time.perf_counter()
    moved = data.to(device())
    sync()
    elapsed = time.perf_counter() - t0
    report.update(
        receive=sharedmem.receive_info()["path"],
        device=str(moved.batch["x"].device),
        host_copies=sharedmem.receive_info()["copies"] - copies,
        dirty_kib=anonymous_kib(x.data_ptr(), x.numel() * x.element_size()),
        mib=x.numel() * x.element_size() / MIB,
        h2d_ms=elapsed * 1e3,
    )
    return DataProto.from_dict({"sum": moved.batch["x"].double().sum(dim=1).cpu()})


class Mover(Worker):
    """Moves its received batch to the device and reports how."""

    def __init__(self) -> None:
        self.report: dict = {}
        self.kept: DataProto | None = None

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def move(self, data: DataProto) -> DataProto:
        self.report, self.kept = {}, data
        return row_sums(data, self.report)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, receive="copy")
    def move_copy(self, data: DataProto) -> DataProto:
        self.report, self.kept = {}, data
        return row_sums(data, self.report)

    @register(Dispatch.ONE_TO_ALL)
    def last_report(self) -> dict:
        return self.report

    @register(Dispatch.ONE_TO_ALL)
    def baselines(self) -> dict:
        """H2D of the kept input from a private pageable copy and from a pinned copy (ms)."""
        x = self.kept.batch["x"]
        out = {"pageable_h2d_ms": timed_h2d(x.clone()) * 1e3}
        if torch.cuda.is_available():
            out["pinned_h2d_ms"] = timed_h2d(x.clone().pin_memory()) * 1e3
        return out


def megatron_worker_class():
    """A MegatronWorker whose method uses ``to_device`` (None without megatron-core)."""
    try:
        from rankmesh.megatron import MegatronWorker
    except ImportError:
        return None

    class DeviceMover(MegatronWorker):
        @register(Dispatch.MEGATRON_COMPUTE_PROTO)
        def move(self, data: DataProto) -> DataProto:
            copies = sharedmem.receive_info()["copies"]
            moved = self.to_device(data)
            self.report = {
                "backend": self._backend,
                "device": str(moved.batch["x"].device),
                "host_copies": sharedmem.receive_info()["copies"] - copies,
                "receive": sharedmem.receive_info()["path"],
            }
            return DataProto.from_dict({"sum": moved.batch["x"].double().sum(dim=1).cpu()})

        @register(Dispatch.ONE_TO_ALL)
        def last_report(self) -> dict:
            return self.report

    return DeviceMover


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="batch size in MiB (each dp replica gets half)")
    ap.add_argument("--repeat", type=int, default=5, help="paired move / move_copy calls timed")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    ensure_ray(num_cpus=max(4, os.cpu_count() or 4))
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if cuda else 'cpu (no CUDA)'}")
    cols = args.mib * MIB // 4 // ROWS
    x = torch.arange(ROWS * cols, dtype=torch.float32).reshape(ROWS, cols) % 1021
    batch = DataProto.from_dict({"x": x})
    expected = x.numpy().astype(np.float64).sum(axis=1)
    failures: list[str] = []

    def check_sums(out: DataProto, what: str) -> None:
        if not np.array_equal(out.batch["sum"].numpy(), expected):
            failures.append(f"{what}: row sums differ from numpy's")

    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(Mover), mesh=RankMesh(tp=2, dp=2))
    try:
        check_sums(wg.move(batch), "move")  # warm-up, and the checked call
        for rank, r in enumerate(wg.last_report()):
            print(f"move      rank {rank}: {r}")
            if r["host_copies"] != 0:
                failures.append(f"rank {rank}: {r['host_copies']} host copies during .to")
            if r["receive"] == "cow" and r["dirty_kib"] != 0:
                failures.append(f"rank {rank}: {r['dirty_kib']} KiB of its input became private during .to")
            if cuda and not r["device"].startswith("cuda"):
                failures.append(f"rank {rank}: moved to {r['device']}")
        for rank, r in enumerate(wg.baselines()):
            print(f"baselines rank {rank}: {r}")
        check_sums(wg.move_copy(batch), "move_copy")
        for rank, r in enumerate(wg.last_report()):
            print(f"move_copy rank {rank}: {r}")
        walls: dict[str, list[float]] = {"move": [], "move_copy": []}
        for _ in range(args.repeat):
            for name in walls:
                t0 = time.perf_counter()
                getattr(wg, name)(batch)
                walls[name].append(time.perf_counter() - t0)
        cow, copy = statistics.median(walls["move"]), statistics.median(walls["move_copy"])
        print(
            f"whole call, {args.mib} MiB, 4 ranks, median of {args.repeat}: copy-on-write {cow * 1e3:.1f} ms, "
            f'receive="copy" {copy * 1e3:.1f} ms, ratio {cow / copy:.2f}'
        )
        print(f"transport_info: {[t['path'] for t in wg.transport_info()]}")
    finally:
        wg.shutdown()

    cls = megatron_worker_class()
    if cls is None or not cuda:
        print("MegatronWorker check skipped: " + ("no megatron-core" if cls is None else "no CUDA"))
    else:
        mg = RayWorkerGroup(RayResourcePool([1], use_gpu=True), RayClassWithInitArgs(cls), mesh=RankMesh())
        try:
            check_sums(mg.move(batch), "MegatronWorker.move")
            r = mg.last_report()[0]
            print(f"MegatronWorker rank 0: {r}")
            if not r["device"].startswith("cuda") or r["host_copies"] != 0 or r["backend"] != "nccl":
                failures.append(f"MegatronWorker: {r}")
        finally:
            mg.shutdown()

    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
