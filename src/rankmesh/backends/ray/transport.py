"""The only module that talks to Ray's object store: :class:`RayExecutor` (share, submit, fetch).

* ``share`` is one ``ray.put`` per distinct object.  Tensors inside a DataProto pickle out of band
  as numpy views, so the put is one memcpy into plasma, and every reader maps it without a copy;
  the data layer's rebuild then makes the single private, writable copy per rank.
* ``submit`` passes every shared reference of a call as a *top-level* task argument, so Ray
  fetches them before the method starts (in parallel with other ranks) instead of the worker
  calling ``ray.get`` mid-method.  Ranks outside the collect set run with
  ``return_output=False`` and send back ``None``.
* ``fetch`` gets outputs in order, but fails fast: the first worker error or dead process is
  raised as soon as it is known, naming the rank, instead of waiting behind a rank that blocks
  forever in a collective its failed peer never joins.
"""

from __future__ import annotations

import logging
import threading
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


def _raise_for(pending: Pending, exc: BaseException) -> None:
    """Turn a Ray error of one rank call into rankmesh's error, keeping the remote traceback."""
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        text = getattr(exc, "traceback_str", "") or str(exc)
        if isinstance(cause, WorkerError):
            if not getattr(cause, "remote_traceback", None):
                cause.remote_traceback = text  # type: ignore[attr-defined]
            raise cause.with_traceback(None) from RemoteTraceback(text)
        if isinstance(cause, BaseException):
            raise WorkerError(pending.rank, {}, pending.method, f"{type(cause).__name__}: {cause}") from RemoteTraceback(text)
        raise WorkerError(pending.rank, {}, pending.method, text) from None
    if isinstance(exc, (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError)):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise WorkerDiedError(pending.rank, pending.method, first, pending.node) from exc
    raise exc


def fetch_outputs(pending: Sequence[Pending], timeout: float | None = None) -> list[Any]:
    """Wait for ``pending`` calls and return their outputs in order (usable in any Ray process).

    Every output is fetched exactly once: finished calls are collected while others still run,
    so a failure among them is raised at once.
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
        if ready:
            _collect([by_ref[r] for r in ready], results)
        if remaining and deadline is not None and time.monotonic() >= deadline:
            slow = sorted(by_ref[r].rank for r in remaining)
            raise FetchTimeoutError(pending[0].method, slow, timeout or 0.0)
    return [results[p.ref] for p in pending]


def _collect(done: Sequence[Pending], results: dict[Any, Any]) -> None:
    """Get finished calls into ``results``; raise the first failure as rankmesh's error."""
    import ray

    try:
        values = ray.get([p.ref for p in done])
    except Exception:  # noqa: BLE001 - find which rank failed, then translate
        # Retrieve every finished call (so Ray does not log the other errors as unhandled),
        # then raise the failure of the lowest rank.
        failures = []
        for p in done:
            try:
                results[p.ref] = ray.get(p.ref)
            except Exception as exc:  # noqa: BLE001
                failures.append((p.rank, p, exc))
        if failures:
            _, p, exc = min(failures, key=lambda f: f[0])
            _raise_for(p, exc)
        raise
    for p, value in zip(done, values):
        results[p.ref] = value


class RayExecutor:
    """:class:`rankmesh.executor.Executor` over one Ray actor per rank.

    ``actors[r]`` hosts rank ``r``; ``nodes[r]`` (optional) names its node for error messages.
    """

    def __init__(self, actors: Sequence[Any], nodes: Sequence[str] | None = None) -> None:
        self.actors = list(actors)
        self.world_size = len(self.actors)
        self.nodes = list(nodes) if nodes is not None else [None] * self.world_size
        self.stats = TransportStats()
        self.closed = False

    def share(self, obj: Any) -> Shared:
        import ray

        if isinstance(obj, Shared):
            return obj
        self.stats.add(puts=1)
        return Shared(ray.put(obj))

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall]) -> list[Pending]:
        if self.closed:
            raise BackendError(f"cannot call {method}: the worker group has been shut down")
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
            ref = self.actors[call.rank].execute.remote(role, method, args, kwargs, call.return_output, *refs)
            pending.append(Pending(ref, call.rank, method, self.nodes[call.rank]))
        self.stats.add(calls=len(pending))
        return pending

    def fetch(self, pending: Sequence[Pending], timeout: float | None = None) -> list[Any]:
        return fetch_outputs(pending, timeout)

    def fetcher(self) -> Callable[[Sequence[Any]], list[Any]]:
        return fetch_outputs


def format_remote(exc: BaseException) -> str:
    """The traceback text of a worker error (as raised by :func:`fetch_outputs`), for logs."""
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        return cause.text
    return "".join(traceback.format_exception(exc))
