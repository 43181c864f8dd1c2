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

from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


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

    @register(Dispatch.DP_COMPUTE)
    def per_rank(self, value: int) -> int:
        return value * 10 + self.rank


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
