"""Workers for the forked-rank tests (tests/test_forked_ranks.py): what a rank's process sees, and its children."""

from __future__ import annotations

import os
import random
import sys
import time

import numpy as np
import torch

from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


def _child_square(x: int) -> int:
    return x * x


class ForkProbe(Worker):
    """Reports the process it runs in; forks children as a DataLoader or a multiprocessing pool would."""

    def __init__(self) -> None:
        # Drawn first thing, as a rank's own code would: python's, numpy's and torch's generators.
        self.first_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))

    @register(Dispatch.ONE_TO_ALL)
    def facts(self) -> dict:
        return {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "threads": torch.get_num_threads(),
            "draws": self.first_draws,
            "cuda_initialized": torch.cuda.is_initialized(),
        }

    @register(Dispatch.ONE_TO_ALL)
    def fork_children(self) -> dict:
        """A DataLoader with two worker processes, and a multiprocessing pool of the fork context."""
        import multiprocessing

        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2)
        loaded = sorted(int(x) for batch in loader for x in batch)
        with multiprocessing.get_context("fork").Pool(2) as pool:
            squares = pool.map(_child_square, range(4))
        return {"loaded": loaded, "squares": squares}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"y": data.batch["x"] * 2 + self.rank * 0})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_later(self, data: DataProto) -> DataProto:
        """:meth:`double` as a non-blocking call: Ray's tasks, so through a forked rank's holder."""
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(Dispatch.DP_COMPUTE_METRIC, materialize_futures=False)
    def read_future(self, data: object) -> dict:
        """What reached the rank (a future, and its parts, or its value read before), then the rows it reads."""
        parts = len(data.parts) if hasattr(data, "parts") else None
        got = data.get() if hasattr(data, "get") else data
        return {"type": type(data).__name__, "parts": parts, "y": got.batch["y"].tolist()}

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def nap_later(self, seconds: float) -> float:
        """Sleep ``seconds`` (the rank is busy: a replacement's drain waits for it); when it woke."""
        time.sleep(seconds)
        return time.time()

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def note_later(self, value: int) -> int:
        """Keep ``value`` in the order calls arrive; how many are kept."""
        self.__dict__.setdefault("notes", []).append(value)
        return len(self.notes)

    @register(Dispatch.ONE_TO_ALL)
    def say(self, text: str) -> None:
        print(f"{text} from rank {self.rank}", flush=True)

    @register(Dispatch.ONE_TO_ALL)
    def ray_put(self) -> object:
        """Ray used from inside the rank (what a forked rank cannot do)."""
        import ray

        return ray.put(1)
