"""A worker class written the way verl users write them, imported only through rankmesh.compat.verl."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from rankmesh.compat.verl import DataProto, Dispatch, Worker, make_nd_compute_dataproto_dispatch_fn, register


class VerlStyleActor(Worker):
    """Registers its own dispatch info for a mesh named "actor": tp2, dp = world // 2."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.rank_at_init = self.rank  # verl workers read self.rank in __init__
        self._register_dispatch_collect_info("actor", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 0)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def scale_values(self, data: DataProto) -> DataProto:
        values = data.batch["x"] * self.scale
        data.batch["x"].mul_(0)  # training code mutates its input in place; the caller must not see it
        return DataProto.from_dict(tensors={"x": values, "rank": torch.full_like(values, self.rank)})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"x": data.batch["x"] + self.rank})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def metric(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data)}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_rank(self) -> int:
        return self.rank_at_init

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def hello(self, name: str) -> str:
        return f"hello {name} from rank {self.rank}"


#: A global no pickler can send: a class that reads it cannot travel by value.
SCRIPT_LOCK = threading.Lock()


def script_actor_keeping_its_config() -> type:
    """A verl worker as a user writes it in the script they run: defined in ``__main__`` (so
    pickled by value), keeping ``self.config`` and reading ``dist`` -- which makes cloudpickle take
    ``torch.distributed.config`` (a ``ConfigModuleInstance``) along."""

    class ScriptActor(Worker):
        __module__, __qualname__ = "__main__", "ScriptActor"  # as a class of the script is named

        def __init__(self, config) -> None:
            super().__init__()
            self.config = config

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def learning_rate(self) -> float:
            if dist.is_initialized():
                dist.barrier()
            return self.config.lr

    return ScriptActor


def script_actor_reading_a_lock() -> type:
    """A worker in ``__main__`` whose method reads a module-level lock."""

    class LockingActor(Worker):
        __module__, __qualname__ = "__main__", "LockingActor"

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def step(self) -> int:
            with SCRIPT_LOCK:
                return self.rank

    return LockingActor


class LockedConfig:
    """A constructor argument that cannot be pickled: it holds a lock."""

    def __init__(self) -> None:
        self.lr = 0.5
        self.lock = threading.Lock()
