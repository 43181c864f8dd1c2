"""Worker classes used by the dispatch test matrix (``tests/dispatch_matrix.py``).

Top-level classes in an importable module, so Ray workers can import them as
``tests.dispatch_workers``.  Workers record what each rank received (``take_log``) and return
their input tagged with the rank that produced it, so a test can check routing and collection.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import numpy as np
import torch

from rankmesh.data import DataProto, DataProtoFuture
from rankmesh.dispatch import DEFAULT_REGISTRY, Dispatch, Execute, MeshSpec, make_nd_compute_dataproto_dispatch_fn, register
from rankmesh.worker import Worker


def rows_of(data: DataProto) -> list[int]:
    """The ``x`` column: test batches number their rows 0..n-1 there."""
    return data.batch["x"].tolist()


def make_batch(rows: int, **meta: Any) -> DataProto:
    """Rows ``0..rows-1`` as tensor ``x``, a float tensor, a string column and meta_info."""
    x = torch.arange(rows)
    return DataProto.from_dict(
        {"x": x, "y": x.float() * 0.5},
        {"name": np.array([f"row{i}" for i in range(rows)], dtype=object)},
        meta_info={"step": 3, **meta},
    )


def tag(data: DataProto, rank: int) -> DataProto:
    """``data`` plus a ``rank`` column naming the rank that produced each row (replacing any)."""
    if data.batch is not None and "rank" in data.batch.keys():
        data.pop(batch_keys=["rank"])
    out = DataProto.from_dict({"rank": torch.full((len(data),), rank)})
    return data.union(out)


def describe(value: Any) -> Any:
    if isinstance(value, DataProto):
        return ("proto", rows_of(value))
    if isinstance(value, DataProtoFuture):
        return ("future", len(value.parts))
    if callable(value):
        return ("func", getattr(value, "__name__", "?"))
    return value


def plus_one_hundred(data: DataProto) -> DataProto:
    """A function sent to every rank by DP_COMPUTE_PROTO_WITH_FUNC."""
    return DataProto.from_dict({"x": data.batch["x"] + 100})


# ----- method factories: one echo method per (mode, options) ---------------------------------


def proto_echo(mode: Any, **options: Any) -> Callable[..., Any]:
    """A method returning its first DataProto argument tagged with the rank (and logging rows)."""

    @register(mode, **options)
    def method(self: "RecordingWorker", *args: Any, **kwargs: Any) -> DataProto:
        self.log.append(tuple(describe(a) for a in (*args, *kwargs.values())))
        values = [*args, *kwargs.values()]
        if values and callable(values[0]):
            return tag(values[0](values[1]), self.rank)
        return tag(values[0], self.rank)

    return method


def list_echo(mode: Any, **options: Any) -> Callable[..., Any]:
    """A method returning ``(rank, *args)`` and logging what it received."""

    @register(mode, **options)
    def method(self: "RecordingWorker", *args: Any, **kwargs: Any) -> tuple:
        self.log.append(tuple(describe(a) for a in (*args, *kwargs.values())))
        return (self.rank, *args, *kwargs.values())

    return method


def metric_echo(mode: Any, **options: Any) -> Callable[..., Any]:
    """A method returning a per-rank metric dict (``DP_COMPUTE_METRIC``)."""

    @register(mode, **options)
    def method(self: "RecordingWorker", data: DataProto) -> dict:
        self.log.append((describe(data),))
        return {"rank": self.rank, "rows": rows_of(data)}

    return method


# ----- user modes -------------------------------------------------------------------------------


def dispatch_reversed(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple[list, ...], dict[str, list]]:
    """User mode: rank r gets item ``world - 1 - r`` of each list argument."""
    return tuple(list(reversed(a)) for a in args), {k: list(reversed(v)) for k, v in kwargs.items()}


def collect_sorted(worker_group: Any, outputs: list) -> list:
    """User mode: outputs sorted (they are ``(rank, item)`` tuples)."""
    return sorted(outputs, key=lambda o: o[1])


def dispatch_first_half(worker_group: Any, data: DataProto) -> tuple[tuple[list, ...], dict[str, list]]:
    """User mode over DataProto: every rank gets the same first half of the batch."""
    half = data.slice(0, len(data) // 2)
    return ([half] * worker_group.world_size,), {}


def collect_rows(worker_group: Any, outputs: list) -> list:
    """User mode: ``(rank, rows)`` of every rank's ``(rank, DataProto)`` output."""
    return [(o[0], rows_of(o[1])) for o in outputs]


if "TEST_REVERSED" not in DEFAULT_REGISTRY:  # once per process, even if imported twice
    DEFAULT_REGISTRY.register_dispatch_mode("TEST_REVERSED", dispatch_reversed, collect_sorted)


# ----- the workers ------------------------------------------------------------------------------


class RecordingWorker(Worker):
    """Every built-in mode as an echo method; ``take_log()`` returns what each rank received."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.seen_rank_in_init = self.rank
        self.loop_ids: list[int] = []

    @register(Dispatch.ONE_TO_ALL)
    def take_log(self) -> list[tuple]:
        """Return and clear what this rank received since the last call."""
        log, self.log = self.log, []
        return log

    @register(Dispatch.ONE_TO_ALL)
    def identity(self) -> dict:
        return {"rank": self.rank, "init_rank": self.seen_rank_in_init, "world": self.world_size,
                "info": self.rank_info, "local_rank": self.local_rank, "meshes": sorted(self.meshes)}

    one_to_all = list_echo(Dispatch.ONE_TO_ALL)
    all_to_all = list_echo(Dispatch.ALL_TO_ALL)
    rank_zero = list_echo(Dispatch.RANK_ZERO)
    dp_compute = list_echo(Dispatch.DP_COMPUTE)
    megatron_compute = list_echo(Dispatch.MEGATRON_COMPUTE)
    megatron_pp_as_dp = list_echo(Dispatch.MEGATRON_PP_AS_DP)
    megatron_pp_only = list_echo(Dispatch.MEGATRON_PP_ONLY)
    one_to_all_on_rank_zero = list_echo(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    one_to_all_nb = list_echo(Dispatch.ONE_TO_ALL, blocking=False)

    dp_compute_proto = proto_echo(Dispatch.DP_COMPUTE_PROTO)
    dp_compute_proto_with_func = proto_echo(Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    megatron_compute_proto = proto_echo(Dispatch.MEGATRON_COMPUTE_PROTO)
    megatron_pp_as_dp_proto = proto_echo(Dispatch.MEGATRON_PP_AS_DP_PROTO)
    dp_compute_metric = metric_echo(Dispatch.DP_COMPUTE_METRIC)

    dp_compute_proto_nb = proto_echo(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    megatron_compute_proto_nb = proto_echo(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    megatron_pp_as_dp_proto_nb = proto_echo(Dispatch.MEGATRON_PP_AS_DP_PROTO, blocking=False)
    dp_compute_metric_nb = metric_echo(Dispatch.DP_COMPUTE_METRIC, blocking=False)

    dp_compute_proto_pad = proto_echo(Dispatch.DP_COMPUTE_PROTO, padding=True)
    megatron_compute_proto_pad = proto_echo(Dispatch.MEGATRON_COMPUTE_PROTO, padding=True)
    megatron_pp_as_dp_proto_pad = proto_echo(Dispatch.MEGATRON_PP_AS_DP_PROTO, padding=True)
    megatron_compute_proto_pad_nb = proto_echo(Dispatch.MEGATRON_COMPUTE_PROTO, padding=True, blocking=False)
    dp_compute_metric_pad = metric_echo(Dispatch.DP_COMPUTE_METRIC, padding=True)
    megatron_compute_proto_nopad = proto_echo(Dispatch.MEGATRON_COMPUTE_PROTO, padding=False)

    user_reversed = list_echo(Dispatch.TEST_REVERSED)
    user_dict = list_echo({"dispatch_fn": dispatch_first_half, "collect_fn": collect_rows})
    spec_pp_stages = list_echo(MeshSpec(split=("pp",), collect={"tp": 0, "dp": 0, "cp": 0}))

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute(self, data: DataProto, scale: float = 1.0) -> DataProto:
        """Documented worker method: doubles y.  The group method keeps this text."""
        return DataProto.from_dict({"x": data.batch["x"], "y": data.batch["y"] * 2 * scale})

    @register(Dispatch.ONE_TO_ALL)
    def mutate_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Writes into its argument in place; isolation keeps other ranks and the caller clean."""
        t += 1
        return t.clone()

    @register(Dispatch.DP_COMPUTE_PROTO)
    def mutate_batch(self, data: DataProto) -> DataProto:
        data.batch["x"] += 1000
        data.meta_info["touched"] = self.rank
        return data

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def fail_on_rank(self, data: DataProto) -> DataProto:
        if self.rank == 1:
            raise ValueError(f"boom on rank {self.rank}")
        return data

    @register(Dispatch.ONE_TO_ALL)
    def fail_everywhere(self, message: str) -> None:
        raise RuntimeError(message)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    async def async_echo(self, data: DataProto) -> DataProto:
        """An async worker method."""
        await asyncio.sleep(0)
        return tag(data, self.rank)

    @register(Dispatch.ONE_TO_ALL)
    async def loop_id(self) -> int:
        """The id of the event loop this rank's async methods run on (stable across calls)."""
        await asyncio.sleep(0)
        return id(asyncio.get_running_loop())

    @register(Dispatch.DP_COMPUTE_METRIC, materialize_futures=False)
    def peek_future(self, data: Any) -> dict:
        """Receives a DataProtoFuture unfetched: report which parts it references, then fetch."""
        if not isinstance(data, DataProtoFuture):
            return {"type": type(data).__name__}
        return {"parts": len(data.parts), "rows": len(data), "x": rows_of(data.get())}

    def not_registered(self, value: int) -> tuple[int, int]:
        """Plain method, reachable through execute_all / execute_rank_zero."""
        return (self.rank, value)


class NamedMeshWorker(RecordingWorker):
    """Modes over a second mesh named ``rollout`` (the group passes ``meshes={"rollout": ...}``)."""

    rollout_tp0 = proto_echo(Dispatch.named("rollout", collect={"tp": 0}))
    rollout_nd = proto_echo(make_nd_compute_dataproto_dispatch_fn("rollout"))
    rollout_lists = list_echo(Dispatch.named("rollout", collect={"tp": 0}, proto=False))


class RegisteringWorker(RecordingWorker):
    """verl style: registers its dp rank for mesh ``actor`` itself (pairs of ranks share a piece,
    the second of each pair is collected); the group declares no such mesh."""

    def __init__(self) -> None:
        super().__init__()
        self._register_dispatch_collect_info("actor", dp_rank=self.rank // 2, is_collect=self.rank % 2 == 1)

    actor_nd = proto_echo(make_nd_compute_dataproto_dispatch_fn("actor"))


class NoSuperWorker(Worker):
    """A subclass that forgets ``super().__init__()`` still knows its rank."""

    def __init__(self, offset: int = 0) -> None:
        self.value = self.rank + offset

    @register(Dispatch.ONE_TO_ALL)
    def value_of(self) -> int:
        return self.value
