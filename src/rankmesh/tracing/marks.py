"""What worker processes and backends record of a traced call: rank timings, the fetch mark, the fetch clock.

Why a module of its own: every worker process times its traced calls (:func:`timed_call`) and
every backend notes when a call's outputs were ready (:data:`FETCH`), but only the controller
keeps a recorder (:mod:`.recorder`).  Workers import this module alone, so they never load the
recorder or its process-wide state.  How the pieces fit is :mod:`.recorder`'s docstring.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, NamedTuple


def payload_bytes(value: Any, depth: int = 0) -> int:
    """Bytes of array data in ``value``: tensors and numpy arrays, also inside DataProtos and containers.

    An estimate of what travels (headers, pickled Python objects and meta data are not counted);
    the same rule on both sides, so the controller's and the ranks' figures compare.
    """
    if value is None or depth > 4 or isinstance(value, (bool, int, float, str)):
        return 0
    if isinstance(value, (bytes, bytearray, memoryview)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, dict):
        return sum(payload_bytes(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(v, depth + 1) for v in value)
    batch, columns = getattr(value, "batch", None), getattr(value, "non_tensor_batch", None)
    if isinstance(columns, dict):  # a DataProto: its TensorDict and numpy columns
        tensors = 0 if batch is None else sum(payload_bytes(batch[k], depth + 1) for k in batch.keys())
        return tensors + payload_bytes(columns, depth + 1)
    return 0


class RankTiming(NamedTuple):
    """One rank's own account of a call, on the worker's clock (``time.time_ns``).

    ``enter_ns``: the call reached the rank's host; ``start_ns``/``end_ns``: the worker method
    ran; ``bytes_in``: array bytes of the arguments it received; ``bytes_out``: of its output
    (0 when it sends none back).
    """

    enter_ns: int
    start_ns: int
    end_ns: int
    bytes_in: int
    bytes_out: int
    pid: int


TracedOutput = list  # [output, *RankTiming's fields]
"""What a traced rank call sends back: ``[output, enter_ns, start_ns, end_ns, bytes_in, bytes_out, pid]``.

A flat list, because the wrapper crosses the process boundary on every traced call: Ray
serializes a list of ints with msgpack (~3 µs, like a bare ``None``), where a tuple or a class
goes through pickle (~12 µs); the output inside is serialized as it would be alone."""


#: Timings a host keeps of traced non-blocking calls until the controller drains them.
KEEP_MAX = 4096


class FetchClock(threading.local):
    """When this thread's outputs became ready (per thread: each thread fetches its own calls)."""

    marked_ns = 0  # a FetchMark was unpickled (ray.get had every object of the call)
    ready_ns = 0  # a sliced wait saw the last output ready


#: The process's fetch clock (see the module docstring).
FETCH = FetchClock()


def fetch_started() -> "FetchMark":
    """Unpickling a :class:`FetchMark`: note the time in :data:`FETCH`; returns :data:`FETCH_MARK`."""
    FETCH.marked_ns = time.time_ns()
    return FETCH_MARK


class FetchMark:
    """Put first in the first rank's traced output; unpickled on the controller by :func:`fetch_started`."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (fetch_started, ())


#: The one mark (what the worker sends, and what unpickling gives back on the controller).
FETCH_MARK = FetchMark()


def timed_call(
    run: Callable[..., Any], *args: Any, enter_ns: int, inputs: Any, return_output: bool = True, **kwargs: Any
) -> list[Any]:
    """Worker side: ``run(*args, **kwargs)`` timed, as a :data:`TracedOutput`; ``enter_ns``: when the call reached the rank."""
    start = time.time_ns()
    value = run(*args, **kwargs)
    end = time.time_ns()
    out = payload_bytes(value) if return_output else 0
    return [value, enter_ns, start, end, payload_bytes(inputs), out, os.getpid()]
