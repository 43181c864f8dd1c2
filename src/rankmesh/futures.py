"""rankmesh.wait: the futures of non-blocking group calls, taken as they finish (``ray.wait``'s shape).

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
from typing import Any, Sequence

from rankmesh.backend import ReadyCheck
from rankmesh.data import DataProtoFuture
from rankmesh.data.future import fetch_futures, identity_fetch
from rankmesh.errors import DispatchError
from rankmesh.group import GroupFuture
from rankmesh.validate import is_int

#: How long one round of asking lasts when the futures come from backends of different kinds
#: (which cannot be asked together): each kind in turn, this many seconds each.
MIXED_SLICE_S = 0.02

Wait = tuple[ReadyCheck, Any]


def _waits(future: Any, where: str) -> list[Wait]:
    """The (check, handle) pairs ``future`` is still waiting for."""
    if isinstance(future, GroupFuture):
        handles = future.handles
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

    ``futures``: :class:`~rankmesh.group.GroupFuture` and :class:`~rankmesh.DataProtoFuture`
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


__all__ = ["wait"]
