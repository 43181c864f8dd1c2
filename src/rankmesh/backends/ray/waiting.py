"""Waiting for rank calls, whichever carrier took them, and turning their failures into rankmesh's errors.

This is the one wait loop of the Ray backend (:func:`gather`, and :func:`fetch_outputs` over it):
every carrier of a call (one Ray task per rank, :mod:`.tasks`; a call session's ring,
:mod:`.session`; node agents, :mod:`.agent`) only says which of its pending calls are done
(:meth:`Carrier.poll`), and the loop owns the rest:

* **deadline**: it never waits past the call's :class:`~rankmesh.deadline.Deadline`;
* **fail fast**: it waits in short slices and, after a first failure, :data:`FAIL_GRACE` more
  for the ranks that fail with it, instead of waiting behind a rank that blocks forever in a
  collective its failed peer never joins;
* **stall warning**: past ``stall_warn_s`` it logs where the unfinished ranks are, once;
* **hang report**: past the deadline it asks them (``inspect``) and raises
  :class:`~rankmesh.errors.HangError`, saying what the ranks do now and how to get them back;
* **one error** for several failed ranks (:func:`rankmesh.backend.merge_failures`): dead
  processes first, else the lowest rank's :class:`~rankmesh.errors.WorkerError` with the others
  attached.

Usable in any Ray process: the controller, a node agent, or a worker fetching a future's parts
(with the Ray carrier alone).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import ray.exceptions as rex

from rankmesh.backend import merge_failures
from rankmesh.deadline import Deadline
from rankmesh.errors import FetchTimeoutError, ForkedRankGone, HangError, RemoteTraceback, WorkerDiedError, WorkerError
from rankmesh.tracing.marks import FETCH

from .calls import Carrier, Outcome, Pending
from .tasks import RayTasks, get_objects

logger = logging.getLogger(__name__)

#: How long one look for finished calls may sleep while some are still running (seconds).
POLL_INTERVAL = 0.5
#: After a first failure, how long the loop waits for the other ranks' outcome (seconds), so that
#: ranks failing together are reported together and dead ranks are told from ranks that merely
#: lost their peer.
FAIL_GRACE = 0.5

#: The errors that mean the process (or its node) is gone: Ray's, and a forked rank's holder's
#: (Ray hands it back as a task error that is also a ``ForkedRankGone``).  OutOfMemoryError: Ray's
#: memory monitor killed the process.
PROCESS_DIED = (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.OutOfMemoryError,
                ForkedRankGone)


#: ``inspect(unfinished, finished, after_s)``: where each unfinished call's rank is (a
#: :class:`rankmesh.hangs.HangReport`), and Ray's error for each rank whose process is gone.
Inspect = Callable[[Sequence[Pending], Sequence[Pending], float], "tuple[Any, dict[int, BaseException]]"]
OnDied = Callable[[WorkerDiedError], None]


# ----- errors ----------------------------------------------------------------------------------------


def translate_error(pending: Pending, exc: BaseException) -> BaseException:
    """Turn a carrier's error for one rank call into rankmesh's error, keeping the remote traceback."""
    coords = pending.coords
    if isinstance(exc, rex.RayTaskError) and not isinstance(exc, ForkedRankGone):
        return task_error(pending, getattr(exc, "cause", None), getattr(exc, "traceback_str", "") or str(exc))
    if isinstance(exc, PROCESS_DIED):
        said = str(getattr(exc, "cause", None) or exc).strip()  # a forked rank's: the holder's words, not Ray's wrapping
        first = said.splitlines()[0] if said else type(exc).__name__
        err = WorkerDiedError(pending.rank, pending.method, first, pending.node, coords={pending.rank: coords} if coords is not None else None)
        err.__cause__ = exc
        return err
    return exc


def task_error(pending: Any, cause: Any, text: str) -> BaseException:
    """rankmesh's error for a rank call that raised ``cause`` (its traceback as ``text``), whichever
    carrier brought it back (a Ray task's error, or a session's answer)."""
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
    """One error for several failed ranks (each translated first): see :func:`rankmesh.backend.merge_failures`."""
    return merge_failures([(p.rank, p.node, p.coords, translate_error(p, e)) for p, e in failures])


# ----- the loop ----------------------------------------------------------------------------------------


@dataclass
class Gathered:
    """What :func:`gather` saw: the outcome of every finished rank call (by index into its pending),
    the unfinished ones, and why it stopped (``"done"``, ``"failed"``: a failure and its grace,
    ``"deadline"``)."""

    outcomes: dict[int, Outcome] = field(default_factory=dict)
    unfinished: list[int] = field(default_factory=list)
    stopped: str = "done"
    waited_s: float = 0.0

    def failures(self, pending: Sequence[Pending]) -> list[tuple[Pending, BaseException]]:
        return [(pending[i], o.error) for i, o in sorted(self.outcomes.items()) if o.error is not None]


def gather(
    pending: Sequence[Pending],
    deadline: Deadline,
    carriers: Mapping[str, Carrier],
    stall_warn_s: float | None = None,
    inspect: Inspect | None = None,
    grace_s: float = FAIL_GRACE,
    stop_on_failure: bool = True,
    stop: Callable[[], bool] | None = None,
) -> Gathered:
    """Wait for ``pending`` (any carriers) until all are done, a failure's grace ends, or ``deadline``.

    Never raises for the calls' own outcomes: they are in the result.  ``stop_on_failure=False``
    keeps waiting for every call after failures (draining).  ``stop()`` is another reason to end
    early, asked at every look (a node agent whose controller gave the call up): ``stopped`` is
    then ``"given up"``.
    """
    start = time.monotonic()
    warn_at = None if stall_warn_s is None or inspect is None else start + stall_warn_s
    name = pending[0].carrier if pending else ""
    if pending and all(p.carrier == name for p in pending):  # the common case: one carrier, all done at the first look
        first_look = POLL_INTERVAL if warn_at is None else min(POLL_INTERVAL, stall_warn_s or 0.0)
        got = carriers[name].poll(pending, deadline.within(first_look), True)
        if len(got) == len(pending) and all(o.error is None for o in got.values()):
            FETCH.ready_ns = time.time_ns()
            return Gathered(got, [], "done", time.monotonic() - start)
        return _gather_more(pending, got, deadline, carriers, start, warn_at, stall_warn_s, inspect, grace_s,
                            stop_on_failure, stop)
    return _gather_more(pending, {}, deadline, carriers, start, warn_at, stall_warn_s, inspect, grace_s,
                        stop_on_failure, stop, first=True)


def _gather_more(
    pending: Sequence[Pending],
    outcomes: dict[int, Outcome],
    deadline: Deadline,
    carriers: Mapping[str, Carrier],
    start: float,
    warn_at: float | None,
    stall_warn_s: float | None,
    inspect: Inspect | None,
    grace_s: float,
    stop_on_failure: bool,
    stop: Callable[[], bool] | None,
    first: bool = False,
) -> Gathered:
    """:func:`gather` past its first look (``outcomes``: what that look found)."""
    result = Gathered(dict(outcomes))
    waiting = [i for i in range(len(pending)) if i not in result.outcomes]
    by_carrier: dict[str, list[int]] = {}
    for i in waiting:
        by_carrier.setdefault(pending[i].carrier, []).append(i)
    grace_end = None
    if stop_on_failure and any(o.error is not None for o in result.outcomes.values()):
        grace_end = time.monotonic() + grace_s
    while waiting:
        slice_s = POLL_INTERVAL if len(by_carrier) == 1 else POLL_INTERVAL / len(by_carrier)
        for limit in (warn_at, grace_end):
            if limit is not None:
                slice_s = min(slice_s, max(0.0, limit - time.monotonic()))
        slice_s = deadline.within(slice_s)
        for name, indices in list(by_carrier.items()):
            got = carriers[name].poll([pending[i] for i in indices], slice_s, first)
            for k, outcome in got.items():
                result.outcomes[indices[k]] = outcome
            by_carrier[name] = [i for k, i in enumerate(indices) if k not in got]
            if not by_carrier[name]:
                del by_carrier[name]
        first = False
        waiting = [i for i in waiting if i not in result.outcomes]
        if not waiting:
            FETCH.ready_ns = time.time_ns()  # every output is in: what follows is fetching (a trace's fetch phase)
            break
        now = time.monotonic()
        if stop_on_failure and grace_end is None and any(o.error is not None for o in result.outcomes.values()):
            grace_end = now + grace_s  # ranks failing together are reported together
        if grace_end is not None and now >= grace_end:
            result.stopped = "failed"
            break
        if deadline.expired():
            result.stopped = "deadline"
            break
        if stop is not None and stop():
            result.stopped = "given up"
            break
        if warn_at is not None and now >= warn_at:
            warn_at = None  # once per call
            warn_stall(pending, [pending[i] for i in waiting], stall_warn_s or 0.0, now - start, inspect)
    result.unfinished = waiting
    if result.stopped == "done" and waiting:
        result.stopped = "deadline"
    if result.stopped == "done" and any(o.error is not None for o in result.outcomes.values()):
        result.stopped = "failed"
    result.waited_s = time.monotonic() - start
    return result


def fetch_outputs(
    pending: Sequence[Pending],
    timeout: float | None = None,
    on_died: OnDied | None = None,
    borrow: bool = False,
    stall_warn_s: float | None = None,
    inspect: Inspect | None = None,
    *,
    deadline: Deadline | None = None,
    carriers: Mapping[str, Carrier] | None = None,
    advice: Callable[[Sequence[Pending]], str] | None = None,
) -> list[Any]:
    """Wait for ``pending`` and return their outputs in order; raise their error, or a timeout's.

    ``deadline`` (else ``timeout`` seconds from now; neither: no end) bounds the wait.
    ``carriers`` by name (default: the Ray carrier alone, usable in any Ray process).  ``on_died``
    is told about dead processes before the error is raised.  ``borrow=True`` rebuilds tensors as
    read-only views of the object store instead of private copies (see
    :meth:`rankmesh.backend.Backend.fetch`).  With ``inspect``, running past the deadline raises
    :class:`HangError` (where each unfinished rank is stuck; ``advice(unfinished)`` adds what
    happens next) and running past ``stall_warn_s`` logs that report once as a warning.
    """
    if not pending:
        return []
    if carriers is None:
        carriers = {"ray": RayTasks()}
    deadline = deadline if deadline is not None else Deadline.after(timeout)
    from rankmesh.serialization import receiving  # noqa: PLC0415 - it loads torch, which the node agents need not

    with receiving("borrow") if borrow else contextlib.nullcontext():
        got = gather(pending, deadline, carriers, stall_warn_s, inspect)
    if got.stopped == "done":
        return [got.outcomes[i].value for i in range(len(pending))]
    failures = got.failures(pending)
    if failures:
        err = combine_errors(failures)
        if isinstance(err, WorkerDiedError) and on_died is not None:
            on_died(err)
        raise err
    slow = [pending[i] for i in got.unfinished]
    raise timed_out(pending, slow, deadline.seconds or 0.0, got.waited_s, on_died, inspect,
                    advice(slow) if advice is not None else "")


def _ask(pending: Sequence[Pending], slow: Sequence[Pending], after_s: float, inspect: Inspect) -> tuple[Any, dict] | None:
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
    on_died: OnDied | None,
    inspect: Inspect | None,
    note: str = "",
    method: str | None = None,
) -> BaseException:
    """The error of a call past its deadline: a dead process's error, else where every rank is.

    ``method``: the call to name (default: the pending calls' own; a call that waited for an
    earlier one names itself, and ``note`` says why it was not sent).
    """
    ranks = sorted(p.rank for p in slow)
    name = method or pending[0].method
    answer = None if inspect is None else _ask(pending, slow, after_s, inspect)
    if answer is None:
        err = FetchTimeoutError(name, ranks, timeout)
        if note:
            err.args = (f"{err.args[0]}. {note}",)
        return err
    report, died = answer
    if died:  # a process gone is the root cause: the usual dead-rank error, group failed
        err = combine_errors([(p, died[p.rank]) for p in slow if p.rank in died])
        if isinstance(err, WorkerDiedError) and on_died is not None:
            on_died(err)
        return err
    return HangError(name, ranks, timeout, report, note)


def warn_stall(pending: Sequence[Pending], slow: Sequence[Pending], stall_warn_s: float, after_s: float, inspect: Inspect) -> None:
    answer = _ask(pending, slow, after_s, inspect)
    if answer is not None:
        logger.warning(
            "%s: ranks %s still running after %g s (stall_warn_s); the call goes on\n%s",
            pending[0].method, sorted(p.rank for p in slow), stall_warn_s, answer[0].text(),
        )


def fetch_refs(handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """Fetch for futures built from bare ObjectRefs (verl's ``DataProtoFuture.concat(refs)``).

    Picklable and usable in any Ray process or forked rank; the outputs are private copies.
    ``timeout`` (seconds; ``None``: no end) bounds the wait, as every fetch's.
    """
    return get_objects(handles, timeout)
