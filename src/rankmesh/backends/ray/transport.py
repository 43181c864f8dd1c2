"""The only module that talks to Ray's object store: :class:`RayExecutor` (share, submit, fetch).

* ``share`` is one ``ray.put`` per distinct object.  Tensors inside a DataProto pickle out of band
  as numpy views, so the put is one memcpy into plasma, and every reader maps it without a copy;
  the data layer's rebuild then makes the single private, writable copy per rank.
* ``submit`` passes every shared reference of a call as a *top-level* task argument, so Ray
  fetches them before the method starts (in parallel with other ranks) instead of the worker
  calling ``ray.get`` mid-method.  Ranks outside the collect set run with
  ``return_output=False`` and send back ``None``.
* ``fetch`` gets outputs in order, but fails fast: it waits in short slices (``ray.wait``) and
  raises the first worker error or dead process as soon as it is known, naming the rank, instead
  of waiting behind a rank that blocks forever in a collective its failed peer never joins.  A
  dead process fails the whole group: :meth:`RayExecutor.fail` kills the other ranks (so their
  blocked collectives end) and later calls raise at once.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rankmesh.errors import BackendError, FetchTimeoutError, WorkerDiedError, WorkerError
from rankmesh.executor import RankCall, Shared

from .actor import _SharedSlot

logger = logging.getLogger(__name__)

#: How often ``fetch`` looks for finished calls while some are still running (seconds).
POLL_INTERVAL = 0.5
#: After a first failure, how long ``fetch`` waits for the other ranks' outcome (seconds), so
#: that ranks failing together are reported together and dead ranks are told from ranks
#: that merely lost their peer.
FAIL_GRACE = 0.5


class RemoteTraceback(Exception):
    """Carries a worker's traceback text as the ``__cause__`` of the error re-raised locally."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Pending:
    """One submitted rank call: the Ray reference plus who runs it (for error messages)."""

    ref: Any
    rank: int
    method: str
    node: str | None = None
    coords: Any = None  # mesh coordinates of the rank (a dict), for error messages


@dataclass
class TransportStats:
    """Counters for tests and benchmarks: puts made, calls submitted."""

    puts: int = 0
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, puts: int = 0, calls: int = 0) -> None:
        with self.lock:
            self.puts += puts
            self.calls += calls


def _translate(pending: Pending, exc: BaseException) -> BaseException:
    """Turn a Ray error of one rank call into rankmesh's error, keeping the remote traceback."""
    import ray.exceptions as rex

    coords = dict(pending.coords or {})
    if isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        text = getattr(exc, "traceback_str", "") or str(exc)
        if isinstance(cause, WorkerError):
            if not cause.remote_traceback:
                cause.remote_traceback = text
            if cause.node is None:
                cause.node = pending.node
            cause.__cause__ = RemoteTraceback(cause.remote_traceback)
            return cause.with_traceback(None)
        if isinstance(cause, BaseException):
            err = WorkerError(pending.rank, coords, pending.method, f"{type(cause).__name__}: {cause}", pending.node, text)
            err.__cause__ = RemoteTraceback(text)
            return err
        return WorkerError(pending.rank, coords, pending.method, text, pending.node, text)
    died = (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.OutOfMemoryError)
    if isinstance(exc, died):  # OutOfMemoryError: Ray's memory monitor killed the process
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err = WorkerDiedError(pending.rank, pending.method, first, pending.node, coords={pending.rank: coords} if coords else None)
        err.__cause__ = exc
        return err
    return exc


def _combine(failures: Sequence[tuple[Pending, BaseException]]) -> BaseException:
    """One error for several failed ranks: dead processes first (the root cause), else the
    lowest rank's WorkerError with the others attached."""
    translated = sorted(((p, _translate(p, e)) for p, e in failures), key=lambda f: f[0].rank)
    died = [(p, e) for p, e in translated if isinstance(e, WorkerDiedError)]
    if died:
        p0, e0 = died[0]
        coords = {p.rank: dict(p.coords) for p, _ in died if p.coords}
        nodes = sorted({p.node for p, _ in died if p.node})
        err = WorkerDiedError(
            p0.rank, p0.method, e0.detail, ", ".join(nodes) or None, ranks=[p.rank for p, _ in died], coords=coords
        )
        err.__cause__ = e0.__cause__
        return err
    errors = [e for _, e in translated if isinstance(e, WorkerError)]
    if errors:
        return errors[0].attach(errors[1:])
    return translated[0][1]


def fetch_outputs(
    pending: Sequence[Pending],
    timeout: float | None = None,
    on_died: Callable[[WorkerDiedError], None] | None = None,
) -> list[Any]:
    """Wait for ``pending`` calls and return their outputs in order (usable in any Ray process).

    Every output is fetched exactly once: finished calls are collected while others still run,
    so a failure among them is raised at once (after :data:`FAIL_GRACE` to gather ranks that
    fail together).  ``on_died`` is told about dead processes before the error is raised.
    """
    import ray

    if not pending:
        return []
    deadline = None if timeout is None else time.monotonic() + timeout
    by_ref = {p.ref: p for p in pending}
    results: dict[Any, Any] = {}
    remaining = [p.ref for p in pending]
    while remaining:
        wait_for = POLL_INTERVAL
        if deadline is not None:
            wait_for = max(0.0, min(wait_for, deadline - time.monotonic()))
        ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=wait_for, fetch_local=False)
        failures = _collect([by_ref[r] for r in ready], results) if ready else []
        if failures:
            if remaining:  # ranks failing together are reported together
                more, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=FAIL_GRACE, fetch_local=False)
                failures += _collect([by_ref[r] for r in more], results)
            err = _combine(failures)
            if isinstance(err, WorkerDiedError) and on_died is not None:
                on_died(err)
            raise err
        if remaining and deadline is not None and time.monotonic() >= deadline:
            slow = sorted(by_ref[r].rank for r in remaining)
            raise FetchTimeoutError(pending[0].method, slow, timeout or 0.0)
    return [results[p.ref] for p in pending]


def _collect(done: Sequence[Pending], results: dict[Any, Any]) -> list[tuple[Pending, BaseException]]:
    """Get finished calls into ``results``; return the failed ones (Ray's errors, untranslated)."""
    import ray

    try:
        values = ray.get([p.ref for p in done])
    except Exception:  # noqa: BLE001 - find which ranks failed
        # Retrieve every finished call (so Ray does not log the other errors as unhandled).
        failures = []
        for p in done:
            try:
                results[p.ref] = ray.get(p.ref)
            except Exception as exc:  # noqa: BLE001
                failures.append((p, exc))
        return failures
    for p, value in zip(done, values):
        results[p.ref] = value
    return []


#: Executors of this process by token, so that a fetcher (which travels inside futures) can
#: fail its group when it finds a dead rank in the controller.
_EXECUTORS: "weakref.WeakValueDictionary[str, RayExecutor]" = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class GroupFetcher:
    """The picklable fetch function of one group's futures.

    Equal for one group (futures of one call merge flat); ``timeout_s`` bounds ``get()``.
    In the controller it fails the group on a dead rank, as a blocking call does.
    """

    token: str
    timeout_s: float | None = None

    def __call__(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        return fetch_outputs(handles, self.timeout_s if timeout is None else timeout, self._died)

    def with_timeout(self, timeout_s: float | None) -> "GroupFetcher":
        return GroupFetcher(self.token, timeout_s)

    def _died(self, err: WorkerDiedError) -> None:
        executor = _EXECUTORS.get(self.token)
        if executor is not None:
            executor.fail(err)


class RayExecutor:
    """:class:`rankmesh.executor.Executor` over one Ray actor per rank.

    ``actors[r]`` hosts rank ``r``; ``nodes[r]`` and ``coords[r]`` (optional) name its node and
    mesh coordinates in error messages.  ``call_timeout_s`` bounds every fetch that gives no
    timeout of its own (``None``: wait as long as the ranks run).
    """

    def __init__(
        self,
        actors: Sequence[Any],
        nodes: Sequence[str] | None = None,
        coords: Sequence[dict[str, int]] | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        self.actors = list(actors)
        self.world_size = len(self.actors)
        self.nodes = list(nodes) if nodes is not None else [None] * self.world_size
        self.coords = list(coords) if coords is not None else [None] * self.world_size
        self.call_timeout_s = call_timeout_s
        self.stats = TransportStats()
        self.closed = False
        self.failed: WorkerDiedError | None = None
        self.token = uuid.uuid4().hex
        _EXECUTORS[self.token] = self

    def fail(self, err: WorkerDiedError) -> None:
        """Mark the group failed after ``err`` and kill its other processes.

        Killing is what ends peers blocked in a collective the dead rank will never join; a
        group with a dead rank cannot run another collective call anyway.
        """
        import ray

        if self.failed is not None:
            return
        self.failed = err
        logger.error("worker group failed: %s; stopping its %d processes", err, self.world_size)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - already dead
                logger.debug("killing %s: %s", actor, exc)

    def _check_usable(self, method: str) -> None:
        if self.closed:
            raise BackendError(f"cannot call {method}: the worker group has been shut down")
        if self.failed is not None:
            f = self.failed
            raise WorkerDiedError(
                f.rank,
                f.method,
                f"cannot run {method}: the group failed earlier ({f.detail}) and its processes were stopped; "
                "shut it down and start a new group",
                f.node,
                ranks=f.ranks,
                coords=f.coords,
            )

    def share(self, obj: Any) -> Shared:
        import ray

        if isinstance(obj, Shared):
            return obj
        self.stats.add(puts=1)
        return Shared(ray.put(obj))

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall]) -> list[Pending]:
        from ray import cloudpickle

        self._check_usable(method)
        pending = []
        for call in calls:
            if not 0 <= call.rank < self.world_size:
                raise BackendError(f"{method}: rank {call.rank} is out of range for world size {self.world_size}")
            refs: list[Any] = []
            slot_of: dict[int, _SharedSlot] = {}

            def swap(value: Any) -> Any:
                if isinstance(value, Shared):
                    key = id(value.ref)
                    if key not in slot_of:
                        slot_of[key] = _SharedSlot(len(refs))
                        refs.append(value.ref)
                    return slot_of[key]
                return value

            args = tuple(swap(a) for a in call.args)
            kwargs = {k: swap(v) for k, v in call.kwargs.items()}
            header = cloudpickle.dumps((role, method, args, kwargs, call.return_output))  # see WorkerHost.execute
            ref = self.actors[call.rank].execute.remote(header, *refs)
            pending.append(Pending(ref, call.rank, method, self.nodes[call.rank], self.coords[call.rank]))
        self.stats.add(calls=len(pending))
        return pending

    def fetch(self, pending: Sequence[Pending], timeout: float | None = None) -> list[Any]:
        """Outputs of ``pending``; ``timeout=None`` means the group's ``call_timeout_s``."""
        return fetch_outputs(pending, self.call_timeout_s if timeout is None else timeout, self.fail)

    def fetcher(self) -> Callable[[Sequence[Any]], list[Any]]:
        return GroupFetcher(self.token, self.call_timeout_s)


def format_remote(exc: BaseException) -> str:
    """The traceback text of a worker error (as raised by :func:`fetch_outputs`), for logs."""
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        return cause.text
    return "".join(traceback.format_exception(exc))
