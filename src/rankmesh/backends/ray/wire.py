"""The wire format of one rank call: encoded by the controller, decoded by the worker's host.

A call travels as one Ray task ``execute(header, *shared_values)``:

* ``header`` is the pickled :class:`CallHeader` (role, method, arguments, ``return_output``): one
  small bytes argument instead of five, because Ray serializes and checks every task argument
  separately (~1 ms more per fan-out to 8 ranks on 2 cores);
* every :class:`~rankmesh.backend.Shared` reference of the call becomes a *top-level* task
  argument, so Ray fetches it before the method starts (in parallel with the other ranks)
  instead of the worker calling ``ray.get`` mid-method.  Inside the header the arguments refer to
  those values through :class:`SharedSlot` placeholders.

So a shared object takes three shapes on its way: ``Shared(ObjectRef)`` in the controller, a
``SharedSlot(i)`` in the header, and the value itself (this rank's private copy, rebuilt by the
data layer when Ray unpickles it) in the worker's arguments.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from ray import cloudpickle

from rankmesh.backend import RankCall, Shared


@dataclass(frozen=True)
class SharedSlot:
    """Placeholder in a header for the ``index``-th shared value passed beside it."""

    index: int


@dataclass(frozen=True)
class CallHeader:
    """Everything of one rank call except its shared values."""

    role: str | None
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    return_output: bool = True
    trace: bool = False
    receive: str | None = None


class HeaderCache:
    """Encoded headers of one executor's slot-only calls, bounded to ``max_entries``.

    A header of nothing but slots (no-argument calls, data calls whose batches travel shared) is
    the same bytes on every call of a bound method, so its owner (one
    :class:`~rankmesh.backends.ray.executor.RayExecutor`, shared by the role groups spawned from
    it) pickles it once.  Keys are ``(role, method, slots, return_output, trace, receive)``; once full,
    new headers are encoded per call again (no eviction: a group binds a fixed set of methods).
    """

    def __init__(self, max_entries: int = 1024) -> None:
        self.max_entries = max_entries
        self._encoded: dict[tuple[Any, ...], bytes] = {}
        self.hits = 0

    def __len__(self) -> int:
        return len(self._encoded)

    def get(self, key: tuple[Any, ...]) -> bytes | None:
        encoded = self._encoded.get(key)
        if encoded is not None:
            self.hits += 1
        return encoded

    def put(self, key: tuple[Any, ...], encoded: bytes) -> None:
        if len(self._encoded) < self.max_entries:
            self._encoded[key] = encoded


def encode_call(
    role: str | None, method: str, call: RankCall, cache: HeaderCache | None = None
) -> tuple[bytes, list[Any]]:
    """``(header, refs)`` for one rank: pass them as ``execute.remote(header, *refs)``.

    Each distinct Shared reference (by identity) gets one slot, however often the call uses it.
    With ``cache``, a slot-only header is encoded once and reused (see :class:`HeaderCache`).
    """
    refs: list[Any] = []
    slot_of: dict[int, SharedSlot] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, Shared):
            key = id(value.ref)
            if key not in slot_of:
                slot_of[key] = SharedSlot(len(refs))
                refs.append(value.ref)
            return slot_of[key]
        return value

    args = tuple(swap(a) for a in call.args)
    kwargs = {k: swap(v) for k, v in call.kwargs.items()}
    key = None
    if cache is not None and all(type(v) is SharedSlot for v in (*args, *kwargs.values())):
        key = (role, method, args, tuple(kwargs.items()), call.return_output, call.trace, call.receive)
        cached = cache.get(key)
        if cached is not None:
            return cached, refs
    # cloudpickle: arguments may be lambdas or classes defined in the driver's __main__.
    encoded = cloudpickle.dumps(CallHeader(role, method, args, kwargs, call.return_output, call.trace, call.receive))
    if key is not None:
        cache.put(key, encoded)
    return encoded, refs


def decode_call(header: bytes, values: tuple[Any, ...]) -> CallHeader:
    """The call ``header`` describes, with every :class:`SharedSlot` replaced by its value."""
    call: CallHeader = pickle.loads(header)
    if not values:
        return call

    def fill(value: Any) -> Any:
        return values[value.index] if isinstance(value, SharedSlot) else value

    return CallHeader(
        call.role,
        call.method,
        tuple(fill(a) for a in call.args),
        {k: fill(v) for k, v in call.kwargs.items()},
        call.return_output,
        call.trace,
        call.receive,
    )
