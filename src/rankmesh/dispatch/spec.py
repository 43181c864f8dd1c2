"""Dispatch modes as data: which mesh axes split the input, whose outputs are kept.

A :class:`MeshSpec` names the axes a call's input is split over (every other axis replicates it)
and a coordinate predicate that selects the ranks whose outputs come back.  Every named mode of
verl (``DP_COMPUTE_PROTO``, ``MEGATRON_PP_AS_DP`` ...) is one instance of this type, so a new
layout needs a new spec, not a new pair of hand-written functions.

``MeshSpec.plan(mesh)`` turns the spec into a :class:`DispatchPlan` for one concrete mesh: the
number of pieces, the piece each rank receives, the ranks that run and the ranks whose outputs are
collected, in output order.  Plans are pure integer arithmetic over the mesh's coordinate table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping, Sequence

import numpy as np

from rankmesh.errors import DispatchError
from rankmesh.mesh import RankMesh
from rankmesh.validate import integer, is_int

#: Axes a spec may split over or name in its collect predicate.  ``"rank"`` is the flat global
#: rank (split over every rank, as verl's DP_COMPUTE does).
SPEC_AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp", "ep", "etp", "edp", "rank")

#: Megatron's collect rule: the first tp rank of the last pipeline stage of the first cp rank.
MEGATRON_COLLECT: Mapping[str, int] = MappingProxyType({"tp": 0, "pp": -1, "cp": 0})

DEFAULT_MESH = "default"

Output = Literal["list", "concat", "single"]
Run = Literal["all", "collect"]


def _normalize_collect(collect: object) -> tuple[tuple[str, int], ...] | None:
    if collect is None:
        return None
    items = collect.items() if isinstance(collect, Mapping) else collect
    try:
        pairs = tuple((str(axis), value) for axis, value in items)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise DispatchError(f"collect must be a mapping such as {{'tp': 0}}, got {collect!r}") from None
    for axis, value in pairs:
        if axis not in SPEC_AXES:
            raise DispatchError(f"collect: unknown axis {axis!r} (known: {', '.join(SPEC_AXES)})")
        integer(value, f"collect: {axis} (a coordinate, -1 = last)", DispatchError)
    if len({axis for axis, _ in pairs}) != len(pairs):
        raise DispatchError(f"collect names an axis twice: {collect!r}")
    return tuple(sorted((axis, int(value)) for axis, value in pairs))


@dataclass(frozen=True)
class MeshSpec:
    """How one method's arguments map onto the ranks of a mesh, and which outputs come back.

    * ``split``: mesh axes the input is split over, slowest first; the piece index of a rank is the
      mixed-radix number of its coordinates along these axes.  ``("rank",)`` splits over every
      rank.  ``()`` sends the same arguments to every rank.  All other axes replicate the piece.
    * ``collect``: coordinate predicate (``{"tp": 0, "pp": -1}``; ``-1`` is the last index)
      selecting the ranks whose outputs are kept; ``None`` keeps every rank.  Outputs are ordered
      by piece index, then rank.
    * ``mesh``: name of the group mesh the axes refer to (``"default"`` is the training mesh).
    * ``proto``: arguments are DataProto / DataProtoFuture batches split by rows; otherwise split
      arguments must be lists with one item per piece.
    * ``output``: ``"concat"`` (one DataProto, the default when ``proto``), ``"list"`` (one output
      per collected rank, the default otherwise) or ``"single"`` (the one collected output).
    * ``run``: ``"all"`` ranks execute, or only the ``"collect"`` ranks (``RANK_ZERO``).
    * ``with_func``: the first positional argument is a function sent whole to every rank.
    * ``broadcast_fallback``: when not every argument is a list of ``n_pieces`` items, send every
      argument whole to every rank instead of failing (verl's ``ALL_TO_ALL`` / ``execute_all``).
    * ``padding``: pad batches that do not divide into ``n_pieces`` (the caller still gets
      exactly its rows back); batches can also ask for it via ``meta_info``.
    """

    split: tuple[str, ...] = ()
    collect: tuple[tuple[str, int], ...] | None = None
    mesh: str = DEFAULT_MESH
    proto: bool = False
    output: Output | None = None
    run: Run = "all"
    with_func: bool = False
    broadcast_fallback: bool = False
    padding: bool = False
    name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        split = (self.split,) if isinstance(self.split, str) else tuple(self.split)
        for axis in split:
            if axis not in SPEC_AXES:
                raise DispatchError(f"split: unknown axis {axis!r} (known: {', '.join(SPEC_AXES)})")
        if len(set(split)) != len(split):
            raise DispatchError(f"split names an axis twice: {split!r}")
        if "rank" in split and len(split) > 1:
            raise DispatchError(f"split: 'rank' means every rank and cannot be combined with other axes: {split!r}")
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "collect", _normalize_collect(self.collect))
        if not isinstance(self.mesh, str) or not self.mesh:
            raise DispatchError(f"mesh must be a mesh name such as 'default', got {self.mesh!r}")
        output = self.output or ("concat" if self.proto else "list")
        if output not in ("list", "concat", "single"):
            raise DispatchError(f"output must be 'list', 'concat' or 'single', got {output!r}")
        if output == "concat" and not self.proto:
            raise DispatchError("output='concat' concatenates DataProto pieces and needs proto=True")
        object.__setattr__(self, "output", output)
        if self.run not in ("all", "collect"):
            raise DispatchError(f"run must be 'all' or 'collect', got {self.run!r}")
        if (self.proto or self.with_func or self.padding) and not split:
            raise DispatchError("proto, with_func and padding need split axes (split=() replicates the arguments)")
        if self.broadcast_fallback and (self.proto or not split):
            raise DispatchError("broadcast_fallback applies to list splitting (proto=False with split axes)")

    @property
    def collect_map(self) -> dict[str, int]:
        return dict(self.collect or ())

    @property
    def label(self) -> str:
        """Name used in error messages: the registered mode name, or the spec itself."""
        return self.name or repr(self)

    def replace(self, **changes: object) -> "MeshSpec":
        """A copy with some fields changed (``collect`` may be given as a mapping)."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if "output" not in changes and "proto" in changes:
            fields["output"] = None
        fields.update(changes)
        return MeshSpec(**fields)  # type: ignore[arg-type]

    def plan(self, mesh: RankMesh) -> "DispatchPlan":
        """Which rank gets which piece and whose outputs come back, on ``mesh``."""
        world = mesh.world_size
        ranks = np.arange(world, dtype=np.int64)
        table = mesh.coord_table()

        def column(axis: str) -> tuple[np.ndarray, int]:
            return (ranks, world) if axis == "rank" else (table[axis], mesh.size(axis))

        piece = np.zeros(world, dtype=np.int64)
        n_pieces = 1
        for axis in self.split:
            values, size = column(axis)
            piece = piece * size + values
            n_pieces *= size
        mask = np.ones(world, dtype=bool)
        for axis, value in self.collect or ():
            values, size = column(axis)
            if not -size <= value < size:
                raise DispatchError(
                    f"{self.label}: collect {axis}={value} is out of range for {axis} size {size} on {mesh}"
                )
            mask &= values == value % size
        chosen = ranks[mask]
        order = np.lexsort((chosen, piece[chosen]))
        collect = tuple(int(r) for r in chosen[order])
        run = collect if self.run == "collect" else tuple(range(world))
        plan = DispatchPlan(
            n_pieces=n_pieces,
            piece_of_rank=tuple(int(p) for p in piece),
            collect_ranks=collect,
            run_ranks=run,
        )
        self._check_plan(plan, mesh)
        return plan

    def _check_plan(self, plan: "DispatchPlan", mesh: RankMesh) -> None:
        if self.output == "single" and len(plan.collect_ranks) != 1:
            raise DispatchError(
                f"{self.label}: output='single' needs exactly one collected rank, "
                f"the predicate {self.collect_map} selects {len(plan.collect_ranks)} on {mesh}"
            )
        if self.output == "concat":
            pieces = [plan.piece_of_rank[r] for r in plan.collect_ranks]
            if pieces != list(range(plan.n_pieces)):
                raise DispatchError(
                    f"{self.label}: concatenating outputs needs exactly one collected rank per piece; "
                    f"on {mesh} the collected ranks {list(plan.collect_ranks)} hold pieces {pieces} "
                    f"of {plan.n_pieces}"
                )


@dataclass(frozen=True)
class DispatchPlan:
    """A spec applied to one mesh: the integer tables a call needs, nothing else."""

    n_pieces: int
    piece_of_rank: tuple[int, ...]
    collect_ranks: tuple[int, ...]
    run_ranks: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.piece_of_rank)

    @classmethod
    def from_dispatch_info(cls, dp_ranks: Sequence[int], is_collect: Sequence[bool]) -> "DispatchPlan":
        """A plan from what workers registered themselves (verl's ``_register_dispatch_collect_info``).

        Piece = the rank's registered dp rank; collected = its registered flag, in dp order.
        """
        if len(dp_ranks) != len(is_collect):
            raise DispatchError(f"dispatch info covers {len(dp_ranks)} ranks but collect info {len(is_collect)}")
        bad = [r for r, d in enumerate(dp_ranks) if not is_int(d) or d < 0]
        if bad:
            raise DispatchError(f"ranks {bad} registered no valid dp rank (got {[dp_ranks[r] for r in bad]})")
        n_pieces = max(dp_ranks) + 1
        collect = sorted((r for r, c in enumerate(is_collect) if c), key=lambda r: (dp_ranks[r], r))
        pieces = [dp_ranks[r] for r in collect]
        if pieces != list(range(n_pieces)):
            raise DispatchError(
                f"registered collect ranks {collect} hold dp ranks {pieces}; need exactly one per dp rank 0..{n_pieces - 1}"
            )
        return cls(
            n_pieces=n_pieces,
            piece_of_rank=tuple(int(d) for d in dp_ranks),
            collect_ranks=tuple(collect),
            run_ranks=tuple(range(len(dp_ranks))),
        )
