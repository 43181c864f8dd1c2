"""Worker classes for tests/test_reshard_ray.py (importable as ``tests.reshard_workers`` by Ray workers).

A :class:`ShardHolder` holds, for a list of ParamLayouts, its own rank's shard of seeded full
tensors, cut the way megatron-core cuts them (the same oracle as tests/test_reshard_plan.py),
inside a torch module whose parameters carry megatron's ``tensor_model_parallel`` /
``partition_dim`` / ``partition_stride`` attributes, so ``param_layouts()`` reads them back.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from rankmesh.dispatch import Dispatch, register
from rankmesh.mesh import RankMesh
from rankmesh.megatron.layouts import MegatronReshardWorker
from rankmesh.reshard import ParamLayout


def full_tensor(layout: ParamLayout, seed: int) -> np.ndarray:
    """The full tensor of ``layout`` for ``seed`` (float32; equal on every process)."""
    rng = np.random.default_rng([seed, sum(layout.name.encode())])
    return rng.standard_normal(layout.shape).astype(np.float32)


def megatron_cut(full: np.ndarray, layout: ParamLayout, mesh: RankMesh, rank: int) -> np.ndarray:
    c = mesh.coords(rank)
    x = full
    if layout.tp_dim is not None:
        tp = mesh.size("tp")
        blocks = np.split(x, tp * layout.tp_stride, axis=layout.tp_dim)
        x = np.concatenate(blocks[c.tp_rank :: tp], axis=layout.tp_dim)
    return x


def holds(layout: ParamLayout, mesh: RankMesh, rank: int) -> bool:
    return layout.pp_stage is None or mesh.coords(rank).pp_rank == layout.pp_stage


class ShardHolder(MegatronReshardWorker):
    """This rank's shards of ``layouts`` over ``self.meshes[mesh_name]``; ``seed=None`` starts at zero."""

    def __init__(self, layouts: list[ParamLayout], seed: int | None, mesh_name: str = "default") -> None:
        super().__init__()
        self.mesh_name = mesh_name
        self.layouts = layouts
        mesh = self.reshard_mesh()
        self.model = torch.nn.Module()  # parameters registered by their (dot-free) layout names
        for p in layouts:
            if not holds(p, mesh, self.rank):
                continue
            shard = megatron_cut(full_tensor(p, seed or 0), p, mesh, self.rank)
            param = torch.nn.Parameter(torch.from_numpy(shard.copy()) * (seed is not None), requires_grad=False)
            if p.tp_dim is not None:
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, p.tp_dim, p.tp_stride
            self.model.register_parameter(p.name, param)

    def reshard_mesh(self) -> RankMesh:
        return self.meshes[self.mesh_name]

    @register(Dispatch.ONE_TO_ALL)
    def shards(self) -> dict[str, Any]:
        return {n: p.detach().numpy().copy() for n, p in self.model.named_parameters()}

    @register(Dispatch.ONE_TO_ALL)
    def held_versions(self) -> int:
        return self.weight_version

    @register(Dispatch.ONE_TO_ALL)
    def scale(self, factor: float) -> None:
        for p in self.model.parameters():
            p.data.mul_(factor)

    @register(Dispatch.ONE_TO_ALL)
    def refill(self, seed: int | None) -> None:
        """Every shard again as cut from the full tensors of ``seed`` (zeros for ``None``), in place."""
        params = dict(self.model.named_parameters())
        for p in self.layouts:
            if p.name in params:
                shard = megatron_cut(full_tensor(p, seed or 0), p, self.reshard_mesh(), self.rank)
                params[p.name].data.copy_(torch.from_numpy(shard) * (seed is not None))

    @register(Dispatch.ONE_TO_ALL)
    def forbid_peer_reads(self) -> int:
        """Install a seccomp filter: this process can never again read another's memory (for good)."""
        from tests.seccomp_filter import forbid_process_vm_readv

        forbid_process_vm_readv()
        return os.getpid()
