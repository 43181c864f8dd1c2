"""The backend contract: everything a worker group needs from where its ranks live (in-process or Ray).

A worker group decides *what* each rank receives and whose output is kept (dispatch, using the
group's mesh); a backend only knows *how* to ship one object to the workers, run a method on some
ranks, fetch the outputs it is told to fetch, and report whether it can still do so.  Keeping the
contract this small is what lets the in-process backend and the Ray backend pass the same
dispatch tests; keeping it *complete* is what lets :class:`rankmesh.group.WorkerGroup` drive any
backend without probing for optional methods.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from rankmesh.deadline import Deadline
from rankmesh.errors import AgentLostError, WorkerDiedError, WorkerError

#: How a rank may receive its inputs, per call (``@register(receive=...)``, ``wg.set_receive``,
#: :attr:`RankCall.receive`).  ``"cow"``: copy-on-write views of the object store (the default);
#: ``"copy"``: one private copy up front, for methods that overwrite most of their input (a page
#: fault per written 4 KiB page costs more than one memcpy into fresh memory).  Part of the
#: contract because both backends honour it the same way: the worker's call path
#: (:func:`rankmesh.worker.invoke`) receives inside ``rankmesh.serialization.receiving``.
CALL_RECEIVE: tuple[str, ...] = ("cow", "copy")

#: An argument up to this many (pickled) bytes travels inside its call instead of being shared
#: (the group keeps small ``bytes`` so; on Ray any object that pickles this small rides inside the
#: call's header, and an output inside its answer).  Ray's own default
#: ``max_direct_call_object_size``: the size up to which Ray itself sends an object inside a
#: task's message rather than through the store.
INLINE_BYTES = 100 * 1024


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
    the call) asks the rank to send back a traced output (``rankmesh.tracing.marks``): its
    output with its own timing, which the group strips before anyone sees the output.
    ``keep`` (a traced non-blocking call): the rank times itself too, but keeps its timing under
    this key for the controller to collect later (``rankmesh.tracing.recorder.Recorder.kept``) and sends
    back its plain output, which travels on inside a future.
    ``receive``: ``"copy"`` asks the rank for private copies of its inputs up front instead of
    copy-on-write views (``@register(receive=...)``, ``wg.set_receive``); ``None``/``"cow"``: views.
    ``blocking=False``: the outputs go into a future, which other processes may fetch (on Ray such
    a call is one task per rank; a blocking one may take a call session, ``rankmesh.backends.ray.session``).
    A rank's timing travels as ``rankmesh.tracing.marks.TracedOutput``.
    """

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    return_output: bool = True
    trace: bool = False
    receive: str | None = None
    keep: int = 0
    blocking: bool = True


#: Keys of selections made to be reused (:meth:`Selection.reusable`): carriers cache what they
#: derive from one (a node's plan) under its key, so no two selections may share one.
_SELECTION_KEYS = itertools.count(1)


@dataclass(frozen=True, eq=False)
class Selection:
    """Which ranks a call reaches and which of the call's shares each one runs: ``ranks[i]`` runs share ``share[i]``.

    Why a selection and not a list of per-rank calls: most calls send one of a few distinct
    shares (one per dp piece, with or without an output) to many ranks, in the same pattern on
    every call of a method.  A selection made once per pattern (:meth:`reusable`: a dispatch
    plan's, reused by every call of it) has a ``key``, under which a carrier keeps what it
    derives from it (each node's part), so a call costs its sender the shares and the key, not a
    record per rank.  ``key=None``: made for one call (a user mode's, a step's).
    """

    ranks: tuple[int, ...]
    share: tuple[int, ...]
    key: int | None = None

    @classmethod
    def reusable(cls, ranks: Sequence[int], share: Sequence[int]) -> "Selection":
        """A selection with a key of its own, to be kept and reused by every call of one pattern."""
        return cls(tuple(ranks), tuple(share), next(_SELECTION_KEYS))

    @classmethod
    def each(cls, ranks: Sequence[int]) -> "Selection":
        """Rank ``ranks[i]`` runs share ``i`` (a call of per-rank shares, made for one call)."""
        return cls(tuple(ranks), tuple(range(len(ranks))))

    def mapped(self, ranks: Sequence[int]) -> "Selection":
        """The same pattern on other rank numbers (``ranks[r]`` for each ``r``: a view's ranks in its group), keyed anew."""
        return Selection(tuple(ranks[r] for r in self.ranks), self.share, None if self.key is None else next(_SELECTION_KEYS))


@dataclass(frozen=True)
class GroupCall:
    """One call to many ranks: its distinct shares, and which ranks run which (:class:`Selection`).

    Each share is a :class:`RankCall` whose ``rank`` is not used (-1).  A backend that runs
    calls rank by rank expands it (:meth:`rank_calls`); the Ray backend's node path sends the
    shares once and the selection's key (``docs/control_plane.md``).

    ``outputs_only``: the caller keeps only the pendings of the ranks whose share sends an output
    back (a non-blocking call whose outputs become a ``DataProtoFuture``, which reads the collect
    ranks alone), so a backend may hand it placeholders for the others, done at once with ``None``
    (the Ray backend's node agents then send back one reference per collect rank, not per rank).
    """

    shares: tuple[RankCall, ...]
    selection: Selection
    outputs_only: bool = False

    def rank_calls(self) -> list[RankCall]:
        shares = self.shares
        return [dataclasses.replace(shares[s], rank=r) for r, s in zip(self.selection.ranks, self.selection.share)]


@dataclass(frozen=True)
class Change:
    """One change of a backend's processes: the generation it began, what it was, whether it renumbered the ranks.

    A rank replaced keeps its number (its coordinates, its place in every view); a shrink or a
    grow renumbers the ranks, so a view or an unfinished call made before it would reach other
    processes than it meant (``rankmesh.errors.StaleViewError``)."""

    generation: int
    what: str
    renumbered: bool


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


def merge_failures(failures: Sequence[tuple[int, str | None, Any, BaseException]]) -> BaseException:
    """One error for several ranks' failures of one call, each ``(rank, node, coords, error)``.

    The one rule every backend and carrier reports by: dead processes first (the root cause: one
    :class:`WorkerDiedError` naming every dead rank, its coordinates and nodes), else the lowest
    rank's :class:`WorkerError` with the others attached (flattened: an error that already carries
    others, from a node agent's subtree, gives them up to the merge), else the ranks whose node
    agent was lost (one :class:`AgentLostError` naming them all), else the lowest rank's error.
    """
    ordered = sorted(failures, key=lambda f: f[0])
    died = [(rank, node, coords, e) for rank, node, coords, e in ordered if isinstance(e, WorkerDiedError)]
    if died:
        ranks = sorted({r for _, _, _, e in died for r in e.ranks} | {rank for rank, _, _, _ in died})
        coords = {r: c for _, _, _, e in died for r, c in e.coords.items()}
        coords.update({rank: c for rank, _, c, _ in died if c is not None})
        nodes = {n for _, _, _, e in died for n in (e.node or "").split(", ") if n} | {n for _, n, _, _ in died if n}
        first = min((e for _, _, _, e in died), key=lambda e: e.rank)
        err = WorkerDiedError(min(ranks), first.method, first.detail, ", ".join(sorted(nodes)) or None, ranks=ranks, coords=coords)
        err.__cause__ = first.__cause__
        return err
    workers: dict[int, WorkerError] = {}  # by rank: a rank that failed twice in one wait is said once
    for _, _, _, e in ordered:
        if isinstance(e, WorkerError):
            for w in (e, *e.others):
                workers.setdefault(w.rank, w)
    if workers:
        flat = sorted(workers.values(), key=lambda e: e.rank)
        return flat[0].attach([w.attach([]) if w.others else w for w in flat[1:]])
    lost = [e for _, _, _, e in ordered if isinstance(e, AgentLostError)]
    if lost:
        ranks = sorted({r for e in lost for r in e.ranks})
        detail = str(lost[0]).split(": ", 1)[-1]
        return AgentLostError(f"ranks {ranks} are alive, but the node agent serving them died ({detail}); what the call "
                              "did there is unknown; the group's next call starts new agents", ranks)
    return ordered[0][3]


@runtime_checkable
class JoinedPendings(Protocol):
    """A call's pendings that the backend waits for as fewer handles than it has ranks (on Ray,
    a non-blocking call through the node agents: one answer per top agent).

    It is still the sequence of the ranks' pendings, made only when asked for (iterating it);
    :attr:`waits` are the handles that say the whole call is done, what :func:`rankmesh.wait`
    asks a :class:`ReadyCheck` about, so waiting on such a future costs nothing per rank.
    """

    @property
    def waits(self) -> tuple[Any, ...]:
        """The handles whose being done means every rank's is."""


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

    ``call_timeout_s`` bounds every call that gives no timeout of its own (``None``: wait as long
    as the ranks run).  ``closed`` is true after :meth:`close`; ``failed`` is the error that made
    the backend unusable (a dead process on Ray), else ``None``.  A closed or failed backend
    refuses :meth:`submit`.  ``generation`` counts the changes of the backend's processes (on
    Ray: ranks replaced, the group shrunk or grown); :meth:`changes_since` says what they were,
    and whether they renumbered the ranks (which no view or unfinished call may outlive).
    """

    world_size: int
    call_timeout_s: float | None

    @property
    def generation(self) -> int: ...

    def changes_since(self, generation: int) -> list["Change"]:
        """The changes of the backend's processes after ``generation``, oldest first (empty: none)."""

    @property
    def closed(self) -> bool: ...

    @property
    def failed(self) -> BaseException | None: ...

    def share(self, obj: Any) -> Any:
        """Ship ``obj`` once (e.g. one ``ray.put``) so that several ranks can receive it: a
        :class:`Shared` handle, or something the backend sends inside the call (the object
        pickled, when small; on the Ray backend, a memory file its ranks on the caller's node map)."""

    def submit(
        self, role: str | None, method: str, calls: "Sequence[RankCall] | GroupCall", deadline: Deadline | None = None
    ) -> Sequence[Any]:
        """Start ``method`` of ``role``'s worker on the ranks named in ``calls``; one pending handle per
        rank call (a :class:`GroupCall`: per rank of its selection, in order).

        ``role`` selects the worker object inside a process that hosts several colocated roles
        (``None`` for a process with a single worker).  ``deadline`` (``None``: :attr:`call_timeout_s`
        from now) bounds what sending may wait for (a rank's earlier calls).
        """

    def fetch(
        self, pending: Sequence[Any], timeout: float | None = None, borrow: bool = False, stall_warn_s: float | None = None,
        deadline: Deadline | None = None,
    ) -> list[Any]:
        """Wait for the pending handles and return their outputs, in the same order.

        ``deadline`` bounds the wait (a blocking call passes the one it was submitted with);
        without one, ``timeout`` seconds from now (``None``: :attr:`call_timeout_s`).
        ``stall_warn_s`` (``None``: the backend's own setting, if any) asks for one warning saying
        where the unfinished ranks are when the wait lasts that long.  ``borrow=True`` lets the
        backend hand back read-only views of shared memory instead of private copies: only for a
        caller that copies every tensor itself before anyone sees it (the concat of collected outputs).
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

    def get(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        """The values of put objects or the outputs of pending calls, in order (raises a call's error;
        past ``timeout`` seconds, ``TimeoutError``)."""

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[int]:
        """Block until one of ``handles`` is ready, at most ``timeout`` seconds (``None``: no limit);
        the indices of every handle ready by then (none when the time ran out first)."""

    def peer_tracer(self) -> int | None:
        """The pid whose descendants are this process's peers on its node (they may read its memory
        directly, :func:`rankmesh.peermem.allow_peer_reads`); ``None`` when no other process reads it."""
