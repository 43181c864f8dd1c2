"""The futures of non-blocking group calls: :class:`GroupFuture`, and ``rankmesh.wait`` to take them as they finish (``ray.wait``'s shape).

Why: an asynchronous pipeline submits generation to every rollout replica and trains on the
first rows back; waiting on the whole call would hold everyone to the slowest replica.  With
:meth:`rankmesh.DataProtoFuture.part_futures` a call's output is one future per replica, and
:func:`wait` says which are done without fetching anything: the controller still touches only
references.

What "done" means: every handle a future would fetch is finished (a failed call is done too:
its ``get()`` raises, as with Ray).  The check is the backend's own (:class:`ReadyCheck`: on Ray
one ``ray.wait`` over every pending handle of every future, so a wait wakes when the first one
finishes; in-process every call is done when it returns).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Sequence

from rankmesh.backend import JoinedPendings, ReadyCheck
from rankmesh.data import DataProtoFuture
from rankmesh.data.future import fetch_futures, identity_fetch
from rankmesh.errors import DispatchError
from rankmesh.validate import is_int

class GroupFuture:
    """The result of a non-blocking call whose output is not one DataProto; ``get()`` waits."""

    def __init__(
        self,
        fetch: Callable[..., list[Any]],
        pending: Sequence[Any],
        finish: Callable[[list[Any]], Any],
        timeout: float | None = None,
        stall_warn_s: float | None = None,
        ready_check: ReadyCheck | None = None,
    ) -> None:
        # Joined pendings stay as they are: listing them would make every rank's pending now.
        self._fetch, self._finish = fetch, finish
        self._pending: Sequence[Any] = pending if isinstance(pending, JoinedPendings) else list(pending)
        self._done, self._value = False, None
        self._timeout, self._stall_warn_s = timeout, stall_warn_s
        self._ready_check = ready_check

    @property
    def ready_check(self) -> ReadyCheck | None:
        """The backend's :class:`~rankmesh.backend.ReadyCheck` for :attr:`handles` (what ``rankmesh.wait`` asks)."""
        return self._ready_check

    @property
    def handles(self) -> tuple[Any, ...]:
        """The backend's pending handles of the call, one per rank (empty once :meth:`get` returned).

        Another group's call may take them as an argument: its workers wait for and read them
        through their context's :class:`~rankmesh.backend.ObjectTransport`, with no round trip
        through the controller (reshard's receives wait for its sends this way).  Where the backend
        joins a call's ranks (:class:`~rankmesh.backend.JoinedPendings`: on Ray, a call through the
        node agents) they are made when first asked for, at a cost per rank that :meth:`get` and
        ``rankmesh.wait`` do not pay.
        """
        return tuple(self._pending)

    @property
    def waits(self) -> tuple[Any, ...]:
        """The handles whose being done means the call is: :attr:`handles`, or fewer where the
        backend joins them (what ``rankmesh.wait`` asks the :attr:`ready_check` about)."""
        if isinstance(self._pending, JoinedPendings):
            return self._pending.waits
        return tuple(self._pending)

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the outputs; ``timeout=None`` means the call's (or the group's) timeout."""
        if not self._done:
            limit = self._timeout if timeout is None else timeout
            self._value = self._finish(self._fetch(self._pending, timeout=limit, stall_warn_s=self._stall_warn_s))
            self._done, self._pending = True, []
        return self._value

    def __repr__(self) -> str:
        return f"GroupFuture({'done' if self._done else f'{len(self._pending)} pending'})"


#: How long one round of asking lasts when the futures come from backends of different kinds
#: (which cannot be asked together): each kind in turn, this many seconds each.
MIXED_SLICE_S = 0.02

Wait = tuple[ReadyCheck, Any]


def _waits(future: Any, where: str) -> list[Wait]:
    """The (check, handle) pairs ``future`` is still waiting for."""
    if isinstance(future, GroupFuture):
        handles = future.waits
        if handles and future.ready_check is None:
            raise DispatchError(f"{where}: this GroupFuture carries no ready check (it was not made by a worker group)")
        return [(future.ready_check, h) for h in handles]
    if isinstance(future, DataProtoFuture):
        if future.fetch is identity_fetch:  # built from batches in this process: nothing to wait for
            return []
        if future.fetch is fetch_futures:  # parts that are futures themselves
            return [w for part in future.parts for w in _waits(part.handle, where)]
        if not isinstance(future.fetch, ReadyCheck):
            raise DispatchError(
                f"{where}: a DataProtoFuture whose fetch ({future.fetch!r}) cannot say whether its parts are done; "
                f"rankmesh.wait takes the futures of worker-group calls"
            )
        return [(future.fetch, p.handle) for p in future.parts]
    raise DispatchError(f"{where} is a {type(future).__name__}; rankmesh.wait takes GroupFutures and DataProtoFutures")


def _ask(waits: list[list[Wait]], timeout: float | None, mixed_slice: float) -> None:
    """Drop the finished pairs from every entry of ``waits``: one ask per kind of check.

    With one kind, a positive ``timeout`` (or ``None``) blocks until one pair finishes; with
    several kinds each is asked for at most ``mixed_slice`` seconds.
    """
    kinds: dict[type, list[tuple[int, int]]] = defaultdict(list)
    for i, pairs in enumerate(waits):
        for j, (check, _) in enumerate(pairs):
            kinds[type(check)].append((i, j))
    if not kinds:
        return
    limit = timeout if len(kinds) == 1 else (0.0 if timeout == 0 else mixed_slice)
    finished: set[tuple[int, int]] = set()
    for where in kinds.values():
        check = waits[where[0][0]][where[0][1]][0]
        for k in check.ready([waits[i][j][1] for i, j in where], limit):
            finished.add(where[k])
    for i, pairs in enumerate(waits):
        waits[i] = [pair for j, pair in enumerate(pairs) if (i, j) not in finished]


def wait(futures: Sequence[Any], num_returns: int = 1, timeout: float | None = None) -> tuple[list[Any], list[Any]]:
    """``(done, pending)``: the first ``num_returns`` futures found done, and the others (both in input order).

    ``futures``: :class:`GroupFuture` and :class:`~rankmesh.DataProtoFuture`
    objects (for instance ``fut.part_futures()`` of a generation call, one per replica).
    Returns once ``num_returns`` are done, or when ``timeout`` seconds passed (``None``: no
    limit), with fewer.  Nothing is fetched; ``get()`` on a done future does not block.
    """
    items = list(futures)
    if not items:
        raise DispatchError("rankmesh.wait(futures) got no futures")
    if not is_int(num_returns) or not 1 <= num_returns <= len(items):
        raise DispatchError(f"rankmesh.wait: num_returns must be 1..{len(items)} (the number of futures), got {num_returns!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise DispatchError(f"rankmesh.wait: timeout must be None or seconds >= 0, got {timeout!r}")
    if len({id(f) for f in items}) != len(items):
        raise DispatchError("rankmesh.wait: a future is listed twice; list each once")
    waits = [_waits(f, f"futures[{i}]") for i, f in enumerate(items)]
    deadline = None if timeout is None else time.monotonic() + timeout
    _ask(waits, 0.0, MIXED_SLICE_S)
    while sum(1 for w in waits if not w) < num_returns:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            break
        _ask(waits, remaining, MIXED_SLICE_S)
    done_idx = [i for i, w in enumerate(waits) if not w][:num_returns]
    chosen = set(done_idx)
    return [items[i] for i in done_idx], [f for i, f in enumerate(items) if i not in chosen]


__all__ = ["GroupFuture", "wait"]
