"""Worker class for tests/test_call_ranks.py (importable by Ray worker processes)."""

from __future__ import annotations

import time

import numpy as np

from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


class RankEcho(Worker):
    """Answers with its rank and what it got, so a test sees which rank ran with which arguments."""

    @register(Dispatch.ONE_TO_ALL)
    def tag(self, x: int, scale: int = 1) -> tuple[int, int]:
        return self.rank, x * scale

    def plain(self, x: int) -> int:
        """Not registered: reachable only through call_ranks / execute_*."""
        return 100 * self.rank + x

    @register(Dispatch.ONE_TO_ALL)
    def array(self, n: int) -> np.ndarray:
        return np.full(n, self.rank, dtype=np.float32)

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank
