"""Asking a call's unfinished ranks where they are stuck: every host at once, within a fixed budget.

Each unfinished rank's host gets one :meth:`~.host.WorkerHost.stacks` call, all submitted
together, and one bounded ``ray.wait`` collects the answers: a host that does not answer within
:data:`GATHER_BUDGET_S` is reported as ``no answer`` and never waited for again, so asking takes
at most the budget even when a process is frozen.  A host whose process is gone answers with
Ray's actor-died error and is reported ``dead``, with that error kept for the caller
(:mod:`.waiting` turns it into the usual :class:`~rankmesh.errors.WorkerDiedError`).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import ray

from rankmesh.hangs import HangReport, RankHang
from rankmesh.hangs.report import DEAD, NO_ANSWER, STUCK

from .calls import Pending
from .waiting import PROCESS_DIED

#: The most seconds asking for stacks may take, all unfinished ranks together.
GATHER_BUDGET_S = 2.0


def hang_inspector(actors: Mapping[int, Any] | Sequence[Any]):
    """An ``inspect`` function (:data:`.waiting.Inspect`) over ``actors`` (by rank), for waits no executor owns."""
    def inspect(unfinished: Sequence[Pending], finished: Sequence[Pending], after_s: float) -> tuple[HangReport, dict]:
        return gather_hangs(actors, unfinished, finished, after_s)

    return inspect


def gather_hangs(
    actors: Mapping[int, Any] | Sequence[Any],
    unfinished: Sequence[Pending],
    finished: Sequence[Pending],
    after_s: float,
    budget_s: float = GATHER_BUDGET_S,
) -> tuple[HangReport, dict[int, BaseException]]:
    """Where each of ``unfinished`` is, asked of ``actors[rank]`` in parallel within ``budget_s``.

    Returns the report and, for ranks whose process is gone, Ray's error (by rank).
    """
    start = time.monotonic()
    asks = {p.rank: actors[p.rank].stacks.remote() for p in unfinished}
    ready, _ = ray.wait(list(asks.values()), num_returns=len(asks), timeout=budget_s, fetch_local=True)
    ready_set = set(ready)
    hangs, died = [], {}
    for p in sorted(unfinished, key=lambda p: p.rank):
        coords = p.coords
        ref = asks[p.rank]
        if ref not in ready_set:
            hangs.append(RankHang(p.rank, coords, p.node, NO_ANSWER, detail=f"did not answer within {budget_s:g} s"))
            continue
        try:
            hangs.append(RankHang(p.rank, coords, p.node, STUCK, ray.get(ref)))
        except PROCESS_DIED as exc:
            died[p.rank] = exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            hangs.append(RankHang(p.rank, coords, p.node, DEAD, detail=first[:200]))
        except Exception as exc:  # noqa: BLE001 - the host could not say; report why
            hangs.append(RankHang(p.rank, coords, p.node, NO_ANSWER, detail=f"{type(exc).__name__}: {exc}"[:200]))
    report = HangReport(
        method=unfinished[0].method if unfinished else "",
        after_s=after_s,
        hangs=tuple(hangs),
        finished=tuple(sorted(p.rank for p in finished)),
        gather_s=time.monotonic() - start,
    )
    return report, died
