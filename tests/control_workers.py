"""Workers for the call-session tests (tests/test_control_plane.py) and scripts/bench_control_plane.py.

Small methods whose outputs say which process ran them, when it entered them, and in what order
its calls ran, so that a test can tell the session path from the Ray path by what happened, not
by what the group says of itself.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker

#: The mesh name of :meth:`ControlWorker.rows_tp2_later` (a group declares it: ``meshes={TP2: RankMesh(tp=2, ...)}``).
TP2 = "tp2"


class ControlWorker(Worker):
    """Records every call it runs, in order, with the thread that ran it."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object, str]] = []  # (method, value, the thread that ran it)

    def _note(self, name: str, value: object = None) -> None:
        self.log.append((name, value, threading.current_thread().name))

    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.ONE_TO_ALL)
    def stamp(self) -> int:
        """When this rank entered the method (``time.time_ns``): start skew across ranks."""
        return time.time_ns()

    @register(Dispatch.ONE_TO_ALL)
    def echo(self, value: object) -> object:
        self._note("echo", value)
        return value

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def slow_append(self, value: object, seconds: float) -> None:
        """Non-blocking (Ray path): sleeps, then notes ``value``; a later session call must run after it."""
        time.sleep(seconds)
        self._note("slow", value)

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def big(self, nbytes: int) -> bytes:
        """An output larger than the reply ring's slot (parked, fetched through the object store)."""
        return bytes([self.rank % 256]) * nbytes

    @register(Dispatch.ONE_TO_ALL)
    def history(self) -> list[tuple[str, object, str]]:
        """Every noted call since the last ``history()`` (which empties the log)."""
        log, self.log = self.log, []
        return log

    @register(Dispatch.MEGATRON_COMPUTE)
    def shifted(self, value: int) -> int:
        """Megatron dispatch with one inline value per dp rank: the dp rank's value plus this rank."""
        return value + self.rank

    @register(Dispatch.DP_COMPUTE)
    def per_rank(self, value: int) -> int:
        return value * 10 + self.rank

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def rows_later(self, data: DataProto) -> DataProto:
        """Non-blocking: each row's ``x`` times 10 plus this rank, into a future."""
        self._note("rows_later", len(data))
        return DataProto.from_dict({"y": data.batch["x"] * 10 + self.rank})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def rows_now(self, data: DataProto) -> DataProto:
        """Blocking: the same, for a chain that starts with a blocking call."""
        self._note("rows_now", len(data))
        return DataProto.from_dict({"y": data.batch["x"] * 10 + self.rank})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def rows_megatron(self, data: DataProto) -> DataProto:
        """Megatron dispatch of a batch: each row's ``x`` times 10 plus this rank (collect ranks' outputs kept)."""
        return DataProto.from_dict({"y": data.batch["x"] * 10 + self.rank})

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def rows_megatron_later(self, data: DataProto) -> DataProto:
        """:meth:`rows_megatron`, non-blocking: its future reads the collect ranks' outputs alone."""
        return DataProto.from_dict({"y": data.batch["x"] * 10 + self.rank})

    @register(Dispatch.named(TP2), blocking=False)
    def rows_tp2_later(self, data: DataProto) -> DataProto:
        """Non-blocking, over the group's mesh named ``"tp2"`` (declared by the groups that call it):
        each row's ``x`` times 10 plus this rank, collected from tp0 only."""
        self._note("rows_tp2_later", len(data))
        return DataProto.from_dict({"y": data.batch["x"] * 10 + self.rank})

    @register(Dispatch.ONE_TO_ALL)
    def rows_fail_on(self, data: DataProto) -> int:
        """A data call that fails on the rank named by the batch's first ``x``."""
        if self.rank == int(data.batch["x"][0]):
            raise ValueError(f"rank {self.rank} refuses the batch")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def rows_nap(self, data: DataProto) -> int:
        """A data call that sleeps the batch's first ``x`` seconds, then notes it ran."""
        time.sleep(float(data.batch["x"][0]))
        self._note("rows_nap", float(data.batch["x"][0]))
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def scribble(self, data: DataProto) -> list[int]:
        """Adds ``rank + 1`` to its input in place, waits for the other ranks to do the same, and
        reads it back: with a private (copy-on-write) input it sees its own change alone."""
        data.batch["x"].add_(self.rank + 1)
        time.sleep(0.3)
        return [int(v) for v in data.batch["x"]]

    @register(Dispatch.ONE_TO_ALL)
    def scribble_ends(self, data: DataProto) -> list[int]:
        """``scribble`` for a large batch: adds ``rank + 1`` in place, waits for the other ranks to do
        the same, and reads back its first and last values (noted, with the thread that ran it)."""
        data.batch["x"].add_(self.rank + 1)
        time.sleep(0.3)
        self._note("scribble_ends", len(data))
        return [int(data.batch["x"][0]), int(data.batch["x"][-1])]

    @register(Dispatch.ONE_TO_ALL)
    def append_rank(self, values: list) -> list:
        """Appends this rank to its argument in place and returns it: each call must see the list as sent."""
        values.append(self.rank)
        return values

    @register(Dispatch.ONE_TO_ALL)
    def total(self, data: DataProto) -> list[int]:
        """Every rank's view of a batch it was handed (a future materialized on the rank): its ``y`` column."""
        self._note("total", len(data))
        return [int(v) for v in data.batch["y"]]

    def count_args(self, *values: object) -> int:
        """How many positional arguments arrived (a call whose message is bigger than a ring slot)."""
        self._note("count_args", len(values))
        return len(values)


def kill_after(pid: int, seconds: float) -> dict:
    """SIGKILL ``pid`` after ``seconds``, from a thread of its own; the dict gets ``"at"``
    (``time.monotonic()`` of the kill) when it happens, to time how soon the caller hears of it."""
    killed: dict = {}

    def kill() -> None:
        time.sleep(seconds)
        killed["at"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    return killed
