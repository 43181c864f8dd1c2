"""Worker classes for the reliability tests and ``scripts/fault_drill.py``.

Top-level classes in an importable module, so Ray workers can import them.  Each rank follows
a *plan* string: ``ok`` (return the rank), ``raise`` (ValueError), ``sleep:S``, ``kill``
(SIGKILL itself), ``exit`` (``os._exit``), ``allreduce`` (block in a gloo all_reduce until
every rank joins).
"""

from __future__ import annotations

import os
import signal
import time

import torch

from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker


def follow(worker: Worker, plan: str) -> int:
    """Carry out ``plan`` on this rank (see the module docstring)."""
    if plan == "raise":
        raise ValueError(f"planned failure on rank {worker.rank}")
    if plan.startswith("sleep:"):
        time.sleep(float(plan.split(":", 1)[1]))
    elif plan == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif plan == "exit":
        os._exit(3)
    elif plan == "allreduce":
        import torch.distributed as dist

        from rankmesh.backends.ray import init_torch_distributed

        init_torch_distributed("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        return int(t[0])
    elif plan != "ok":
        raise KeyError(f"unknown plan {plan!r}")
    return worker.rank


class FaultWorker(Worker):
    """Does what the plan says; echoes DataProtos (``meta_info['plan']`` = plans by rank)."""

    @register(Dispatch.DP_COMPUTE)
    def act(self, plan: str) -> int:
        return follow(self, plan)

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def act_nb(self, plan: str) -> int:
        return follow(self, plan)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return _echo(self, data)

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def echo_nb(self, data: DataProto) -> DataProto:
        return _echo(self, data)


def _echo(worker: Worker, data: DataProto) -> DataProto:
    plans = data.meta_info.get("plan")
    if plans:
        follow(worker, plans[worker.rank])
    return data


class ProtoEcho(Worker):
    """Returns exactly what it received, under every proto mode, blocking and not, padded and not."""

    @register(Dispatch.DP_COMPUTE_PROTO, padding=False)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, padding=True)
    def echo_pad(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False, padding=True)
    def echo_pad_nb(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, padding=True)
    def mega_pad(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def mega_nb(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.MEGATRON_PP_AS_DP_PROTO, padding=True)
    def pp_as_dp_pad(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_PROTO)
    def first_of_two(self, a: DataProto, b: DataProto) -> DataProto:
        return a

    @register(Dispatch.DP_COMPUTE)
    def per_rank(self, item):
        return item

    @register(Dispatch.MEGATRON_COMPUTE)
    def per_dp(self, item):
        return item
