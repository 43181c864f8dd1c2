"""Cross-check: do the process groups the workers really built match the controller's RankMesh?

Pure functions over plain data, with no megatron-core or torch.distributed import: each worker
sends a :class:`RankReport` (what ``parallel_state``'s own getters and
``torch.distributed.get_process_group_ranks`` say), and :func:`compare_reports` lists every rank
whose coordinates, group members or all-reduce results differ from what the mesh predicts.
:func:`check_reports` raises :class:`~rankmesh.errors.MeshMismatchError` with that list.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from rankmesh.errors import MeshMismatchError
from rankmesh.mesh import AXES, EXPERT_VIEW, RankCoords, RankMesh

#: Coordinate names, in report order: the order every message prints (:class:`RankCoords`),
#: then the expert view's tp and dp.
COORDS: tuple[str, ...] = (*AXES, *(name for name in EXPERT_VIEW if name not in AXES))

#: Group name -> (mesh token, expert view?).  "dp-cp" is the group gradients are reduced over.
GROUPS: Mapping[str, tuple[str, bool]] = MappingProxyType({
    "tp": ("tp", False),
    "pp": ("pp", False),
    "cp": ("cp", False),
    "dp": ("dp", False),
    "dp-cp": ("dp-cp", False),
    "ep": ("ep", True),
    "etp": ("tp", True),
    "edp": ("dp", True),
})


@dataclass
class RankReport:
    """One worker's view of itself, taken from megatron-core (never from the controller's mesh).

    ``allreduce`` holds, per group, the result of all-reducing the global rank ids over that group
    (filled by the validation run; empty when only coordinates are checked).
    """

    rank: int
    world_size: int
    coords: dict[str, int]
    sizes: dict[str, int]
    groups: dict[str, list[int]]
    allreduce: dict[str, int] = field(default_factory=dict)
    order: str = ""
    hostname: str = ""
    pid: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankReport":
        return cls(**data)


@dataclass(frozen=True)
class Mismatch:
    """One disagreement: ``what`` (e.g. ``"coord dp"``, ``"group tp"``) on ``rank``.

    ``coords`` is where the mesh puts ``rank`` (``None`` for a rank outside it); it only names
    the rank in the text, so two mismatches are equal whatever it holds.
    """

    rank: int
    what: str
    expected: Any
    actual: Any
    coords: RankCoords | None = field(default=None, compare=False)

    def __str__(self) -> str:
        who = f"rank {self.rank}" if self.coords is None else self.coords.rank_text(self.rank)
        return f"{who}: {self.what}: mesh says {self.expected}, workers say {self.actual}"


def expected_report(mesh: RankMesh, rank: int) -> RankReport:
    """The report a correct worker at ``rank`` must produce, derived from the mesh alone."""
    mesh.dense.check_rank(rank)
    table = mesh.coord_table()
    coords = {name: int(table[name][rank]) for name in COORDS}
    groups = {name: mesh.group_of(rank, token, expert=expert) for name, (token, expert) in GROUPS.items()}
    return RankReport(
        rank=rank,
        world_size=mesh.world_size,
        coords=coords,
        sizes={axis: mesh.size(axis) for axis in COORDS},
        groups=groups,
        allreduce={name: sum(members) for name, members in groups.items()},
        order=mesh.order,
    )


def compare_report(mesh: RankMesh, report: RankReport) -> list[Mismatch]:
    """Every way one worker's report differs from the mesh (empty: it agrees)."""
    rank = report.rank
    if not 0 <= rank < mesh.world_size:
        return [Mismatch(rank, "rank", f"0..{mesh.world_size - 1}", rank)]
    want, at = expected_report(mesh, rank), mesh.rank_coords(rank)
    out: list[Mismatch] = []
    if report.world_size != want.world_size:
        out.append(Mismatch(rank, "world size", want.world_size, report.world_size, at))
    for section in ("sizes", "coords", "groups", "allreduce"):
        got_map: dict[str, Any] = getattr(report, section)
        label = {"sizes": "size", "coords": "coord", "groups": "group", "allreduce": "all-reduce"}[section]
        for key, expected in getattr(want, section).items():
            if section == "allreduce" and key not in got_map:
                continue  # all-reduce results are optional
            actual = got_map.get(key, "<missing>")
            if actual != expected:
                out.append(Mismatch(rank, f"{label} {key}", expected, actual, at))
    return out


def compare_reports(mesh: RankMesh, reports: Iterable[RankReport]) -> list[Mismatch]:
    """Every mismatch of every report, plus ranks reported twice or not at all."""
    reports = list(reports)
    out: list[Mismatch] = []
    seen: dict[int, int] = {}
    for report in reports:
        seen[report.rank] = seen.get(report.rank, 0) + 1
        out.extend(compare_report(mesh, report))
    for rank in range(mesh.world_size):
        if seen.get(rank, 0) != 1:
            out.append(Mismatch(rank, "reports", 1, seen.get(rank, 0), mesh.rank_coords(rank)))
    return out


def format_mismatches(mesh: RankMesh, mismatches: Sequence[Mismatch], limit: int = 20) -> str:
    """A readable, bounded message: which ranks disagree, and on what."""
    ranks = sorted({m.rank for m in mismatches})
    lines = [f"{len(ranks)} of {mesh.world_size} ranks disagree with {mesh!r} (ranks {ranks}):"]
    lines += [f"  {m}" for m in mismatches[:limit]]
    if len(mismatches) > limit:
        lines.append(f"  ... and {len(mismatches) - limit} more")
    return "\n".join(lines)


def check_reports(mesh: RankMesh, reports: Iterable[RankReport]) -> None:
    """Raise :class:`MeshMismatchError` unless every worker agrees with the mesh."""
    mismatches = compare_reports(mesh, reports)
    if mismatches:
        raise MeshMismatchError(format_mismatches(mesh, mismatches), mismatches=mismatches)
