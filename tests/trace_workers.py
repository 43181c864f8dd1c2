"""Worker classes for the tracing tests (importable by Ray worker processes)."""

from __future__ import annotations

import time

from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker

#: The rank the tests slow down, and by how much (seconds per call).
SLOW_RANK = 5
SLOW_S = 0.06


class TracedWorker(Worker):
    """Echo methods; rank ``slow_rank`` sleeps ``SLOW_S`` in ``compute``."""

    def __init__(self, slow_rank: int = SLOW_RANK) -> None:
        self.slow_rank = slow_rank

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute(self, data: DataProto) -> DataProto:
        if self.rank == self.slow_rank:
            time.sleep(SLOW_S)
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def produce(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO)
    def consume(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        """Rank ``slow_rank`` sleeps ``seconds``; every rank returns its rank."""
        if self.rank == self.slow_rank:
            time.sleep(seconds)
        return self.rank
