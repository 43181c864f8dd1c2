#!/usr/bin/env python
"""Check, on a GPU machine, that reshard moves weights held on CUDA devices correctly, by both transports.

Why a script and not a test: CI has no GPU.  The CPU tests (``tests/test_reshard_ray.py``) cover
the plan and both transports between CPU tensors; what only a GPU can show is the device edges of
:func:`rankmesh.reshard.reshard`: a source whose tensors are on CUDA has no address
another process can read with ``process_vm_readv``, so a CUDA source with a CPU destination goes
through the object store even under ``transport="auto"``; a CUDA destination of a CPU source reads
into host memory and copies that to its device.  Two CUDA ranks on one GPU now go through CUDA IPC
under ``"auto"`` (its own check, with figures: ``scripts/check_gpu_refit.py``).

What it does (one local Ray on 127.0.0.1): a tp2 "trainer" and a dp2 "generator" (tp1), each once
with its tensors on the CPU and once on ``cuda``; every (source device, destination device) pair
but cpu→cpu is resharded with ``transport="auto"`` and ``"store"``, and every destination shard is
compared with megatron's cut of the seeded full tensors, computed here with numpy.  All ranks
share the machine's first GPU (pools ask Ray for no GPU, so Ray leaves the visible devices alone).
Without CUDA the "cuda" groups hold CPU tensors (useful only to check the script).  Exit status 0
when every shard matches.

    python scripts/check_gpu_reshard.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, ensure_ray  # noqa: E402
from rankmesh.megatron.layouts import MegatronReshardWorker  # noqa: E402
from rankmesh.reshard import reshard  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.reshard import ParamLayout, plan_reshard  # noqa: E402

LAYOUTS = [
    ParamLayout("qkv", (96, 32), tp_dim=0, tp_stride=3),
    ParamLayout("proj", (32, 32), tp_dim=1),
    ParamLayout("ln", (32,)),
    ParamLayout("big", (520, 640)),  # 1.3 MiB: several pieces on the store route
]
SRC, DST = RankMesh(tp=2), RankMesh(dp=2)


def full_tensor(layout: ParamLayout, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, sum(layout.name.encode())])
    return rng.standard_normal(layout.shape).astype(np.float32)


def megatron_cut(full: np.ndarray, layout: ParamLayout, mesh: RankMesh, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard as megatron cuts it: ``tp * stride`` blocks, every tp-th one."""
    if layout.tp_dim is None:
        return full
    tp, tp_rank = mesh.size("tp"), mesh.coords(rank).tp_rank
    blocks = np.split(full, tp * layout.tp_stride, axis=layout.tp_dim)
    return np.concatenate(blocks[tp_rank::tp], axis=layout.tp_dim)


class DeviceHolder(MegatronReshardWorker):
    """This rank's shards on ``device`` (``cuda`` falls back to the CPU without CUDA); zeros without a seed."""

    def __init__(self, seed: int | None, device: str) -> None:
        super().__init__()
        self.device = torch.device(device if device == "cpu" or torch.cuda.is_available() else "cpu")
        self.tensors = {
            p.name: torch.from_numpy(megatron_cut(full_tensor(p, seed or 0), p, self.mesh, self.rank) * (seed is not None)).to(self.device)
            for p in LAYOUTS
        }

    def reshard_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors

    @register(Dispatch.ONE_TO_ALL)
    def shards(self) -> dict[str, np.ndarray]:
        return {n: t.cpu().numpy() for n, t in self.tensors.items()} | {"_device": str(self.device)}

    @register(Dispatch.ONE_TO_ALL)
    def zero(self) -> None:
        for t in self.tensors.values():
            t.zero_()


def main() -> int:
    ensure_ray(num_cpus=max(8, os.cpu_count() or 8))
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu (no CUDA)'}")
    seed = 7

    def group(mesh: RankMesh, device: str, filled: bool) -> RayWorkerGroup:
        cls = RayClassWithInitArgs(DeviceHolder, seed if filled else None, device)
        return RayWorkerGroup(RayResourcePool([mesh.world_size], use_gpu=False), cls, mesh=mesh)

    groups = {("src", d): group(SRC, d, True) for d in ("cpu", "cuda")} | {("dst", d): group(DST, d, False) for d in ("cpu", "cuda")}
    plan = plan_reshard(LAYOUTS, SRC, DST)
    want = [{p.name: megatron_cut(full_tensor(p, seed), p, DST, r) for p in LAYOUTS} for r in range(DST.world_size)]
    failures = []
    try:
        for src_dev, dst_dev in (("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")):
            for transport in ("auto", "store"):
                src, dst = groups["src", src_dev], groups["dst", dst_dev]
                dst.zero()
                stats = reshard(src, dst, plan, transport=transport)
                got = dst.shards()
                bad = [f"rank {r} {n}" for r in range(DST.world_size) for n in want[r] if not np.array_equal(got[r][n], want[r][n])]
                devices = sorted({g["_device"] for g in got})
                print(
                    f"{src_dev:>4} -> {dst_dev:<4} transport={transport:<5} destination devices {devices}: "
                    f"{'OK' if not bad else 'MISMATCH ' + ', '.join(bad)}; moved {stats.bytes_moved} B, "
                    f"read directly {stats.bytes_direct} B, put {stats.bytes_put} B, {stats.seconds * 1e3:.1f} ms"
                )
                failures += [f"{src_dev}->{dst_dev} {transport}: {b}" for b in bad]
    finally:
        for g in groups.values():
            g.shutdown()
    for f in failures:
        print("FAIL", f)
    print("PASS" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
