"""Workers for the replica-view and rankmesh.wait tests (importable by Ray's worker processes)."""

from __future__ import annotations

import os
import time

import torch

from rankmesh import DataProto, Dispatch, Worker, register


class ReplicaWorker(Worker):
    """Tags rows with who computed them; sleeps per replica; keeps a log of what it ran, in order."""

    def __init__(self, delays: dict[int, float] | None = None) -> None:
        super().__init__()
        self.delays = dict(delays or {})
        self.log: list[str] = []

    def _dp(self) -> int:
        return self.rank_info.dp_rank

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def generate(self, data: DataProto) -> DataProto:
        """Every row gets the group rank and dp replica of the rank that computed it (after the replica's delay)."""
        time.sleep(self.delays.get(self._dp(), 0.0))
        out = DataProto.from_dict({
            "x": data.batch["x"].clone(),
            "rank": torch.full((len(data),), self.rank),
            "replica": torch.full((len(data),), self._dp()),
        })
        return self.stamp_weight_version(out)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def generate_later(self, data: DataProto) -> DataProto:
        """generate as a non-blocking call: the group returns a DataProtoFuture at once."""
        return self.generate(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def per_rank_rows(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"].clone(), "rank": torch.full((len(data),), self.rank)})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[int, int, int]:
        return self.rank, self._dp(), os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def nap(self, seconds: float, tag: str) -> tuple[int, float, float]:
        start = time.monotonic()
        self.log.append(tag)
        time.sleep(seconds)
        return self.rank, start, time.monotonic()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_version(self, version) -> int:
        """Stand-in for loading weights of ``version`` (a refit tells a ReshardWorker itself)."""
        self.weight_version = version
        return self.weight_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def record(self, tag: str) -> list[str]:
        self.log.append(tag)
        return list(self.log)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def linger(self, seconds: float) -> int:
        """Sleep ``seconds`` (a call that outlives its timeout, for the hang report)."""
        time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, replica: int) -> int:
        if self._dp() == replica:
            raise RuntimeError(f"replica {replica} refuses")
        return self.rank



class RolloutReplicaWorker(ReplicaWorker):
    """With a method on a named mesh ("rollout"): for groups that declare that mesh."""

    @register(dispatch_mode=Dispatch.named("rollout", split=("dp",), collect={"tp": 0}, output="concat"))
    def rollout_rows(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"].clone(), "rank": torch.full((len(data),), self.rank)})
