"""The demo's ``--hang-rank R``: actor rank R blocks in a barrier its peers skip, and the timeout says where.

The drill runs once, after start-up: ``actor.with_timeout(HANG_TIMEOUT_S).hang_in_barrier(R)``
sends rank R into a barrier on its dp group (tp, then pp, when dp is 1) that its peers do not
enter, so the call ends as a :class:`~rankmesh.errors.HangError`.  The drill checks that error
against the mesh (rank R, R's coordinates and node, ``barrier`` on R's group with R's members),
then releases R (its peers join the barrier), and the demo prints it (:meth:`HangDrill.format`)
and goes on: a hang localized is the drill's expected outcome, so a passing run still exits 0,
and a report that misses any of these fails the run's self-check (exit 1).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from rankmesh.errors import HangError, UsageError

#: The hang drill's call timeout (seconds): short, so the drill costs the demo a few seconds.
HANG_TIMEOUT_S = 3.0


@dataclass
class HangDrill:
    """What the drill expected and what the timeout reported."""

    rank: int
    axis: str
    where: str  # the rank and its coordinates, e.g. "rank 5 (tp1 dp0 pp1)"
    expected: str  # e.g. "barrier on dp group [1, 5]"
    timeout_s: float
    reported: str  # the HangError's text ("" if the call did not time out)
    report_s: float  # seconds from the timeout to the error (gathering the stacks)
    ok: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """What the drill did, the timeout's report as raised, and what it had to name."""
        return (f"\nhang drill (--hang-rank {self.rank}): rank {self.rank} waits in a barrier its {self.axis} peers skip; "
                f"the call's {self.timeout_s:g} s timeout raised:\n{self.reported or '(nothing: the call finished)'}\n"
                f"expected: {self.where} in {self.expected}; "
                f"report ready {self.report_s:.2f} s after the timeout; released, the run goes on\n")


def hang_axis(mesh: Any) -> str:
    """The group the hanging rank waits on: dp, else tp, else pp (the first with a peer)."""
    for axis in ("dp", "tp", "pp"):
        if mesh.size(axis) > 1:
            return axis
    raise UsageError("--hang-rank needs an actor group of more than one rank: a rank alone has no peer to wait for")


def check_hang_rank(rank: int, mesh: Any) -> str:
    """The axis rank ``rank`` of the actor mesh will hang on; :class:`UsageError` if it cannot (before any process starts)."""
    if not 0 <= rank < mesh.world_size:
        raise UsageError(f"--hang-rank {rank} is not a rank of the actor group (ranks 0..{mesh.world_size - 1})")
    return hang_axis(mesh)


def run_hang_drill(actor: Any, rank: int, timeout_s: float = HANG_TIMEOUT_S) -> HangDrill:
    """Hang ``rank`` of the actor group in a barrier, check the timeout's report, release it."""
    mesh = actor.mesh
    axis = check_hang_rank(rank, mesh)
    members = mesh.group_of(rank, axis)
    coords = mesh.rank_coords(rank)
    expected = f"barrier on {axis} group {members}"
    start = time.monotonic()
    try:
        actor.with_timeout(timeout_s).hang_in_barrier(rank, axis)
    except HangError as err:
        report_s = time.monotonic() - start - timeout_s
        reported = str(err)
        hangs = err.hangs
        c = hangs[0].collective if len(hangs) == 1 else None
        ok = (
            err.ranks == [rank]
            and c is not None
            and (c.op, c.group, list(c.ranks)) == ("barrier", axis, members)
            and hangs[0].coords == coords
            and bool(hangs[0].node)
            and sorted(err.finished) == [r for r in range(actor.world_size) if r != rank]
        )
    else:
        report_s, reported, ok = float("nan"), "", False
    finally:
        actor.release_hang(rank, axis)  # its peers join the barrier: the run goes on
    return HangDrill(rank, axis, coords.rank_text(rank), expected, timeout_s, reported, report_s, ok)
