"""A worker for the simulated multi-node tests: reports where it runs, all-reduces over gloo."""

from __future__ import annotations

import os

from rankmesh.backends.ray import init_torch_distributed
from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


class NodeWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        import ray

        env = {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        return {"node_id": ray.get_runtime_context().get_node_id(), "rank": self.rank, **env}

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> float:
        import torch
        import torch.distributed as dist

        init_torch_distributed("gloo")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return float(t[0])

    @register(Dispatch.DP_COMPUTE_PROTO)
    def rows(self, data: DataProto) -> DataProto:
        """A data call: this rank's rows, each tagged with the rank (its piece's bytes are not sent back)."""
        import torch

        return DataProto.from_dict({"rank": torch.full((len(data),), self.rank)})
