"""Which earlier calls a rank must finish before a call is sent to it: the calls in flight on each carrier, and the abandoned ones.

Why the controller orders calls, not the hosts: a rank must run its calls in the order they
were sent, whichever carrier took each (Ray's tasks, the call session's ring, node agents).
Each carrier keeps its own order; what crosses carriers is decided here, before sending, so a
host keeps no counter that a call failing on the way (an argument that does not unpickle) could
leave behind.  The rule (:meth:`Ledger.before`):

1. a call on the session (or agents) goes to a rank only once the rank's Ray tasks have
   finished: those not seen finished are fenced (one tiny task queued behind them, waited for,
   within the call's deadline: such a call is blocking anyway); a Ray task to a rank whose
   session (or agent) calls are not answered names the last of them, and the host runs it after
   that one (``RankPart.after``, :meth:`.host.WorkerHost.execute_after`, bounded by the call's
   deadline), so sending it never waits;
2. calls on one carrier are not waited for: the carrier keeps their order (Ray's per-caller
   task order; the ring's FIFO; one Ray task per node for agents), and the call queues behind
   them on the rank (a call that unblocks a stuck peer still reaches the others at once);
3. a rank's *abandoned* call (one whose caller gave up: past its deadline, or failed on another
   rank) is reported to the next call that names the rank (:meth:`Ledger.before`'s
   ``abandoned``), which says so at once and bounds its own wait (the executor): never silent.

Calls a rank's host runs are serialized by the host's one lock, so "finished" means the call no
longer holds the rank.  The ledger is shared by the group's threads (its own lock).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

#: Ray tasks of one rank tracked one by one; beyond this many the rank is fenced before a call on
#: another carrier whatever happened to them (a program that never fetches its futures here).
OPEN_MAX = 256


@dataclass(frozen=True)
class Abandoned:
    """A call whose caller gave up on some ranks while they still ran it."""

    call_id: int
    method: str
    carrier: str
    since: float  # time.monotonic() when it was given up
    why: str  # "past its 2 s deadline", "another rank failed"

    def describe(self) -> str:
        return f"{self.method} (given up {time.monotonic() - self.since:.1f} s ago: {self.why})"


@dataclass
class RankCalls:
    """One rank's calls the ordering rule may have to wait for."""

    ray_open: set[int] = field(default_factory=set)  # Ray-carried calls sent, not seen finished
    ray_overflow: bool = False  # more than OPEN_MAX of them: fence whatever they are
    abandoned: Abandoned | None = None


@dataclass(frozen=True)
class Waits:
    """What a call must wait for before it is sent (:meth:`Ledger.before`)."""

    fence: tuple[int, ...] = ()  # ranks whose Ray tasks must be fenced
    after: dict[int, int] = field(default_factory=dict)  # rank -> the session or agent call a Ray task runs after
    abandoned: dict[int, Abandoned] = field(default_factory=dict)  # rank -> the abandoned call it may still run


class Ledger:
    """Per rank, the calls in flight that another carrier's call must wait for (see the module docstring).

    The Ray tasks are kept here; which ranks owe a session's or an agent's answers, only that
    carrier knows (it is asked for them, :meth:`before`'s ``owing``)."""

    def __init__(self, world_size: int) -> None:
        self._lock = threading.Lock()
        self._ranks = [RankCalls() for _ in range(world_size)]
        self._tracked = 0  # ranks with Ray tasks open or an abandoned call (none: nothing to note on a fetch)

    @property
    def tracking(self) -> bool:
        """Whether any rank has Ray tasks not seen finished or an abandoned call (else a fetch has nothing to note)."""
        return self._tracked > 0

    def _recount(self) -> None:
        self._tracked = sum(1 for c in self._ranks if c.ray_open or c.ray_overflow or c.abandoned is not None)

    def resize(self, world_size: int) -> None:
        """The group's ranks changed (a shrink, a grow): every process starts with nothing in flight."""
        with self._lock:
            self._ranks = [RankCalls() for _ in range(world_size)]
            self._recount()

    def reset(self, ranks: Iterable[int]) -> None:
        """``ranks`` got new processes (a replacement): nothing of theirs is in flight."""
        with self._lock:
            for rank in ranks:
                self._ranks[rank] = RankCalls()
            self._recount()

    # ----- what a call must wait for ------------------------------------------------------------

    def before(self, carrier: str, ranks: Sequence[int], owing: Mapping[int, int]) -> Waits:
        """What a call on ``carrier`` to ``ranks`` must wait for (rule 1), and the abandoned calls it
        queues behind (rule 3).  ``owing``: rank -> the last session (or agent) call sent to it and
        not answered yet."""
        fence, after, abandoned = [], {}, {}
        with self._lock:
            for rank in ranks:
                calls = self._ranks[rank]
                if calls.abandoned is not None:
                    abandoned[rank] = calls.abandoned
                if carrier != "ray" and (calls.ray_open or calls.ray_overflow):
                    fence.append(rank)
                if carrier == "ray" and rank in owing:
                    after[rank] = owing[rank]
        return Waits(tuple(fence), after, abandoned)

    # ----- what happened --------------------------------------------------------------------------

    def sent(self, carrier: str, call_id: int, ranks: Iterable[int]) -> None:
        if carrier != "ray":  # the session and the agents know what they owe
            return
        with self._lock:
            for rank in ranks:
                calls = self._ranks[rank]
                if len(calls.ray_open) < OPEN_MAX:
                    calls.ray_open.add(call_id)
                else:
                    calls.ray_overflow = True
            self._recount()

    def finished(self, carrier: str, call_id: int, ranks: Iterable[int]) -> None:
        """``ranks`` answered call ``call_id`` (whoever read the answers): every call sent to them
        before it has ended too (a rank runs its calls in order), the abandoned one included."""
        with self._lock:
            for rank in ranks:
                calls = self._ranks[rank]
                calls.ray_open.discard(call_id)
                if calls.abandoned is not None and calls.abandoned.call_id <= call_id:
                    calls.abandoned = None
            self._recount()

    def fenced(self, ranks: Iterable[int]) -> None:
        """Every Ray task sent to ``ranks`` before the fence has finished."""
        with self._lock:
            for rank in ranks:
                calls = self._ranks[rank]
                calls.ray_open.clear()
                calls.ray_overflow = False
                if calls.abandoned is not None and calls.abandoned.carrier == "ray":
                    calls.abandoned = None
            self._recount()


    def abandon(self, call_id: int, method: str, carrier: str, ranks: Iterable[int], why: str) -> None:
        """The caller gave up call ``call_id`` while ``ranks`` still ran it."""
        now = time.monotonic()
        with self._lock:
            for rank in ranks:
                self._ranks[rank].abandoned = Abandoned(call_id, method, carrier, now, why)
            self._recount()

    def abandoned(self) -> dict[int, Abandoned]:
        """Rank -> the abandoned call it may still run."""
        with self._lock:
            return {r: c.abandoned for r, c in enumerate(self._ranks) if c.abandoned is not None}
