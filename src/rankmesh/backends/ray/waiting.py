"""Waiting for rank calls on Ray and turning their failures into rankmesh's errors.

:func:`fetch_outputs` gets outputs in order, but fails fast: it waits in short slices
(``ray.wait``) and raises the first worker error or dead process as soon as it is known, naming
the rank, instead of waiting behind a rank that blocks forever in a collective its failed peer
never joins.  Ranks failing together are reported together (:func:`combine_errors`): dead
processes first (the root cause), else the lowest rank's :class:`WorkerError` with the others
attached.  Usable in any Ray process: the controller, or a worker fetching a future's parts.

Given an ``inspect`` function (the controller's executor has one), a call that runs past its
timeout is a :class:`~rankmesh.errors.HangError` saying where each unfinished rank is stuck, and
one that runs past ``stall_warn_s`` logs the same report once as a warning and goes on waiting.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import ray
import ray.exceptions as rex

from rankmesh.errors import FetchTimeoutError, HangError, RemoteTraceback, WorkerDiedError, WorkerError
from rankmesh.mesh import RankCoords
from rankmesh.serialization import receiving
from rankmesh.tracing.recorder import FETCH

logger = logging.getLogger(__name__)

#: How often ``fetch_outputs`` looks for finished calls while some are still running (seconds).
POLL_INTERVAL = 0.5
#: After a first failure, how long ``fetch_outputs`` waits for the other ranks' outcome (seconds),
#: so that ranks failing together are reported together and dead ranks are told from ranks that
#: merely lost their peer.
FAIL_GRACE = 0.5

#: Ray's errors that mean the process (or its node) is gone.  OutOfMemoryError: Ray's memory
#: monitor killed the process.
PROCESS_DIED = (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.OutOfMemoryError)


@dataclass(frozen=True)
class Pending:
    """One submitted rank call: the Ray reference plus who runs it (for error messages)."""

    ref: Any
    rank: int
    method: str
    node: str | None = None
    coords: RankCoords | None = None  # the rank's place in the mesh, for error messages


def ready_indices(handles: Sequence[Any], timeout: float | None = 0.0) -> list[int]:
    """Indices of the done ones among ``handles`` (:class:`Pending` calls or bare ObjectRefs); nothing is fetched.

    ``timeout`` > 0 (or ``None``) first waits until one is done (:class:`rankmesh.backend.ReadyCheck`).
    """
    refs = [h.ref if isinstance(h, Pending) else h for h in handles]
    unique = list(dict.fromkeys(refs))
    if not unique:
        return []
    if timeout is None or timeout > 0:
        ray.wait(unique, num_returns=1, timeout=timeout, fetch_local=False)
    done = set(ray.wait(unique, num_returns=len(unique), timeout=0, fetch_local=False)[0])
    return [i for i, ref in enumerate(refs) if ref in done]


#: ``inspect(unfinished, finished, after_s)``: where each unfinished call's rank is (a
#: :class:`rankmesh.hangs.HangReport`), and Ray's error for each rank whose process is gone.
Inspect = Callable[[Sequence[Pending], Sequence[Pending], float], "tuple[Any, dict[int, BaseException]]"]


def translate_error(pending: Pending, exc: BaseException) -> BaseException:
    """Turn a Ray error of one rank call into rankmesh's error, keeping the remote traceback."""
    coords = pending.coords
    if isinstance(exc, rex.RayTaskError):
        return task_error(pending, getattr(exc, "cause", None), getattr(exc, "traceback_str", "") or str(exc))
    if isinstance(exc, PROCESS_DIED):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err = WorkerDiedError(pending.rank, pending.method, first, pending.node, coords={pending.rank: coords} if coords is not None else None)
        err.__cause__ = exc
        return err
    return exc


def task_error(pending: Any, cause: Any, text: str) -> BaseException:
    """rankmesh's error for a rank call that raised ``cause`` (its traceback as ``text``), whichever
    path brought it back (a Ray task's error, or a session's answer: :mod:`.session`)."""
    if isinstance(cause, WorkerError):
        if not cause.remote_traceback:
            cause.remote_traceback = text
        if cause.node is None:
            cause.node = pending.node
        cause.__cause__ = RemoteTraceback(cause.remote_traceback)
        return cause.with_traceback(None)
    if isinstance(cause, BaseException):  # raised by the host before the worker ran
        err = WorkerError.from_exception(cause, pending.rank, pending.coords, pending.method, pending.node)
        err.remote_traceback = text  # the worker's traceback; ``cause`` lost it in transit
    else:
        err = WorkerError(pending.rank, pending.coords, pending.method, text, pending.node, text)
    err.__cause__ = RemoteTraceback(text)
    return err


def combine_errors(failures: Sequence[tuple[Pending, BaseException]]) -> BaseException:
    """One error for several failed ranks: dead processes first (the root cause), else the
    lowest rank's WorkerError with the others attached."""
    translated = sorted(((p, translate_error(p, e)) for p, e in failures), key=lambda f: f[0].rank)
    died = [(p, e) for p, e in translated if isinstance(e, WorkerDiedError)]
    if died:
        p0, e0 = died[0]
        coords = {p.rank: p.coords for p, _ in died if p.coords is not None}
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
    borrow: bool = False,
    stall_warn_s: float | None = None,
    inspect: Inspect | None = None,
) -> list[Any]:
    """Wait for ``pending`` calls and return their outputs in order (usable in any Ray process).

    Every output is fetched exactly once: finished calls are collected while others still run,
    so a failure among them is raised at once (after :data:`FAIL_GRACE` to gather ranks that
    fail together).  ``on_died`` is told about dead processes before the error is raised.
    ``borrow=True`` rebuilds tensors as read-only views of the object store instead of private
    copies (``rankmesh.serialization.receiving("borrow")``; see :meth:`rankmesh.backend.Backend.fetch`).
    With ``inspect``, running past ``timeout`` raises :class:`HangError` (where each unfinished
    rank is stuck) and running past ``stall_warn_s`` logs that report once as a warning.
    """
    if not pending:
        return []
    with receiving("borrow") if borrow else contextlib.nullcontext():
        return _wait(pending, timeout, on_died, stall_warn_s, inspect)


def _wait(
    pending: Sequence[Pending],
    timeout: float | None,
    on_died: Callable[[WorkerDiedError], None] | None,
    stall_warn_s: float | None = None,
    inspect: Inspect | None = None,
) -> list[Any]:
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    warn_at = None if stall_warn_s is None or inspect is None else start + stall_warn_s
    # The success path is one ray.get, not a ray.wait round first (~0.3 ms per 8-rank fan-out
    # here).  It still fails fast: ray.get returns at the first error.  A timeout, a stall
    # warning due or any error falls through to the loop below, which finds who is slow or
    # failed (the outputs stay in the store, so nothing is lost by asking twice).
    first_wait = min(x for x in (POLL_INTERVAL, timeout, stall_warn_s if warn_at is not None else None) if x is not None)
    try:
        return list(ray.get([p.ref for p in pending], timeout=first_wait))
    except Exception:  # noqa: BLE001 - sorted out below, with every rank's outcome
        pass
    by_ref = {p.ref: p for p in pending}
    results: dict[Any, Any] = {}
    remaining = [p.ref for p in pending]
    while remaining:
        wait_for = POLL_INTERVAL
        for limit in (deadline, warn_at):
            if limit is not None:
                wait_for = max(0.0, min(wait_for, limit - time.monotonic()))
        ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=wait_for, fetch_local=False)
        if not remaining:  # every output is ready: what follows is fetching (a trace's fetch phase)
            FETCH.ready_ns = time.time_ns()
        failures = _collect([by_ref[r] for r in ready], results) if ready else []
        if failures:
            if remaining:  # ranks failing together are reported together
                more, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=FAIL_GRACE, fetch_local=False)
                failures += _collect([by_ref[r] for r in more], results)
            err = combine_errors(failures)
            if isinstance(err, WorkerDiedError) and on_died is not None:
                on_died(err)
            raise err
        if not remaining:
            break
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise timed_out(pending, [by_ref[r] for r in remaining], timeout or 0.0, now - start, on_died, inspect)
        if warn_at is not None and now >= warn_at:
            warn_at = None  # once per call
            warn_stall(pending, [by_ref[r] for r in remaining], stall_warn_s or 0.0, now - start, inspect)
    return [results[p.ref] for p in pending]


def _ask(
    pending: Sequence[Pending], slow: Sequence[Pending], after_s: float, inspect: Inspect
) -> tuple[Any, dict[int, BaseException]] | None:
    """``inspect`` the slow ranks; ``None`` (logged) if asking itself failed."""
    waiting_for = {id(p) for p in slow}
    try:
        return inspect(slow, [p for p in pending if id(p) not in waiting_for], after_s)
    except Exception:  # noqa: BLE001 - a report is a bonus: never let it hide the timeout
        logger.warning("could not ask the unfinished ranks of %s where they are", pending[0].method, exc_info=True)
        return None


def timed_out(
    pending: Sequence[Pending],
    slow: Sequence[Pending],
    timeout: float,
    after_s: float,
    on_died: Callable[[WorkerDiedError], None] | None,
    inspect: Inspect | None,
) -> BaseException:
    """The error of a call past its timeout: a dead process's error, else where every rank is."""
    ranks = sorted(p.rank for p in slow)
    answer = None if inspect is None else _ask(pending, slow, after_s, inspect)
    if answer is None:
        return FetchTimeoutError(pending[0].method, ranks, timeout)
    report, died = answer
    if died:  # a process gone is the root cause: the usual dead-rank error, group failed
        err = combine_errors([(p, died[p.rank]) for p in slow if p.rank in died])
        if isinstance(err, WorkerDiedError) and on_died is not None:
            on_died(err)
        return err
    return HangError(pending[0].method, ranks, timeout, report)


def warn_stall(pending: Sequence[Pending], slow: Sequence[Pending], stall_warn_s: float, after_s: float, inspect: Inspect) -> None:
    answer = _ask(pending, slow, after_s, inspect)
    if answer is not None:
        logger.warning(
            "%s: ranks %s still running after %g s (stall_warn_s); the call goes on\n%s",
            pending[0].method, sorted(p.rank for p in slow), stall_warn_s, answer[0].text(),
        )


def _collect(done: Sequence[Pending], results: dict[Any, Any]) -> list[tuple[Pending, BaseException]]:
    """Get finished calls into ``results``; return the failed ones (Ray's errors, untranslated)."""
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


def fetch_refs(handles: Sequence[Any]) -> list[Any]:
    """Fetch for futures built from bare ObjectRefs (verl's ``DataProtoFuture.concat(refs)``).

    Picklable and usable in any Ray process; the outputs are private copies.
    """
    return ray.get(list(handles))

