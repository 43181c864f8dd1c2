"""The backend contract: everything a worker group needs from where its ranks live (in-process or Ray).

A worker group decides *what* each rank receives and whose output is kept (dispatch, using the
group's mesh); a backend only knows *how* to ship one object to the workers, run a method on some
ranks, fetch the outputs it is told to fetch, and report whether it can still do so.  Keeping the
contract this small is what lets the in-process backend and the Ray backend pass the same
dispatch tests; keeping it *complete* is what lets :class:`rankmesh.group.WorkerGroup` drive any
backend without probing for optional methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

#: How a rank may receive its inputs, per call (``@register(receive=...)``, ``wg.set_receive``,
#: :attr:`RankCall.receive`).  ``"cow"``: copy-on-write views of the object store (the default);
#: ``"copy"``: one private copy up front, for methods that overwrite most of their input (a page
#: fault per written 4 KiB page costs more than one memcpy into fresh memory).  Part of the
#: contract because both backends honour it the same way: the worker's call path
#: (:func:`rankmesh.worker.invoke`) receives inside ``rankmesh.serialization.receiving``.
CALL_RECEIVE: tuple[str, ...] = ("cow", "copy")


def check_receive(value: Any, what: str = "receive") -> str | None:
    """``value`` if it is ``None`` or one of :data:`CALL_RECEIVE`, else a ``ValueError`` naming ``what``."""
    if value is None or value in CALL_RECEIVE:
        return value
    raise ValueError(f"{what} must be one of {CALL_RECEIVE} (or None for the default), got {value!r}")


@dataclass(frozen=True)
class RankCall:
    """One rank's share of a group call.

    ``args``/``kwargs`` may contain :class:`Shared` handles returned by :meth:`Backend.share`; the
    backend resolves them on the worker side.  ``return_output=False`` tells the worker to run the
    method but send nothing back (ranks outside the collect set), so a large output costs one
    transfer per replica instead of one per rank.  ``trace=True`` (only while a trace records
    the call) asks the rank to send back a ``rankmesh.tracing.recorder.TracedOutput``: its
    output with its own timing, which the group strips before anyone sees the output.
    ``keep`` (a traced non-blocking call): the rank times itself too, but keeps its timing under
    this key for the controller to collect later (``rankmesh.tracing.recorder.Recorder.kept``) and sends
    back its plain output, which travels on inside a future.
    ``receive``: ``"copy"`` asks the rank for private copies of its inputs up front instead of
    copy-on-write views (``@register(receive=...)``, ``wg.set_receive``); ``None``/``"cow"``: views.
    ``blocking=False``: the outputs go into a future, which other processes may fetch (on Ray such
    a call is one task per rank; a blocking one may take a call session, ``rankmesh.backends.ray.session``).
    """

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    return_output: bool = True
    trace: bool = False
    receive: str | None = None
    keep: int = 0
    blocking: bool = True


@dataclass(frozen=True)
class Shared:
    """A handle to one object shipped once and read by any number of ranks.

    ``ref`` is backend-specific (a Ray ObjectRef, or the object itself in-process).  Every rank
    that receives it gets its own private, writable copy of the tensors inside: a worker that
    changes its input in place changes neither the caller's batch nor another rank's.
    """

    ref: Any


Fetch = Callable[[Sequence[Any]], list[Any]]
"""A picklable function from pending handles to outputs (what futures carry)."""


@runtime_checkable
class ReadyCheck(Protocol):
    """Says which pending handles are done, without fetching them (what :func:`rankmesh.wait` asks).

    A backend's :meth:`Backend.fetcher` implements it next to ``__call__``.  ``timeout=0``
    polls; a positive ``timeout`` (or ``None``: no limit) first waits until at least one of
    ``handles`` is done.  A handle whose call failed counts as done (fetching it raises).
    Checks of one type may be asked about each other's handles together (one wait for all).
    """

    def ready(self, handles: Sequence[Any], timeout: float | None = 0.0) -> list[int]:
        """Indices into ``handles`` of the done ones, in order."""


@runtime_checkable
class Backend(Protocol):
    """What a backend provides to :class:`rankmesh.group.WorkerGroup` (both backends implement all of it).

    ``call_timeout_s`` bounds every fetch that gives no timeout of its own (``None``: wait as long
    as the ranks run).  ``closed`` is true after :meth:`close`; ``failed`` is the error that made
    the backend unusable (a dead process on Ray), else ``None``.  A closed or failed backend
    refuses :meth:`submit`.
    """

    world_size: int
    call_timeout_s: float | None

    @property
    def closed(self) -> bool: ...

    @property
    def failed(self) -> BaseException | None: ...

    def share(self, obj: Any) -> Shared:
        """Ship ``obj`` once (e.g. one ``ray.put``) so that several ranks can receive it."""

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall]) -> list[Any]:
        """Start ``method`` of ``role``'s worker on the ranks named in ``calls``; one pending handle per call.

        ``role`` selects the worker object inside a process that hosts several colocated roles
        (``None`` for a process with a single worker).
        """

    def fetch(
        self, pending: Sequence[Any], timeout: float | None = None, borrow: bool = False, stall_warn_s: float | None = None
    ) -> list[Any]:
        """Wait for the pending handles and return their outputs, in the same order.

        ``timeout=None`` means :attr:`call_timeout_s`; ``stall_warn_s`` (``None``: the
        backend's own setting, if any) asks for one warning saying where the unfinished ranks
        are when the wait lasts that long.  ``borrow=True`` lets the backend hand
        back read-only views of shared memory instead of private copies: only for a caller that
        copies every tensor itself before anyone sees it (the concat of collected outputs).
        """

    def fetcher(self, timeout: float | None = None, stall_warn_s: float | None = None) -> Fetch:
        """A picklable :data:`Fetch` for futures, usable from any process of the backend; also a :class:`ReadyCheck`.

        Futures (``DataProtoFuture``) carry it so that a worker of another group can fetch just
        the parts it needs.  ``timeout`` bounds each fetch (``None``: :attr:`call_timeout_s`).
        """

    def drain_timings(self) -> list[tuple[int, list[Any], int, int, int]]:
        """Per rank ``(rank, kept timings, sent_ns, host_ns, received_ns)`` of traced non-blocking calls.

        What ranks keep under ``RankCall.keep`` until the controller collects it (one round), with
        the host's clock read between sending and receiving; ``[]`` for a backend whose ranks hand
        their timings over at once (in-process), or once it is closed.
        """

    def control_paths(self) -> list[str]:
        """Per rank, how a blocking call with inline arguments reaches it: ``"in-process"``, ``"session"``
        (a shared-memory call session, ``rankmesh.backends.ray.session``) or ``"ray"`` (one Ray task)."""

    def close(self) -> None:
        """Stop the ranks and release what they hold; later calls raise.  Idempotent."""


@runtime_checkable
class ObjectTransport(Protocol):
    """What a worker may do with its backend's objects itself (``WorkerContext.objects``; used by reshard).

    One per worker process, so colocated roles of a process share it: ``outbox`` holds what one
    role leaves for another role of the same process, by key (reshard: ``(token, rank)``).
    Handles are the backend's: ``put`` returns one any rank of the backend can :meth:`get`, and
    :meth:`get` / :meth:`wait_any` also take the pending handles of a group call
    (``GroupFuture.handles``), so one group's call can wait on another group's without the
    controller in between.  On Ray: ``ray.put`` / ``ray.get`` / ``ray.wait``; in-process: plain
    references.
    """

    outbox: dict[Any, Any]

    def put(self, value: Any) -> Any:
        """Store ``value`` once; a handle for any rank of the backend."""

    def get(self, handles: Sequence[Any]) -> list[Any]:
        """The values of put objects or the outputs of pending calls, in order (raises a call's error)."""

    def wait_any(self, handles: Sequence[Any]) -> list[int]:
        """Block until one of ``handles`` is ready; the indices of every handle ready by then."""

    def peer_tracer(self) -> int | None:
        """The pid whose descendants are this process's peers on its node (they may read its memory
        directly, :func:`rankmesh.peermem.allow_peer_reads`); ``None`` when no other process reads it."""
