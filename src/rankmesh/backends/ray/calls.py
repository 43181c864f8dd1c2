"""The vocabulary every carrier of a call shares: one pending type, one outcome type, one carrier contract.

A call reaches a group's ranks on one of three carriers (:mod:`.tasks`: one Ray task per rank;
:mod:`.session`: a shared-memory ring; :mod:`.agent`: one Ray task per node), and is waited for
in one loop (:mod:`.waiting`).  What passes between them is defined here, once: a rank's share of
a call in flight (:class:`Pending`), how it ended (:class:`Outcome`), and what a carrier must say
(:class:`Carrier`: which of its pending calls are done).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from rankmesh.mesh import RankCoords


@dataclass(frozen=True, eq=False)
class Pending:
    """One rank's share of a submitted call, whichever carrier took it (the one pending type).

    ``handle`` is the carrier's: the ObjectRef of the rank's Ray task (``carrier="ray"``), the
    call id on the rank's reply ring (``"session"``), or the ObjectRef of the answer of the agent
    whose subtree serves the rank (``"agent"``).  ``rank``, ``method``, ``node`` and ``coords``
    name the rank in errors.  ``generation``: the group's generation when the call was sent
    (``RayExecutor.generation``).  Identity is equality: two pendings are one rank's share of one
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


@dataclass(frozen=True)
class Outcome:
    """How one rank's call ended: its output, or its error (as the carrier saw it, untranslated)."""

    value: Any = None
    error: BaseException | None = None


class Carrier(Protocol):
    """What the wait loop needs of a carrier: which of its pending calls are done."""

    name: str

    def poll(self, pending: Sequence[Pending], within: float, first: bool) -> dict[int, Outcome]:
        """Outcomes of the done ones among ``pending``, by index; wait at most ``within`` seconds for one.

        ``first``: the loop's first look at this call (a carrier may try its fast path then).
        """
