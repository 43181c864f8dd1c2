"""One hang report for many ranks: the unfinished ranks grouped by where they are stuck, the finished listed.

Pure data and text, no Ray: the Ray backend fills a :class:`HangReport` with one :class:`RankHang`
per unfinished rank (the stacks its process sent back, or why there are none), and the same
report is the text of a timeout's :class:`~rankmesh.errors.HangError` and of a stall warning.
Ranks are grouped by *place*: the same state, the same collective operation on the same mesh
axis, and the same innermost user frame, so 64 data-parallel ranks waiting in one all_reduce
read as one line, and the one rank elsewhere stands out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rankmesh.mesh import RankCoords

from .capture import Collective, Frame, ProcessStacks, collective_text, is_library_file, library_roots

#: States of an unfinished rank: it answered with its stacks, its process is gone, or it did
#: not answer within the gathering budget (a process frozen with the GIL held, or overloaded).
STUCK, DEAD, NO_ANSWER = "stuck", "dead", "no answer"

#: Frames of a stack shown per place in the text (the records keep every frame).
SHOWN_FRAMES = 12


@dataclass(frozen=True)
class RankHang:
    """One unfinished rank: who and where it runs, and what it was doing when asked.

    ``coords`` is the rank's :class:`~rankmesh.mesh.RankCoords` (``None`` if unknown);
    ``state`` is :data:`STUCK` (``stacks`` holds every thread's stack), :data:`DEAD` or
    :data:`NO_ANSWER` (``detail`` says why there are no stacks).
    """

    rank: int
    coords: RankCoords | None
    node: str | None
    state: str
    stacks: ProcessStacks | None = None
    detail: str = ""

    @property
    def place(self) -> Frame | None:
        """The innermost user frame of the thread running the call."""
        return None if self.stacks is None else self.stacks.place

    @property
    def collective(self) -> Collective | None:
        """The torch.distributed operation the call's thread is blocked in, if any."""
        return None if self.stacks is None else self.stacks.collective

    @property
    def call_frames(self) -> tuple[Frame, ...]:
        """The call thread's stack, innermost frame first (empty without stacks)."""
        if self.stacks is None or not self.stacks.threads or not self.stacks.threads[0].call:
            return ()
        return self.stacks.threads[0].frames

    def where(self) -> str:
        """Where this rank is, in words: ``all_reduce on dp group [1, 3] in step (w.py:40)``."""
        if self.state != STUCK:
            what = "process dead" if self.state == DEAD else "no stacks"
            return what + (f" ({self.detail})" if self.detail else "")
        if self.stacks is not None and not self.stacks.busy:
            return "not running the call (finished it just now, or has not started it)"
        parts = [] if self.collective is None else [f"{self.collective}"]
        if self.place is not None:
            parts.append(f"in {self.place}")
        return " ".join(parts) or "no Python frame"


def place_key(hang: RankHang) -> tuple:
    """What ranks stuck at the same place share: state, operation, group axis, user frame."""
    c = hang.collective
    frame = hang.place
    busy = hang.stacks.busy if hang.stacks is not None else True
    return (
        hang.state,
        busy,
        None if c is None else (c.op, c.group),
        None if frame is None else (frame.function, frame.file, frame.line),
    )


def group_by_place(hangs: Sequence[RankHang]) -> list[list[RankHang]]:
    """Ranks stuck at the same place (:func:`place_key`), each group by rank, groups by first rank."""
    groups: dict[tuple, list[RankHang]] = {}
    for hang in sorted(hangs, key=lambda h: h.rank):
        groups.setdefault(place_key(hang), []).append(hang)
    return list(groups.values())


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


@dataclass(frozen=True)
class HangReport:
    """Where every unfinished rank of one call was, asked ``after_s`` seconds into the call.

    ``hangs``: one record per unfinished rank, by rank; ``finished``: the ranks that finished;
    ``gather_s``: how long asking took.
    """

    method: str
    after_s: float
    hangs: tuple[RankHang, ...]
    finished: tuple[int, ...]
    gather_s: float = 0.0

    @property
    def dead(self) -> list[int]:
        """Ranks whose process is gone."""
        return [h.rank for h in self.hangs if h.state == DEAD]

    @property
    def unfinished(self) -> list[int]:
        return [h.rank for h in self.hangs]

    @property
    def roots(self) -> list[int]:
        """The unfinished ranks the others may be waiting for: those that gave no answer (a stopped
        or wedged process) and those running the call outside a collective (stuck in user code).
        Not a rank waiting in a collective (it waits for another), nor one not running the call
        (it waits for its turn); empty when nothing here tells who is to blame."""
        return [h.rank for h in self.hangs if h.state == NO_ANSWER
                or (h.state == STUCK and h.stacks is not None and h.stacks.busy and h.collective is None)]

    def places(self) -> list[list[RankHang]]:
        """The unfinished ranks grouped by place (see :func:`group_by_place`)."""
        return group_by_place(self.hangs)

    def text(self) -> str:
        """The report as the error and the warning print it: one entry per place, then the finished."""
        total = len(self.hangs) + len(self.finished)
        lines = [f"{len(self.hangs)} of {total} ranks unfinished after {self.after_s:.3g} s; where they are (asked in {self.gather_s:.2f} s):"]
        roots = library_roots()
        for group in self.places():
            first = group[0]
            nodes = sorted({h.node for h in group if h.node})
            on = f" on node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)}" if nodes else ""
            labels = [h.coords.label() if h.coords is not None else "" for h in group]
            at = f" ({', '.join(labels)})" if any(labels) else ""
            who = f"{_ranks_text([h.rank for h in group])}{at}{on}"
            where = _where(group)
            lines.append(f"  {who}: {where}")
            lines.extend(f"      {frame}" for frame in _shown(first.call_frames, roots))
        if self.finished:
            lines.append(f"  finished: {_ranks_text(list(self.finished))}")
        return "\n".join(lines)


def _where(group: Sequence[RankHang]) -> str:
    """Where a group of ranks at one place is: one collective line naming every group of its axis."""
    first, c = group[0], group[0].collective
    if len(group) == 1 or c is None or first.state != STUCK:
        return first.where()
    members = sorted({h.collective.ranks for h in group if h.collective is not None})
    peers = {h.collective.peer for h in group if h.collective is not None}
    text = collective_text(c.op, c.group, members, c.peer if len(peers) == 1 else None)
    return text + (f" in {first.place}" if first.place is not None else "")


def _shown(frames: Sequence[Frame], roots: tuple[str, ...]) -> list[Frame]:
    """The frames worth printing: innermost first, out to the outermost user frame, at most :data:`SHOWN_FRAMES`."""
    user = [i for i, f in enumerate(frames) if not is_library_file(f.file, roots)]
    end = user[-1] + 1 if user else len(frames)
    return list(frames[: min(end, SHOWN_FRAMES)])
