"""Worker classes that hang on purpose, for the hang-localization tests and ``scripts/fault_drill.py``.

Each rank follows a *plan* string:

* ``ok``: return the rank;
* ``sleep:S``: sleep ``S`` seconds inside :func:`stuck_in_user_code` (a named function the
  report must show);
* ``allreduce:AXIS``: one gloo ``all_reduce`` of a 1 on the rank's ``AXIS`` group (``tp``, ``dp``
  or ``world``), returning the sum (the group's size once every member joined);
  ``allreduce:tp,dp``: one on each, in that order (the last sum is returned);
* ``skip``: return at once (a rank that skips the collective its peers enter);
* ``exit``: end the process (``os._exit``).

``setup_groups`` must run first (on every rank): it joins torch.distributed over gloo and builds
a process group per tp and dp group of the worker's mesh, every rank building every group in the
same order, as torch requires.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from rankmesh.backends.ray import init_torch_distributed
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


def stuck_in_user_code(seconds: float) -> None:
    """Where a ``sleep:S`` plan blocks: the hang report must name this function."""
    time.sleep(seconds)


class HangWorker(Worker):
    """Follows a plan per rank (see the module docstring)."""

    @register(Dispatch.ONE_TO_ALL)
    def setup_groups(self) -> list[int]:
        init_torch_distributed("gloo")
        self.groups = {"world": None}
        for axis in ("tp", "dp"):
            for members in self.mesh.groups(axis):
                group = dist.new_group(members)
                if self.rank in members:
                    self.groups[axis] = group
        return dist.get_process_group_ranks(self.groups["dp"])

    @register(Dispatch.DP_COMPUTE)
    def act(self, plan: str) -> int:
        return self._follow(plan)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def act_nb(self, plan: str) -> int:
        return self._follow(plan)

    def _follow(self, plan: str) -> int:
        if plan == "ok" or plan == "skip":
            return self.rank
        if plan.startswith("sleep:"):
            stuck_in_user_code(float(plan.split(":", 1)[1]))
            return self.rank
        if plan.startswith("allreduce:"):
            for axis in plan.split(":", 1)[1].split(","):
                t = torch.ones(1)
                dist.all_reduce(t, group=self.groups[axis])
            return int(t[0])
        if plan == "exit":
            os._exit(3)
        raise KeyError(f"unknown plan {plan!r}")

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()
