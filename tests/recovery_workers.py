"""Worker classes for the recovery tests and ``scripts/fault_drill.py`` (importable by Ray workers).

:class:`StateWorker` holds a small tensor of "parameters" and a Python counter, joins a gloo
world in ``__init__``, and implements ``restore_from_peer`` for its tensor (the counter is
deliberately not restored, so tests can tell a survivor's object from a rebuilt one).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from rankmesh.rendezvous import init_torch_distributed
from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "EXTRA")


class StateWorker(Worker):
    def __init__(self, scale: int = 1) -> None:
        init_torch_distributed("gloo")
        self.scale = scale
        self.counter = 0
        self.state = torch.zeros(3, dtype=torch.float64)

    @register(Dispatch.ONE_TO_ALL)
    def bump(self) -> int:
        self.counter += 1
        return self.counter

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {
            "rank": self.rank, "pid": os.getpid(), "obj": id(self), "counter": self.counter, "scale": self.scale,
            "coords": self.context.coords().to_dict(), "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size(),
            "env": {k: os.environ.get(k) for k in ENV_KEYS}, "master_port": os.environ.get("MASTER_PORT"),
        }

    @register(Dispatch.ONE_TO_ALL)
    def set_state(self, values: list[list[float]]) -> None:
        self.state = torch.tensor(values[self.rank], dtype=torch.float64)

    @register(Dispatch.ONE_TO_ALL)
    def get_state(self) -> list[float]:
        return self.state.tolist()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def tag_rows(self, data: DataProto) -> DataProto:
        """The rows this rank got, each tagged with the rank."""
        return DataProto.from_dict({"x": data.batch["x"], "rank": torch.full((len(data),), self.rank)})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def tag_rows_later(self, data: DataProto) -> DataProto:
        """:meth:`tag_rows` as a non-blocking call."""
        return self.tag_rows(data)

    @register(Dispatch.ONE_TO_ALL)
    def world_sum(self, values: list[float]) -> float:
        """All-reduce (sum) of ``values[rank] * scale`` over the whole world."""
        t = torch.tensor([values[self.rank] * self.scale], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    def restore_from_peer(self, peer_rank: int, sending: bool) -> None:
        if sending:
            dist.send(self.state, dst=peer_rank)
        else:
            dist.recv(self.state, src=peer_rank)
