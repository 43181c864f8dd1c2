"""The wire format of one rank call: encoded by the controller, decoded by the worker's host.

A call travels as one Ray task ``execute(header, *shared_values)`` (or, once its header is
installed on the host, ``call_<slot>(*shared_values)``: see :class:`HeaderCache`):

* ``header`` is the pickled :class:`CallHeader` (role, method, arguments, ``return_output``): one
  small bytes argument instead of five, because Ray serializes and checks every task argument
  separately (~1 ms more per fan-out to 8 ranks on 2 cores);
* every :class:`~rankmesh.backend.Shared` reference of the call becomes a *top-level* task
  argument, so Ray fetches it before the method starts (in parallel with the other ranks)
  instead of the worker calling ``ray.get`` mid-method.  Inside the header the arguments refer to
  those values through :class:`SharedSlot` placeholders;
* an argument that pickles to at most :data:`INLINE_BYTES` and holds no Ray handle is not shared
  at all: it rides inside the header (:func:`inline`), so a call with small batches costs
  no put and can take a session's ring or the node agents.

So a shared object takes three shapes on its way: ``Shared(ObjectRef)`` in the controller, a
``SharedSlot(i)`` in the header, and the value itself (this rank's private copy, rebuilt by the
data layer when Ray unpickles it) in the worker's arguments.  A header holds no ObjectRef: one
pickled outside Ray's own serialization stays pinned in the object store for good, so anything
that holds references (a future passed along, a list of handles) travels as a shared value.

The same headers ride a call session's command ring (:mod:`.session`, :mod:`.serve`): one
:func:`encode_command` per call carries the distinct headers once and, per reader, which header
is its call and its sequence number; each answer is one :func:`encode_answer`.  A header whose
``step`` is set names a step of the host itself (``setup``, ``leave_distributed``, ...), not a
worker method: recovery and lifecycle steps are calls like any other (:mod:`.host`).
"""

from __future__ import annotations

import enum
import pickle
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ray import cloudpickle

from rankmesh.backend import INLINE_BYTES, RankCall, Selection, Shared

from .files import CappedSink, FilePool, mapped, pickle_probed
from .hostapi import BARE_SLOT_METHODS, CALL_SLOTS, SLOT_METHODS



def _known_bytes(obj: Any) -> int | None:
    """The bytes ``obj`` certainly holds, read without pickling (tensors, arrays, a DataProto's tensors); else ``None``.

    Each kind is looked for only when its module is loaded (an object of it cannot exist
    otherwise): the node agents, which use this module, never load torch for it."""
    torch, np, data = sys.modules.get("torch"), sys.modules.get("numpy"), sys.modules.get("rankmesh.data")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.nbytes
    if np is not None and isinstance(obj, np.ndarray) and obj.dtype != object:
        return obj.nbytes
    if data is not None and isinstance(obj, data.DataProto):  # its tensors alone may already be too big
        # Not TensorDict.bytes(): its recursive closure is a reference cycle holding every tensor
        # it counted until the next garbage collection (a rank's output is its input's views).
        if obj.batch is None:
            return 0
        return sum(t.numel() * t.element_size() for t in obj.batch.values(True, True) if isinstance(t, torch.Tensor))
    return None


class Inline:
    """A call argument pickled once, riding inside its header (:func:`inline`): the header
    carries these bytes, and unpickling the header gives each rank its own copy of the object."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return pickle.loads, (self.payload,)


def inline(obj: Any, cap: int = INLINE_BYTES) -> Inline | None:
    """``obj`` pickled for the inside of a call's header, or ``None``: it goes through the store.

    Why: a small batch put in the object store costs a put, a task per rank and a fetch per rank;
    inside the header it costs one pickling, and the call can take a session's ring or the node
    agents (which carry only what travels inside the call).  It qualifies when it pickles to at
    most ``cap`` bytes and holds no ObjectRef or actor handle (a future passed along must travel
    under Ray's own serialization, or it stays pinned).  Each rank unpickles its own copy, so the
    copy-on-write rule holds: a rank that writes its input changes nobody else's.  Pickling stops
    at ``cap`` bytes, so a large object costs little to refuse; the bytes are kept, so the object
    is pickled once however many headers (shares) carry it.
    """
    known = _known_bytes(obj)
    if known is not None and known > cap:
        return None
    sink = CappedSink(cap)
    try:
        pickle_probed(obj, sink)
    except Exception:  # noqa: BLE001 - too big, a Ray handle, or it does not pickle: the store takes it (and says why)
        return None
    return Inline(b"".join(sink.parts))


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
    #: A traced call's first rank: its output starts with :data:`rankmesh.tracing.marks.FETCH_MARK`.
    fetch_mark: bool = False
    #: ``method`` names a step of the host (:data:`rankmesh.backends.ray.host.STEPS`), not of a worker.
    step: bool = False


def slot_method(slot: int, shared: int) -> str:
    """The host method that runs installed slot ``slot`` with ``shared`` shared values."""
    return SLOT_METHODS[slot] if shared else BARE_SLOT_METHODS[slot]


class HeaderCache:
    """Encoded headers of one host set's slot-only calls, bounded to ``max_entries``.

    A header of nothing but slots (no-argument calls, data calls whose batches travel shared) is
    the same bytes on every call of a bound method, so its owner (one
    :class:`~rankmesh.backends.ray.hosts.HostSet`, shared by every executor and role group over
    those processes) pickles it once.  Keys are ``(role, method, slots, return_output, trace,
    receive)``; once full, new headers are encoded per call again (no eviction: a group binds a
    fixed set of methods).

    The first ``slots`` headers also get a call slot: the first call of one on a host installs it
    there (``execute_install(slot, header, *shared)``), and later calls run as
    ``call_<slot>(*shared)``, without a header argument (Ray serializes every task argument on its
    own: ~70 us per rank and call here, 16 % of an 8-rank no-op call).  Installs are kept per rank
    with the actor handle they went to, so a replaced rank's new process is installed again.
    Installing relies on Ray running one caller's tasks on an actor in submission order, so the
    owner passes ``slots=0`` where that does not hold or other drivers may install too.
    """

    def __init__(self, max_entries: int = 1024, slots: int = CALL_SLOTS) -> None:
        self.max_entries = max_entries
        self.slots = min(slots, CALL_SLOTS)
        self._encoded: dict[tuple[Any, ...], tuple[bytes, int | None]] = {}
        self._installed: list[dict[int, Any]] = []  # per slot: rank -> actor handle installed on
        self.hits = 0

    def __len__(self) -> int:
        return len(self._encoded)

    def get(self, key: tuple[Any, ...]) -> tuple[bytes, int | None] | None:
        entry = self._encoded.get(key)
        if entry is not None:
            self.hits += 1
        return entry

    def put(self, key: tuple[Any, ...], encoded: bytes) -> int | None:
        """Keep ``encoded`` under ``key``; its call slot, or ``None`` when the slots are used up."""
        if len(self._encoded) >= self.max_entries:
            return None
        slot = len(self._installed) if len(self._installed) < self.slots else None
        if slot is not None:
            self._installed.append({})
        self._encoded[key] = (encoded, slot)
        return slot

    def installed(self, slot: int, rank: int, actor: Any) -> bool:
        """Whether ``slot`` is installed on ``actor`` (rank ``rank``'s current process)."""
        return self._installed[slot].get(rank) is actor

    def mark_installed(self, slot: int, rank: int, actor: Any) -> None:
        """Record that an install of ``slot`` was submitted to ``actor`` (after submitting it)."""
        self._installed[slot][rank] = actor


def encode_call(
    role: str | None, method: str, call: RankCall, cache: HeaderCache | None = None
) -> tuple[bytes, list[Any]]:
    """``(header, refs)`` for one rank: pass them as ``execute.remote(header, *refs)``.

    Each distinct Shared reference (by identity) gets one slot, however often the call uses it.
    With ``cache``, a slot-only header is encoded once and reused (see :class:`HeaderCache`).
    """
    header, refs, _ = encode_rank_call(role, method, call, cache)
    return header, refs


def encode_rank_call(
    role: str | None, method: str, call: RankCall, cache: HeaderCache | None = None, fetch_mark: bool = False,
    step: bool = False,
) -> tuple[bytes, list[Any], int | None]:
    """:func:`encode_call` plus the header's call slot in ``cache`` (``None``: send the header).

    ``fetch_mark``: this rank's output starts with the trace's fetch mark (a traced call's first rank).
    ``step``: ``method`` is a host step (never cached: steps run once per recovery, not per call).
    """
    refs: list[Any] = []
    args: tuple[Any, ...] = call.args
    kwargs: dict[str, Any] = call.kwargs
    plain = False  # any argument that is not a Shared reference
    if args or kwargs:
        slot_of: dict[int, SharedSlot] = {}

        def swap(value: Any) -> Any:
            nonlocal plain
            if isinstance(value, Shared):
                key = id(value.ref)
                if key not in slot_of:
                    slot_of[key] = SharedSlot(len(refs))
                    refs.append(value.ref)
                return slot_of[key]
            plain = True
            return value

        args = tuple(swap(a) for a in args)
        kwargs = {k: swap(v) for k, v in kwargs.items()}
    key = None
    if cache is not None and not plain and not step:
        key = (role, method, args, tuple(kwargs.items()), call.return_output, call.trace, call.receive, fetch_mark)
        cached = cache.get(key)
        if cached is not None:
            return cached[0], refs, cached[1]
    # cloudpickle: arguments may be lambdas or classes defined in the driver's __main__.
    encoded = cloudpickle.dumps(
        CallHeader(role, method, args, kwargs, call.return_output, call.trace, call.receive, fetch_mark, step)
    )
    slot = None if key is None else cache.put(key, encoded)
    return encoded, refs, slot


#: Argument values a decoded header may hand several calls: nothing a method can write in place.
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, enum.Enum, SharedSlot)  # an Inline decodes to its object


def reusable(call: CallHeader) -> bool:
    """Whether one decoding of ``call`` may serve every call with the same header bytes.

    Why: a method may write its arguments in place (append to a list, add to a batch); a later
    call sent the same bytes must still receive what was sent.  Only immutable values (and tuples
    of them) qualify; an inline batch, list or dict is decoded afresh for each call.
    """

    def immutable(value: Any) -> bool:
        if isinstance(value, tuple):
            return all(immutable(v) for v in value)
        return isinstance(value, _IMMUTABLE)

    return all(immutable(a) for a in call.args) and all(immutable(v) for v in call.kwargs.values())


def decode_call(header: bytes, values: tuple[Any, ...]) -> CallHeader:
    """The call ``header`` describes, with every :class:`SharedSlot` replaced by its value."""
    return fill_call(pickle.loads(header), values)


def fill_call(call: CallHeader, values: tuple[Any, ...]) -> CallHeader:
    """``call`` (a decoded header) with every :class:`SharedSlot` replaced by its value.

    Only ``args`` and ``kwargs`` change; every other field is kept as sent (``dataclasses.replace``).
    """
    if not values:
        return call

    def fill(value: Any) -> Any:
        return values[value.index] if isinstance(value, SharedSlot) else value

    return replace(call, args=tuple(fill(a) for a in call.args), kwargs={k: fill(v) for k, v in call.kwargs.items()})


# ----- a call session's messages (:mod:`.session` writes commands, :mod:`.serve` reads them) -----

#: Command ring: calls in flight, and the largest call message (bigger ones take Ray's tasks).
COMMAND_SLOTS = 8
COMMAND_BYTES = 1 << 20
#: Reply rings: answers in flight, and the largest answer (bigger ones are parked: :data:`PARKED`).
REPLY_SLOTS = 4
REPLY_BYTES = 1 << 20
#: Answer statuses: the output inline, the error, "parked" (too big for a reply slot: the host
#: keeps it for one ``take_parked`` call through the object store), or "mapped" (too big for a
#: slot: the answer holds its key and a pickled :class:`.files.Mapped` of it, which the writer
#: opens and maps).
OK, ERROR, PARKED, MAPPED = 0, 1, 2, 3
#: The command that ends a host's session thread.
STOP = b"stop"


@dataclass(frozen=True)
class Command:
    """One call as a session's command ring carries it to every reader.

    ``headers`` are the call's shares, each an encoded :class:`CallHeader`; ``plan[reader]`` is
    ``None`` (the reader's rank is not called) or the index of the header it runs.  The call id
    is every reader's sequence number of the call.  ``floor``: the host may drop outputs it
    parked for calls below this id (the controller read or gave them up).  ``released``: the
    hosts' output files the writer let go of (:func:`.files.take_released`; each host takes its own).
    """

    call_id: int
    floor: int
    headers: tuple[bytes, ...]
    plan: tuple[int | None, ...]
    released: tuple[tuple[str, int, int], ...] = ()


def encode_command(command: Command) -> bytes:
    return pickle.dumps((command.call_id, command.floor, command.headers, command.plan, command.released), protocol=5)


def decode_command(message: bytes) -> Command:
    call_id, floor, headers, plan, released = pickle.loads(message)
    return Command(call_id, floor, tuple(headers), tuple(plan), tuple(released))


def command_plan(readers: Sequence[int], selection: Selection) -> tuple[int | None, ...]:
    """A command's plan for ``readers`` (reader ``i`` is rank ``readers[i]``): each reader's share
    index in ``selection``, ``None`` for a reader it does not call."""
    reader_of = {rank: i for i, rank in enumerate(readers)}
    plan: list[int | None] = [None] * len(readers)
    for rank, share in zip(selection.ranks, selection.share):
        at = reader_of.get(rank)
        if at is not None:
            plan[at] = share
    return tuple(plan)


def encode_answer(call_id: int, status: int, value: Any, limit: int, park: Callable[[int, Any], None],
                  files: FilePool | None = None, released: Sequence[tuple[str, int, int]] = ()) -> bytes:
    """One answer for the reply ring: pickled (cloudpickle for what only it can pickle), with
    ``released`` (the writer's files this host let go of: :func:`.files.take_released`).

    An output over ``limit`` bytes is, given ``files`` (the writer may open this process's
    files), written into one of them for the writer to map (:func:`.files.mapped`) and answered
    as :data:`MAPPED`, the :class:`.files.Mapped` handed to ``park`` (kept until the writer read
    the answer); otherwise the output itself is handed to ``park`` and answered as
    :data:`PARKED`.  An output whose tensors alone are over ``limit`` is not pickled whole first.
    """
    released = tuple(released)
    known = _known_bytes(value) if status == OK else None
    if known is None or known <= limit:
        answer = (call_id, status, value, released)
        try:
            encoded = pickle.dumps(answer, protocol=5)  # a few us, against cloudpickle's ~10 for a small answer
        except Exception:  # noqa: BLE001 - a class or function defined in __main__: by value
            try:
                encoded = cloudpickle.dumps(answer, protocol=5)
            except Exception as exc:  # noqa: BLE001 - an output that does not pickle is the call's error
                encoded = cloudpickle.dumps((call_id, ERROR, error_parts(exc, None), released), protocol=5)
        if len(encoded) <= limit:
            return encoded
    if files is not None and status == OK:
        big = mapped(value, files, INLINE_BYTES)
        if big is not None:
            big.expect(["writer"])
            park(call_id, big)
            return pickle.dumps((call_id, MAPPED, (big.key, pickle.dumps(big)), released), protocol=5)
    park(call_id, value)
    return pickle.dumps((call_id, PARKED, None, released), protocol=5)


def decode_answer(message: bytes) -> tuple[int, int, Any, tuple[tuple[str, int, int], ...]]:
    """``(call_id, status, value, released)`` of an answer (:func:`encode_answer`)."""
    return pickle.loads(message)


def error_parts(exc: BaseException, rank: int | None) -> tuple[BaseException, str]:
    """What travels for a failed call: the error itself if it pickles, else a WorkerError of its text."""
    import traceback

    from rankmesh.errors import WorkerError

    text = getattr(exc, "remote_traceback", None) or "".join(traceback.format_exception(exc))
    try:
        cloudpickle.dumps(exc)
        return exc, text
    except Exception:  # noqa: BLE001
        return WorkerError(-1 if rank is None else rank, None, "", f"{type(exc).__name__}: {exc}", None, text), text
