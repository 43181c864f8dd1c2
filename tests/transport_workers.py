"""Workers for the transport tests (tests/test_transport.py): calls that stall, fail early, open files.

Each method records what its rank did (:attr:`TransportWorker.log`: the method, its value and the
thread that ran it), so that a test can tell from the ranks themselves which calls ran, in what
order and on which path, instead of believing what the group says of itself.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


def explode_outside(pid: int) -> "Explodes":
    """Unpickling an :class:`Explodes` anywhere but in process ``pid`` raises (an argument whose
    class a worker cannot rebuild: a module missing there, a ``__setstate__`` that fails)."""
    if os.getpid() != pid:
        raise RuntimeError(f"Explodes cannot be rebuilt outside process {pid}")
    return Explodes()


class Explodes:
    """An argument the controller can pickle and no worker can unpickle."""

    def __reduce__(self):
        return explode_outside, (os.getpid(),)


class TransportWorker(Worker):
    """Small methods whose outputs say which rank ran them, and on which thread."""

    def __init__(self, open_files: int = 0, distributed: bool = False) -> None:
        self.log: list[tuple[str, object, str]] = []
        # Files opened before the group's first call: the call session's fds come after them.
        self.files = [os.open(os.devnull, os.O_RDONLY) for _ in range(open_files)]
        self.last_sum: float | None = None
        self.tp_group = None
        if distributed:  # a replacement rank joins in its constructor, as its survivors re-join
            from rankmesh.backends.ray import init_torch_distributed

            init_torch_distributed("gloo")
            self._tp_groups()

    def _tp_groups(self) -> None:
        """The mesh's tp groups (every rank builds every group, in the same order, as torch requires)."""
        self.tp_group = None
        for members in self.mesh.groups("tp"):
            group = dist.new_group(members)
            if self.rank in members:
                self.tp_group = group

    def leave_distributed(self) -> None:
        self.tp_group = None

    def rejoin_distributed(self) -> None:
        if dist.is_initialized():
            self._tp_groups()

    def _note(self, name: str, value: object = None) -> None:
        self.log.append((name, value, threading.current_thread().name))

    @register(Dispatch.ONE_TO_ALL)
    def echo(self, value: object) -> object:
        self._note("echo", value)
        return value

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def echo_later(self, value: object) -> object:
        self._note("echo_later", value)
        return value

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, seed: DataProto) -> DataProto:
        """``seed``'s ``mib`` MiB per rank (8 without that column), into a future."""
        mib = int(seed.batch["mib"][0]) if "mib" in seed.batch.keys() else 8
        return DataProto.from_dict({"x": torch.zeros(len(seed), (mib << 20) // 4 // len(seed))})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate(self, prompts: DataProto) -> DataProto:
        """A rollout: each row's ``prompt`` times 10 plus this rank, into a future."""
        return DataProto.from_dict({"tokens": prompts.batch["prompt"] * 10 + self.rank})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def train(self, rows: DataProto) -> DataProto:
        """A trainer: each row's ``tokens`` plus 1000 times this rank."""
        self._note("train", len(rows))
        return DataProto.from_dict({"tokens": rows.batch["tokens"] + 1000 * self.rank})

    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.ONE_TO_ALL)
    def take(self, value: object) -> str:
        """Receives a value through the object store (not an inline type)."""
        self._note("take", type(value).__name__)
        return type(value).__name__

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, rank: int, seconds: float) -> int:
        """Rank ``rank`` sleeps ``seconds``; the others return at once."""
        if self.rank == rank:
            time.sleep(seconds)
        self._note("nap", rank)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def big_after(self, seconds: float, nbytes: int) -> bytes:
        """Sleeps, then returns more than a reply slot holds (the output is parked)."""
        time.sleep(seconds)
        return bytes([self.rank]) * nbytes

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def highest_fd(self) -> int:
        return max(int(fd) for fd in os.listdir("/proc/self/fd"))

    @register(Dispatch.ONE_TO_ALL)
    def history(self) -> list[tuple[str, object, str]]:
        log, self.log = self.log, []
        return log

    # ----- collectives (gloo), for the hang and replacement tests -----------------------------

    @register(Dispatch.DP_COMPUTE)
    def act(self, plan: str) -> float | None:
        """Per rank: ``world`` (all_reduce over every rank), ``tp`` (over the rank's tp group),
        ``late:S`` (sleep S seconds, then ``tp``), ``skip`` (return at once), ``exit`` (die)."""
        if plan == "skip":
            return None
        if plan == "exit":
            os._exit(3)
        if plan.startswith("late:"):
            time.sleep(float(plan.split(":", 1)[1]))
            plan = "tp"
        t = torch.ones(1)
        dist.all_reduce(t, group=None if plan == "world" else self.tp_group)
        self.last_sum = float(t[0])
        return self.last_sum

    @register(Dispatch.ONE_TO_ALL)
    def last(self) -> float | None:
        """What the rank's last collective returned (``None``: none finished)."""
        return self.last_sum
