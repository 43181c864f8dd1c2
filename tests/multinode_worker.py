"""A worker for the multi-node tests: reports where it runs, all-reduces over gloo, computes for a while."""

from __future__ import annotations

import os

from rankmesh.backends.ray import init_torch_distributed
from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


class NodeWorker(Worker):
    def __init__(self, distributed: bool = False) -> None:
        if distributed:  # a replacement rank joins in its constructor, as its survivors re-join
            init_torch_distributed("gloo")

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

    @register(Dispatch.ONE_TO_ALL)
    def work(self, until: float, beat_dir: str, reduce: bool = False) -> dict:
        """Compute until wall time ``until``, appending the time to ``beat_dir/beats-<pid>`` every
        0.1 s (so a test sees this process still at work, whatever its node's link does); the
        answer, ``rank + 1``, does not depend on how long it took.  ``reduce``: then all-reduce
        it over every rank (gloo), as a training step ends (``sum``)."""
        import time

        with open(os.path.join(beat_dir, f"beats-{os.getpid()}"), "a") as beats:
            while time.time() < until:
                beats.write(f"{time.time()}\n")
                beats.flush()
                time.sleep(0.1)
        out = {"rank": self.rank, "pid": os.getpid(), "value": self.rank + 1}
        if reduce:
            import torch
            import torch.distributed as dist

            t = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(t)
            out["sum"] = float(t[0])
        return out
