"""The vocabulary every carrier of a call shares: one pending type, one outcome type, one carrier contract.

A call reaches a group's ranks on one of three carriers (:mod:`.tasks`: one Ray task per rank;
:mod:`.session`: a shared-memory ring; :mod:`.agent`: one Ray task per node), and is waited for
in one loop (:mod:`.waiting`).  What passes between them is defined here, once: the call itself
(:class:`CallRecord`, one per call, built once by the executor), a rank's share of it in flight
(:class:`Pending`), how it ended (:class:`Outcome`), and what a carrier does (:class:`Carrier`:
``prepare`` a record or decline it, ``send`` it, ``poll`` its pending calls).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from rankmesh.backend import Selection
from rankmesh.deadline import NEVER, Deadline
from rankmesh.mesh import RankCoords


@dataclass(frozen=True)
class RankPart:
    """One share of a :class:`CallRecord`, and (with ``rank`` set) one rank's part of it.

    ``header``: the encoded method slot and inline arguments (:class:`.wire.CallHeader`).
    ``refs``: the arguments by reference, the shared objects Ray resolves before the method runs
    (only Ray's tasks carry them).  ``slot``: the header's call slot on Ray's tasks
    (:class:`.wire.HeaderCache`).  ``trace``/``keep``: a traced call, and a non-blocking one's
    timing key.  ``after``: on Ray's tasks, the id of the rank's last call session call it must run
    after (0: none; :mod:`.order`), waited for at most ``after_s`` seconds on the host (``None``:
    as long as it runs).  ``node``/``coords`` name the rank in errors.  A share has ``rank=-1``.
    ``returns``: whether the rank sends its output back (a collect rank's share).
    """

    rank: int
    header: bytes
    refs: tuple[Any, ...] = ()
    slot: int | None = None
    trace: bool = False
    keep: int = 0
    node: str | None = None
    coords: RankCoords | None = None
    after: int = 0
    after_s: float | None = None
    returns: bool = True


@dataclass(frozen=True)
class CallRecord:
    """One call, as every carrier takes it: id, generation, deadline, method, its shares and who runs which.

    ``shares`` are the call's distinct shares (each encoded once) and ``selection`` says which
    rank runs which (:class:`rankmesh.backend.Selection`): a carrier that reaches ranks in bulk
    (node agents) sends the shares and the selection's key; one that reaches them one by one
    (Ray's tasks) takes :attr:`parts`, each rank's part, made on first use.  The call id is also
    every rank's sequence number of the call: ids only grow, and a host accepts gaps.
    ``method`` names the call in errors and answers; ``deadline`` bounds every wait on its way
    (a free ring slot, the ranks' earlier calls, the answers); ``blocking=False``: its outputs go
    into a future that other processes may fetch.  ``nodes``/``coords`` (by rank) name the
    ranks in errors.  ``holds``: what the ranks read from the caller's process while the call
    runs (its :class:`.wire.Mapped` arguments' files), kept open for as long as any of the
    call's pendings lives (a pending outlives the call's reads: it is dropped once the call is
    answered, given up, or its future is read or dropped).  ``outputs_only``: the caller keeps the
    pendings of the ranks whose share :attr:`RankPart.returns` alone
    (:attr:`rankmesh.backend.GroupCall.outputs_only`).
    """

    call_id: int
    generation: int
    method: str
    shares: tuple[RankPart, ...]
    selection: Selection
    deadline: Deadline = NEVER
    blocking: bool = True
    nodes: Sequence[str | None] = ()
    coords: Sequence[RankCoords | None] = ()
    holds: tuple[Any, ...] = ()
    outputs_only: bool = False

    @classmethod
    def of_parts(cls, call_id: int, generation: int, method: str, parts: Sequence[RankPart], deadline: Deadline = NEVER,
                 blocking: bool = True, holds: tuple[Any, ...] = ()) -> "CallRecord":
        """A record whose every rank has a part of its own (steps, per-rank calls): the parts are its
        shares, each naming its rank and node (the record has no ``nodes`` of its own)."""
        return cls(call_id, generation, method, tuple(parts), Selection.each([p.rank for p in parts]), deadline, blocking,
                   holds=holds)

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.selection.ranks

    @functools.cached_property
    def parts(self) -> tuple[RankPart, ...]:
        """Each rank's part, in selection order (made once, for the carriers that need them: Ray's tasks)."""
        shares, nodes, coords = self.shares, self.nodes, self.coords
        if not nodes:  # made of its parts (of_parts)
            return shares
        parts = []
        for r, s in zip(self.selection.ranks, self.selection.share):
            share = shares[s]
            parts.append(RankPart(r, share.header, share.refs, share.slot, share.trace, share.keep, nodes[r], coords[r],
                                  returns=share.returns))
        return tuple(parts)

    @property
    def inline(self) -> bool:
        """Whether every argument travels inside the headers and the outputs come back at once (what a ring can carry)."""
        return self.blocking and not any(share.refs or share.keep for share in self.shares)

    def pending(self, carrier: str, handles: Sequence[Any]) -> list[Pending]:
        """One :class:`Pending` per selected rank, in order, each with the carrier's handle for it."""
        method, call_id, generation, nodes, coords = self.method, self.call_id, self.generation, self.nodes, self.coords
        holds = self.holds or None
        if not nodes:  # made of its parts (of_parts): they name their nodes
            return [Pending(handle, part.rank, method, part.node, part.coords, carrier, call_id, generation, holds)
                    for part, handle in zip(self.parts, handles)]
        return [Pending(handle, rank, method, nodes[rank], coords[rank], carrier, call_id, generation, holds)
                for rank, handle in zip(self.selection.ranks, handles)]

    def pending_at(self, index: int, carrier: str, handle: Any) -> "Pending":
        """The :class:`Pending` of the ``index``-th selected rank alone (:meth:`pending`'s, one of them)."""
        if not self.nodes:
            part = self.parts[index]
            return Pending(handle, part.rank, self.method, part.node, part.coords, carrier, self.call_id, self.generation,
                           self.holds or None)
        rank = self.selection.ranks[index]
        return Pending(handle, rank, self.method, self.nodes[rank], self.coords[rank], carrier, self.call_id,
                       self.generation, self.holds or None)


@dataclass(frozen=True, eq=False)
class Pending:
    """One rank's share of a submitted call, whichever carrier took it (the one pending type).

    ``handle`` is the carrier's: the ObjectRef of the rank's Ray task (``carrier="ray"``), the
    call id on the rank's reply ring (``"session"``), or the ObjectRef of the answer of the agent
    whose subtree serves the rank (``"agent"``).  ``rank``, ``method``, ``node`` and ``coords``
    name the rank in errors.  ``generation``: the group's generation when the call was sent
    (``RayExecutor.generation``).  ``holds``: the call's :attr:`CallRecord.holds` (kept alive
    with the pending).  Identity is equality: two pendings are one rank's share of one
    call only if they are the same object.
    """

    handle: Any
    rank: int
    method: str
    node: str | None = None
    coords: RankCoords | None = None
    carrier: str = "ray"
    call_id: int = 0
    generation: int = 0
    holds: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class Outcome:
    """How one rank's call ended: its output, or its error (as the carrier saw it, untranslated)."""

    value: Any = None
    error: BaseException | None = None


class Carrier(Protocol):
    """One way a call reaches its ranks (Ray's tasks, a session's ring, node agents), behind three verbs.

    The executor offers each record to its carriers in turn (:meth:`prepare`), sends it with the
    first that takes it (:meth:`send`), and the wait loop asks that carrier which of the pending
    calls are done (:meth:`poll`).
    """

    name: str

    def prepare(self, call: CallRecord) -> Any | None:
        """What :meth:`send` would write for ``call``, or ``None`` when this carrier cannot take it."""

    def send(self, call: CallRecord, prepared: Any) -> list[Pending]:
        """Send ``call`` (as :meth:`prepare` made it ready); one pending per part, in part order."""

    def poll(self, pending: Sequence[Pending], within: float, first: bool) -> dict[int, Outcome]:
        """Outcomes of the done ones among ``pending``, by index; wait at most ``within`` seconds for one.

        ``first``: the loop's first look at this call (a carrier may try its fast path then).
        """
