"""A worker module that starts a thread when it is imported: its ranks must not be forked (tests/test_forked_ranks.py)."""

from __future__ import annotations

import threading

from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker

_STOP = threading.Event()
threading.Thread(target=_STOP.wait, name="started-at-import", daemon=True).start()


class StartsAThread(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def alive(self) -> bool:
        return True
