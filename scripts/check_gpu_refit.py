#!/usr/bin/env python
"""Check, on a GPU machine, a colocated refit through CUDA IPC and a pinned (page-locked) receive.

Why a script and not a test: CI has no GPU.  The CPU suite checks the route rule, the error of
``transport="cuda_ipc"`` on CPU tensors, the page arithmetic of the pinned receive and its
fallback (``tests/test_refit_ipc_cpu.py``); what only a GPU can show is that the bytes arrive,
device to device, and what each path costs.

Checks (one local Ray on 127.0.0.1; each check runs on its own, a failure is recorded with its
traceback and the next one runs):

1. ``colocated_ipc``: a trainer and a rollout group of one rank each, on ONE bundle of a
   ``RayResourcePool([1], use_gpu=True, max_colocate_count=2)`` (0.5 GPU each, as verl's hybrid
   engine colocates them), ``--weights-mib`` of weights on ``cuda``.  ``reshard(transport="auto")``
   must route every byte through CUDA IPC (``bytes_ipc == plan.bytes_moved``, nothing put);
   every rollout tensor must equal the numpy full tensor.  Timed ``--repeat`` times, beside a
   device-to-device copy of the same bytes inside the trainer's process and one refit with
   ``transport="store"`` (the path CUDA sources took before).
2. ``ipc_megatron_cut``: a tp2 trainer into a dp2 rollout and back (qkv with stride 3, a
   row-parallel ``proj`` split along dim 1: strided regions on both sides), four processes on
   the machine's first GPU (pools without GPUs, so Ray leaves the visible devices alone),
   ``transport="cuda_ipc"``; every destination shard must equal megatron's cut of the full
   tensors, computed here with numpy.
3. ``cuda_ipc_refused``: the trainer's tensors moved to the CPU, ``transport="cuda_ipc"`` must
   raise a ReshardError naming the pair, and ``"auto"`` must still move the weights (direct read).
4. ``pinned_receive``: one rank receives fresh ``--batch-mib`` batches and moves each to
   ``cuda``, alternating the pageable copy and ``rankmesh.data.receive.pinned`` (read-only
   ``cudaHostRegister`` of the object store's shared pages behind the copy-on-write view):
   registration, copy and unregistration timed apart; no host copy, no private page of the
   input (``/proc/self/smaps``), sums equal numpy's; ``to_device(pin=True)`` on the same view.

Without CUDA the same groups run on the CPU with small sizes: 1 and 2 check the direct path,
the IPC parts print SKIP; 4 checks the fallback.  The script ends with ``key: value`` figure
lines and exits 0 when every check holds.

    python scripts/check_gpu_refit.py                      # GPU: 1 GiB of weights, 256 MiB batches
    python scripts/check_gpu_refit.py --weights-mib 2048 --batch-mib 128 --repeat 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rankmesh import sharedmem  # noqa: E402
from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, ensure_ray  # noqa: E402
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.data.receive import pinned, to_device  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.errors import ReshardError  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.reshard import ParamLayout, ReshardWorker, plan_reshard, reshard  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402

MIB = 1 << 20
CUDA = torch.cuda.is_available()


# ----- weights and megatron's cut (numpy, independent of rankmesh) ---------------------------------


def full_tensor(layout: ParamLayout, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, sum(layout.name.encode())])
    return rng.standard_normal(layout.shape, dtype=np.float32)


def megatron_cut(full: np.ndarray, layout: ParamLayout, mesh: RankMesh, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard as megatron cuts it: ``tp * stride`` blocks, every tp-th one."""
    if layout.tp_dim is None:
        return full
    tp, tp_rank = mesh.size("tp"), mesh.coords(rank).tp_rank
    blocks = np.split(full, tp * layout.tp_stride, axis=layout.tp_dim)
    return np.concatenate(blocks[tp_rank::tp], axis=layout.tp_dim)


def big_layouts(total_mib: int) -> list[ParamLayout]:
    """Four replicated matrices of ``total_mib`` MiB in all (float32, 4096 columns)."""
    rows = max(1, total_mib * MIB // 4 // 4096 // 4)
    return [ParamLayout(f"w{i}", (rows, 4096)) for i in range(4)]


def cut_layouts(mib: int) -> list[ParamLayout]:
    """Layouts whose tp cut makes strided regions on both sides of a tp2 <-> tp1 reshard."""
    h = max(96, int((mib * MIB / 4 / 6) ** 0.5) // 96 * 96)  # qkv 3h·h + proj h·h + big 2h·h ~ mib
    return [
        ParamLayout("qkv", (3 * h, h), tp_dim=0, tp_stride=3),
        ParamLayout("proj", (h, h), tp_dim=1),
        ParamLayout("ln", (h,)),
        ParamLayout("big", (2 * h, h)),
    ]


class Holder(ReshardWorker):
    """This rank's shards of ``layouts`` on ``device`` (zeros without a seed)."""

    def __init__(self, layouts: list[ParamLayout], seed: int | None, device: str) -> None:
        self.layouts = layouts
        self.device = torch.device(device)
        self.tensors = {
            p.name: torch.from_numpy(megatron_cut(full_tensor(p, seed or 0), p, self.mesh, self.rank)
                                     * (seed is not None)).to(self.device)
            for p in layouts
        }

    def reshard_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def reshard_layouts(self) -> list[ParamLayout]:
        return self.layouts

    @register(Dispatch.ONE_TO_ALL)
    def mismatches(self, seed: int) -> list[str]:
        """Names of tensors that differ from megatron's cut of the seeded full tensors (numpy)."""
        bad = []
        for p in self.layouts:
            want = megatron_cut(full_tensor(p, seed), p, self.mesh, self.rank)
            if not np.array_equal(self.tensors[p.name].cpu().numpy(), want):
                bad.append(f"rank {self.rank} {p.name}")
        return bad

    @register(Dispatch.ONE_TO_ALL)
    def devices(self) -> list[str]:
        return sorted({str(t.device) for t in self.tensors.values()})

    @register(Dispatch.ONE_TO_ALL)
    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @register(Dispatch.ONE_TO_ALL)
    def move(self, device: str) -> None:
        self.device = torch.device(device)
        self.tensors = {n: t.to(self.device) for n, t in self.tensors.items()}

    @register(Dispatch.ONE_TO_ALL)
    def local_copy_s(self, repeat: int) -> float:
        """Median seconds of copying every tensor into a fresh one on the same device (the floor)."""
        out = {n: torch.empty_like(t) for n, t in self.tensors.items()}
        times = []
        for _ in range(repeat + 1):
            sync(self.device)
            t0 = time.perf_counter()
            for n, t in self.tensors.items():
                out[n].copy_(t)
            sync(self.device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])  # the first pays for the allocation


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----- pinned receive -------------------------------------------------------------------------------


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


class Receiver(Worker):
    """Moves each received batch to the device, pageable or pinned, and reports what it cost."""

    @register(Dispatch.ONE_TO_ALL)
    def move(self, data: DataProto, pin: bool) -> dict:
        device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
        x = data.batch["x"]
        nbytes = x.numel() * x.element_size()
        copies = sharedmem.receive_info()["copies"]
        sync(device)
        t0 = time.perf_counter()
        if pin:
            with pinned(data, device) as p:
                t1 = time.perf_counter()
                moved = data.to(device)
                sync(device)
                t2 = time.perf_counter()
        else:
            p, t1 = None, t0
            moved = data.to(device)
            sync(device)
            t2 = time.perf_counter()
        t3 = time.perf_counter()  # after unregistration
        report = {
            "pin": pin,
            "pinned": bool(p and p.pinned),
            "why_not": p.why_not if p else None,
            "register_ms": (t1 - t0) * 1e3,
            "h2d_ms": (t2 - t1) * 1e3,
            "unregister_ms": (t3 - t2) * 1e3,
            "total_ms": (t3 - t0) * 1e3,
            "host_copies": sharedmem.receive_info()["copies"] - copies,
            "dirty_kib": anonymous_kib(x.data_ptr(), nbytes),
            "receive": sharedmem.receive_info()["path"],
            "device": str(moved.batch["x"].device),
            "sums": moved.batch["x"].double().sum(dim=1).cpu().numpy(),
        }
        # the public entry point, on the same (still unwritten) view
        again = to_device(data, device, pin=True)
        report["to_device_equal"] = bool(torch.equal(again.batch["x"].cpu(), x))
        report["dirty_kib_after_to_device"] = anonymous_kib(x.data_ptr(), nbytes)
        return report


# ----- the checks -----------------------------------------------------------------------------------


class Checks:
    """Runs named checks, each on its own; collects failures and figures."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.figures: dict[str, Any] = {}
        self.status: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            self.status.setdefault(name, "PASS")
        except Exception:  # noqa: BLE001 - record and go on: device minutes are scarce
            self.status[name] = "FAIL"
            self.failures.append(f"{name}: raised\n{traceback.format_exc()}")
        print(f"[{self.status[name]}] {name} ({time.perf_counter() - t0:.1f} s)", flush=True)

    def expect(self, name: str, ok: bool, what: str) -> None:
        if not ok:
            self.status[name] = "FAIL"
            self.failures.append(f"{name}: {what}")
            print(f"  FAIL {what}", flush=True)

    def skip(self, name: str, why: str) -> None:
        print(f"  SKIP {name}: {why}", flush=True)
        self.figures[f"{name}_skipped"] = why


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def colocated_ipc(c: Checks, args: argparse.Namespace) -> None:
    name = "colocated_ipc"
    device = "cuda" if CUDA else "cpu"
    layouts = big_layouts(args.weights_mib)
    mesh = RankMesh()
    pool = RayResourcePool([1], use_gpu=CUDA, max_colocate_count=2)
    trainer = RayWorkerGroup(pool, RayClassWithInitArgs(Holder, layouts, 11, device), mesh=mesh)
    rollout = RayWorkerGroup(pool, RayClassWithInitArgs(Holder, layouts, None, device), mesh=mesh)
    try:
        info = trainer.node_info + rollout.node_info
        print(f"  trainer/rollout pids {[i['pid'] for i in info]}, gpu_ids {[i['gpu_ids'] for i in info]}, "
              f"CUDA_VISIBLE_DEVICES {[i['cuda_visible_devices'] for i in info]}, devices "
              f"{trainer.devices()[0]} / {rollout.devices()[0]}")
        plan = plan_reshard(layouts, mesh, mesh)
        c.figures["refit_bytes"] = plan.bytes_moved
        walls, copies = [], []
        for i in range(args.repeat):
            rollout.zero()
            t0 = time.perf_counter()
            stats = reshard(trainer, rollout, plan, transport="auto")
            walls.append(time.perf_counter() - t0)
            copies.append(stats.copy_s)
            if i == 0:
                print(f"  auto: moved {stats.bytes_moved} B, ipc {stats.bytes_ipc} B, direct {stats.bytes_direct} B, "
                      f"put {stats.bytes_put} B, {walls[-1] * 1e3:.1f} ms")
                if CUDA:
                    c.expect(name, stats.bytes_ipc == plan.bytes_moved and stats.bytes_put == 0,
                             f"IPC moved {stats.bytes_ipc} of {plan.bytes_moved} B, put {stats.bytes_put} B")
                else:
                    c.expect(name, stats.bytes_ipc == 0, f"{stats.bytes_ipc} B through IPC without CUDA")
        bad = rollout.mismatches(11)[0]
        c.expect(name, not bad, f"rollout tensors differ from numpy's after the refit: {bad}")
        wall, copy_s = statistics.median(walls), statistics.median(copies)
        floor = trainer.local_copy_s(args.repeat)[0]
        key = "ipc" if CUDA else "direct(cpu)"
        c.figures[f"refit_{key}_wall_ms"] = round(wall * 1e3, 2)
        c.figures[f"refit_{key}_wall_GBps"] = round(gbps(plan.bytes_moved, wall), 2)
        c.figures[f"refit_{key}_dst_copy_GBps"] = round(gbps(plan.bytes_moved, copy_s), 2)
        c.figures["same_process_d2d_copy_GBps" if CUDA else "same_process_cpu_copy_GBps"] = round(
            gbps(plan.bytes_moved, floor), 2)
        rollout.zero()
        t0 = time.perf_counter()
        stats = reshard(trainer, rollout, plan, transport="store")
        store_s = time.perf_counter() - t0
        c.figures["refit_store_wall_ms"] = round(store_s * 1e3, 2)
        c.figures["refit_store_wall_GBps"] = round(gbps(plan.bytes_moved, store_s), 2)
        bad = rollout.mismatches(11)[0]
        c.expect(name, not bad and stats.bytes_ipc == 0, f"store refit: mismatches {bad}, ipc {stats.bytes_ipc} B")
        if not CUDA:
            c.skip(name + "(ipc)", "no CUDA: the colocated pair used the direct read")
    finally:
        rollout.shutdown()
        trainer.shutdown()


def cut_groups(args: argparse.Namespace) -> tuple[list[ParamLayout], dict[str, RayWorkerGroup]]:
    layouts = cut_layouts(args.cut_mib)
    device = "cuda" if CUDA else "cpu"
    tp2, dp2 = RankMesh(tp=2), RankMesh(dp=2)

    def group(mesh: RankMesh, seed: int | None) -> RayWorkerGroup:
        cls = RayClassWithInitArgs(Holder, layouts, seed, device)
        return RayWorkerGroup(RayResourcePool([mesh.world_size], use_gpu=False), cls, mesh=mesh)

    return layouts, {"tp2": group(tp2, 5), "dp2": group(dp2, None)}


def ipc_megatron_cut(c: Checks, groups: dict[str, RayWorkerGroup], layouts: list[ParamLayout]) -> None:
    name = "ipc_megatron_cut"
    transport = "cuda_ipc" if CUDA else "auto"
    tp2, dp2 = groups["tp2"], groups["dp2"]
    there = plan_reshard(layouts, tp2.mesh, dp2.mesh)
    back = plan_reshard(layouts, dp2.mesh, tp2.mesh)
    for label, src, dst, plan, seed in (("tp2->dp2", tp2, dp2, there, 5), ("dp2->tp2", dp2, tp2, back, 5)):
        dst.zero()
        t0 = time.perf_counter()
        stats = reshard(src, dst, plan, transport=transport)
        wall = time.perf_counter() - t0
        bad = [b for ranks in dst.mismatches(seed) for b in ranks]
        print(f"  {label} transport={transport}: moved {stats.bytes_moved} B, ipc {stats.bytes_ipc} B, "
              f"direct {stats.bytes_direct} B, put {stats.bytes_put} B, {wall * 1e3:.1f} ms, "
              f"{'OK' if not bad else 'MISMATCH ' + ', '.join(bad)}")
        c.expect(name, not bad, f"{label}: shards differ from megatron's cut: {bad}")
        want_ipc = plan.bytes_moved if CUDA else 0
        c.expect(name, stats.bytes_ipc == want_ipc, f"{label}: {stats.bytes_ipc} B through IPC, expected {want_ipc}")
        c.figures[f"cut_{label}_bytes"] = stats.bytes_moved
        c.figures[f"cut_{label}_ms"] = round(wall * 1e3, 2)
    if not CUDA:
        c.skip(name + "(ipc)", "no CUDA: ran with transport='auto' (direct reads)")


def cuda_ipc_refused(c: Checks, groups: dict[str, RayWorkerGroup], layouts: list[ParamLayout]) -> None:
    name = "cuda_ipc_refused"
    tp2, dp2 = groups["tp2"], groups["dp2"]
    plan = plan_reshard(layouts, tp2.mesh, dp2.mesh)
    tp2.move("cpu")
    try:
        try:
            reshard(tp2, dp2, plan, transport="cuda_ipc")
        except ReshardError as exc:
            print(f"  cuda_ipc with CPU source tensors: ReshardError: {str(exc)[:160]}...")
            c.expect(name, "source rank 0 -> destination rank" in str(exc), f"the error names no pair: {exc}")
        else:
            c.expect(name, False, "transport='cuda_ipc' with CPU source tensors did not raise")
        dp2.zero()
        stats = reshard(tp2, dp2, plan, transport="auto")
        bad = [b for ranks in dp2.mismatches(5) for b in ranks]
        print(f"  auto, CPU source -> {dp2.devices()[0]} destination: direct {stats.bytes_direct} B, ipc "
              f"{stats.bytes_ipc} B, put {stats.bytes_put} B")
        c.expect(name, not bad and stats.bytes_ipc == 0 and stats.bytes_direct == plan.bytes_moved,
                 f"auto from CPU sources: mismatches {bad}, ipc {stats.bytes_ipc}, direct {stats.bytes_direct}")
    finally:
        tp2.move("cuda" if CUDA else "cpu")


def pinned_receive(c: Checks, args: argparse.Namespace) -> None:
    name = "pinned_receive"
    rows = 64
    cols = args.batch_mib * MIB // 4 // rows
    group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(Receiver), mesh=RankMesh())
    try:
        reports: dict[bool, list[dict]] = {False: [], True: []}
        for i in range(2 * args.repeat + 2):  # a fresh batch (a fresh copy-on-write view) every call
            x = (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + i) % 1021
            pin = bool(i % 2)
            r = group.move(DataProto.from_dict({"x": x}), pin)[0]
            ok = np.array_equal(r.pop("sums"), x.numpy().astype(np.float64).sum(axis=1))
            c.expect(name, ok, f"call {i} (pin={pin}): row sums on the device differ from numpy's")
            c.expect(name, r["host_copies"] == 0, f"call {i}: {r['host_copies']} host copies")
            if r["receive"] == "cow":
                c.expect(name, r["dirty_kib"] == 0 and r["dirty_kib_after_to_device"] == 0,
                         f"call {i} (pin={pin}): {r['dirty_kib']} / {r['dirty_kib_after_to_device']} KiB of the "
                         "input became private")
            c.expect(name, r["to_device_equal"], f"call {i}: to_device(pin=True) moved other bytes")
            if pin:  # pinning needs CUDA and a copy-on-write view (the object store's shared pages)
                want = CUDA and r["receive"] == "cow"
                c.expect(name, r["pinned"] == want, f"call {i}: pinned={r['pinned']} ({r['why_not']}), expected {want}")
            if i >= 2:  # the first pair warms the device and the worker up
                reports[pin].append(r)
            if i < 2:
                print(f"  call {i}: { {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} }")
        med = {pin: {k: statistics.median(r[k] for r in rs) for k in ("register_ms", "h2d_ms", "unregister_ms", "total_ms")}
               for pin, rs in reports.items()}
        c.figures["receive_batch_mib"] = args.batch_mib
        c.figures["receive_path"] = reports[False][0]["receive"]
        c.figures["h2d_pageable_ms"] = round(med[False]["total_ms"], 2)
        c.figures["h2d_pinned_register_ms"] = round(med[True]["register_ms"], 2)
        c.figures["h2d_pinned_copy_ms"] = round(med[True]["h2d_ms"], 2)
        c.figures["h2d_pinned_unregister_ms"] = round(med[True]["unregister_ms"], 2)
        c.figures["h2d_pinned_total_ms"] = round(med[True]["total_ms"], 2)
        c.figures["pinned_total_over_pageable"] = round(med[True]["total_ms"] / med[False]["total_ms"], 3)
        if not CUDA:
            c.figures["pinned_fallback_reason"] = reports[True][0]["why_not"]
            c.skip(name + "(pinned)", "no CUDA: the pinned path fell back to the pageable copy")
    finally:
        group.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights-mib", type=int, default=1024 if CUDA else 16, help="weights of the colocated refit")
    ap.add_argument("--cut-mib", type=int, default=64 if CUDA else 4, help="weights of the tp2 <-> dp2 check")
    ap.add_argument("--batch-mib", type=int, default=256 if CUDA else 8, help="batch of the pinned receive check")
    ap.add_argument("--repeat", type=int, default=5 if CUDA else 2, help="timed repetitions")
    args = ap.parse_args()

    start = time.perf_counter()
    ensure_ray(num_cpus=max(8, os.cpu_count() or 8), num_gpus=torch.cuda.device_count() if CUDA else 0)
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if CUDA else 'cpu (no CUDA)'}, "
          f"weights {args.weights_mib} MiB, cut {args.cut_mib} MiB, batch {args.batch_mib} MiB, repeat {args.repeat}",
          flush=True)
    c = Checks()
    c.run("colocated_ipc", lambda: colocated_ipc(c, args))
    groups: dict[str, RayWorkerGroup] = {}
    try:
        layouts: list[ParamLayout] = []

        def build() -> None:
            nonlocal layouts
            built, made = cut_groups(args)
            layouts = built
            groups.update(made)

        c.run("cut_groups_start", build)
        if groups:
            c.run("ipc_megatron_cut", lambda: ipc_megatron_cut(c, groups, layouts))
            c.run("cuda_ipc_refused", lambda: cuda_ipc_refused(c, groups, layouts))
    finally:
        for g in groups.values():
            g.shutdown()
    c.run("pinned_receive", lambda: pinned_receive(c, args))

    for f in c.failures:
        print("FAIL", f)
    print("--- figures ---")
    print(f"cuda: {CUDA}")
    for k, v in c.figures.items():
        print(f"{k}: {v}")
    for k, v in c.status.items():
        print(f"check_{k}: {v}")
    print(f"seconds: {time.perf_counter() - start:.1f}")
    print("PASS" if not c.failures else f"{len(c.failures)} failures")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
