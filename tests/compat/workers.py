"""Worker classes written against verl 0.9.1, imported only through rankmesh.compat.verl."""

from __future__ import annotations

import os
import time

import torch
from tensordict import TensorDict

from rankmesh.compat.verl import DataProto, Dispatch, Worker, create_colocated_worker_raw_cls, register
from rankmesh.compat.verl import RayClassWithInitArgs


class SlowStartWorker(Worker):
    """Takes ``seconds`` to build (longer than a short start timeout)."""

    def __init__(self, seconds: float = 45.0) -> None:
        super().__init__()
        time.sleep(seconds)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> str:
        return "pong"


class EnvWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def env(self, keys: list) -> dict:
        return {k: os.environ.get(k) for k in keys}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def master(self) -> tuple:
        return self.get_master_addr_port()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def visible(self) -> str:
        return self.get_cuda_visible_devices()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data):
        if isinstance(data, TensorDict):
            return TensorDict({"y": data["x"] * 2, "rank": torch.full_like(data["x"], self.rank)}, batch_size=data.batch_size)
        return DataProto.from_dict(tensors={"y": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def copy_dispatch_info(self) -> tuple:
        """verl's pattern: register a mesh, then give a second name the same info."""
        self._register_dispatch_collect_info("actor", dp_rank=self.rank, is_collect=True)
        try:
            self._register_dispatch_collect_info("actor", dp_rank=0, is_collect=False)
            twice = "accepted"
        except ValueError as exc:  # verl raises ValueError here (not an assert)
            twice = "AssertionError" if isinstance(exc, AssertionError) else "ValueError"
        self.set_dispatch_collect("ref", **self.get_dispatch_collect())
        try:
            self.set_dispatch_collect("ref", **self.get_dispatch_collect())
            again = "accepted"
        except AssertionError as exc:
            again = str(exc)
        return self._query_dispatch_info("ref"), self.query_collect_info("ref"), again, twice


class Adder(Worker):
    def __init__(self, base: int) -> None:
        super().__init__()
        self.base = base

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> int:
        return self.base + x + self.rank


class Subtracter(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sub(self, x: int) -> int:
        return x - self.rank


FusedBase = create_colocated_worker_raw_cls(
    {"actor": RayClassWithInitArgs(cls=Adder, base=100), "critic": RayClassWithInitArgs(cls=Subtracter)}
)


class HybridWorker(FusedBase):
    """A user's hybrid worker over verl's fused base class: roles as attributes."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def both(self, x: int) -> tuple:
        return self.actor.add(x), self.critic.sub(x), sorted(self.actor.fused_worker_dict)
