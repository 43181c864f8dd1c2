"""The rank model: which (tp, cp, ep, dp, pp) coordinates a global rank has, and every process group.

megatron-core is the reference: :class:`RankGrid` reproduces ``parallel_state.RankGenerator``
(order strings list axes fastest-varying first, ``tp-cp-ep-dp-pp`` by default) and
:class:`RankMesh` reproduces the pair of generators that ``initialize_model_parallel`` builds, the
dense one over (tp, cp, dp, pp) and the expert one over (expert tp, ep, expert dp, pp).

Everything here is integer arithmetic over numpy arrays: no Ray, no torch.distributed and no
megatron-core import, so the mesh is cheap to build on the controller, even for 100k+ ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

import numpy as np

from rankmesh.errors import MeshError
from rankmesh.validate import integer, is_int, non_negative_int, positive_int

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

AXES: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
"""Every axis name an order string may use."""

DENSE_AXES: tuple[str, ...] = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"

#: The expert view's coordinate names -> the axis of the expert grid that carries them.
EXPERT_VIEW: Mapping[str, str] = MappingProxyType({"ep": "ep", "etp": "tp", "edp": "dp"})


def parse_order(order: str, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """Parse a megatron-core order string into the full axis tuple, fastest-varying first.

    Axes of size 1 may be left out (they are appended, as megatron-core does); an unknown or
    repeated axis, or a missing axis of size > 1, is an error.
    """
    if not isinstance(order, str) or not order.strip():
        raise MeshError(f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}")
    tokens = order.strip().lower().split("-")
    seen: list[str] = []
    for token in tokens:
        if token not in AXES:
            raise MeshError(f"order {order!r}: unknown axis {token!r} (known axes: {', '.join(AXES)})")
        if token in seen:
            raise MeshError(f"order {order!r}: axis {token!r} appears twice")
        seen.append(token)
    for axis in AXES:
        if axis not in seen:
            if sizes.get(axis, 1) != 1:
                raise MeshError(
                    f"order {order!r} leaves out axis {axis!r}, whose size is {sizes[axis]}; "
                    f"only axes of size 1 may be left out"
                )
            seen.append(axis)
    return tuple(seen)


class RankGrid:
    """One megatron-core ``RankGenerator``: ranks laid out over ordered axes, vectorized.

    ``RankGrid(tp=2, dp=2, pp=2).groups("tp")`` equals
    ``RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp").get_ranks("tp")``.
    As in megatron-core, one grid cannot have both cp > 1 and ep > 1: the dense grid carries cp, the
    expert grid carries ep.
    """

    def __init__(
        self,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp: int = 1,
        pp: int = 1,
        order: str = DEFAULT_ORDER,
        rank_offset: int = 0,
    ) -> None:
        sizes = {axis: positive_int(value, axis, MeshError) for axis, value in zip(AXES, (tp, cp, ep, dp, pp))}
        if sizes["cp"] > 1 and sizes["ep"] > 1:
            raise MeshError(
                f"cp={sizes['cp']} and ep={sizes['ep']} cannot both exceed 1 in one rank grid: "
                "megatron-core keeps cp in the dense grid and ep in the expert grid"
            )
        rank_offset = non_negative_int(rank_offset, "rank_offset", MeshError)
        self.sizes: dict[str, int] = sizes
        self.axes: tuple[str, ...] = parse_order(order, sizes)
        self.rank_offset = rank_offset
        self.world_size = int(np.prod([sizes[a] for a in AXES]))
        # Stride of each axis in the global rank: the first axis in the order varies fastest.
        strides, stride = {}, 1
        for axis in self.axes:
            strides[axis] = stride
            stride *= sizes[axis]
        self.strides: dict[str, int] = strides

    @property
    def order(self) -> str:
        return "-".join(self.axes)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in AXES if self.sizes[a] > 1) or "world=1"
        return f"RankGrid({sizes}, order={self.order!r})"

    def _check_token(self, token: str) -> tuple[str, ...]:
        if not isinstance(token, str) or not token:
            raise MeshError(f"group token must be a string such as 'tp' or 'dp-cp', got {token!r}")
        names = tuple(token.lower().split("-"))
        for name in names:
            if name not in AXES:
                raise MeshError(f"group token {token!r}: unknown axis {name!r} (known axes: {', '.join(AXES)})")
        if len(set(names)) != len(names):
            raise MeshError(f"group token {token!r} repeats an axis")
        return names

    @cached_property
    def _rank_array(self) -> np.ndarray:
        """Global ranks shaped by the order reversed (C order: the last array dim varies fastest)."""
        shape = [self.sizes[a] for a in reversed(self.axes)]
        return np.arange(self.world_size, dtype=np.int64).reshape(shape) + self.rank_offset

    def groups_array(self, token: str) -> np.ndarray:
        """All groups of ``token`` as an int array of shape (n_groups, group_size), megatron's order.

        Groups are enumerated with the unmasked axes' index (first order axis fastest) and each
        group's members with the masked axes' index (first order axis fastest), exactly as
        ``generate_masked_orthogonal_rank_groups`` does.
        """
        names = self._check_token(token)
        n = len(self.axes)
        # Array dim d holds order axis n-1-d, so ascending dims are slowest-first: C-order reshape
        # then makes the first order axis vary fastest within both the group index and the group.
        masked = [d for d in range(n) if self.axes[n - 1 - d] in names]
        unmasked = [d for d in range(n) if self.axes[n - 1 - d] not in names]
        group_size = int(np.prod([self.sizes[a] for a in names]))
        moved = self._rank_array.transpose(unmasked + masked)
        return moved.reshape(self.world_size // group_size, group_size)

    def groups(self, token: str) -> list[list[int]]:
        """All groups of ``token`` as lists, identical to ``RankGenerator.get_ranks(token)``."""
        return self.groups_array(token).tolist()

    @cached_property
    def coord_table(self) -> dict[str, np.ndarray]:
        """Every rank's coordinates by axis name: ``table["dp"][r]`` is local rank ``r``'s dp coordinate."""
        ranks = np.arange(self.world_size, dtype=np.int64)
        return {a: (ranks // self.strides[a]) % self.sizes[a] for a in AXES}

    def check_rank(self, rank: int, name: str = "rank") -> int:
        """``rank`` relative to the grid's first rank; :class:`MeshError` if it is not in the grid."""
        local = integer(rank, name, MeshError) - self.rank_offset
        if not 0 <= local < self.world_size:
            raise MeshError(
                f"{name} {rank} is out of range for a mesh of world size {self.world_size}"
                + (f" starting at rank {self.rank_offset}" if self.rank_offset else "")
            )
        return local

    def coord(self, rank: int, axis: str) -> int:
        local = self.check_rank(rank)
        return (local // self.strides[axis]) % self.sizes[axis]

    def rank_of(self, **coords: int) -> int:
        rank = self.rank_offset
        for axis, value in coords.items():
            if axis not in AXES:
                raise MeshError(f"rank_of: unknown axis {axis!r} (known axes: {', '.join(AXES)})")
            value = integer(value, f"rank_of: {axis}", MeshError)
            if not 0 <= value < self.sizes[axis]:
                raise MeshError(f"rank_of: {axis}={value} is out of range [0, {self.sizes[axis]})")
            rank += value * self.strides[axis]
        return rank


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in its mesh, as every error, report, trace track and check names it.

    One record, so that two lines about the same rank never disagree.  :meth:`label` prints the
    coordinates in one fixed order, ``tp cp ep dp pp``: megatron-core's default order string
    (:data:`DEFAULT_ORDER`), which megatron users read in every config and log, from the
    innermost axis (tp, fastest-varying, the first to share a node) out to the pipeline stage.
    It is fixed, not the mesh's own order string, so that groups built with another order still
    print alike.  Axes of size 1 are left out (their coordinate is 0 on every rank and tells
    nothing): a rank of a tp2·pp2·dp2 mesh reads ``tp1 dp0 pp1``, one of a dp-only group
    ``dp3``, and the rank of a group of one has an empty label.  :meth:`to_dict` is the JSON form
    and always has all five axes.  Build one with :meth:`RankMesh.rank_coords`; ``ep`` is the
    expert view's coordinate (megatron's ``get_expert_model_parallel_rank``), the others the dense
    view's.
    """

    tp: int = 0
    cp: int = 0
    ep: int = 0
    dp: int = 0
    pp: int = 0
    shown: tuple[str, ...] = AXES  # the axes of size > 1 in the rank's mesh

    def __post_init__(self) -> None:
        for axis in AXES:
            non_negative_int(getattr(self, axis), f"RankCoords {axis}", MeshError)
        unknown = [a for a in self.shown if a not in AXES]
        if unknown:
            raise MeshError(f"RankCoords shown={self.shown!r}: unknown axis {unknown[0]!r} (known axes: {', '.join(AXES)})")

    def shard(self) -> "RankCoords":
        """Which shard the rank holds: these coordinates with dp set to 0 (dp only says which copy)."""
        return replace(self, dp=0)

    def label(self) -> str:
        """``tp1 dp0 pp1``: the coordinates along the shown axes, in :data:`AXES` order."""
        return " ".join(f"{a}{getattr(self, a)}" for a in AXES if a in self.shown)

    def rank_text(self, rank: int) -> str:
        """``rank 5 (tp1 dp0 pp1)``, or ``rank 0`` when the label is empty: how messages name a rank."""
        label = self.label()
        return f"rank {rank} ({label})" if label else f"rank {rank}"

    def to_dict(self) -> dict[str, int]:
        """``{"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}``: every axis, in :data:`AXES` order (for JSON)."""
        return {a: getattr(self, a) for a in AXES}

    def __getitem__(self, axis: str) -> int:
        """``coords["tp"]``: the coordinate along one axis, as the coordinate dicts of earlier releases read."""
        if axis not in AXES:
            raise KeyError(f"{axis!r} is not a mesh axis (axes: {', '.join(AXES)})")
        return getattr(self, axis)


@dataclass(frozen=True)
class DistRankInfo:
    """One rank's coordinates as verl's worker code reads them: dense (tp, dp, pp, cp) and expert (ep, etp, edp).

    verl's record (``tp_rank``, ``dp_rank``, ... as ``Worker.get_megatron_rank_info`` returns it), kept so
    ported worker code runs unchanged; :meth:`RankMesh.coords` and ``Worker.rank_info`` return it.
    To print or log a rank use :class:`RankCoords` (:meth:`RankMesh.rank_coords`) instead: it knows
    which axes have size 1 and leaves them out, which this record, holding no sizes, cannot.
    """

    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0


@dataclass(frozen=True)
class DistGlobalInfo:
    """The axis sizes of a mesh (verl's names, plus the expert axes)."""

    tp_size: int
    dp_size: int
    pp_size: int
    cp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1
    edp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size * self.pp_size * self.cp_size


class RankMesh:
    """The parallel layout of one worker group, as megatron-core's ``initialize_model_parallel`` builds it.

    The dense mesh spans (tp, cp, dp, pp); expert parallelism lives in a separate expert view over
    (expert tp, ep, expert dp, pp) sharing the same order string and world size.  ``ep`` therefore
    never multiplies the world size: ``world_size = tp * cp * dp * pp``.
    """

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        dp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        order: str = DEFAULT_ORDER,
    ) -> None:
        tp, pp, cp, dp, ep = (positive_int(v, n, MeshError) for n, v in (("tp", tp), ("pp", pp), ("cp", cp), ("dp", dp), ("ep", ep)))
        etp = tp if etp is None else positive_int(etp, "etp", MeshError)
        self.dense = RankGrid(tp=tp, cp=cp, dp=dp, pp=pp, order=order)
        world = self.dense.world_size
        expert_model = etp * ep * pp
        if world % expert_model:
            raise MeshError(
                f"world size {world} (tp*cp*dp*pp) is not divisible by etp*ep*pp = "
                f"{etp}*{ep}*{pp} = {expert_model}"
            )
        self.expert = RankGrid(tp=etp, ep=ep, dp=world // expert_model, pp=pp, order=order)
        self.megatron_problem: str | None = None
        if not (self.expert.order.endswith("pp") or pp == 1 or self.expert.sizes["dp"] == dp):
            self.megatron_problem = (
                f"order {order!r} does not end with pp, so megatron-core requires the expert dp size "
                f"(world/(etp*ep*pp) = {self.expert.sizes['dp']}) to equal dp ({dp})"
            )
            if ep > 1 or etp != tp:
                raise MeshError(self.megatron_problem)

    def check_megatron(self) -> None:
        """Raise :class:`MeshError` if megatron-core's ``initialize_model_parallel`` would refuse this mesh.

        The dense groups of such a mesh are well defined (``RankGenerator`` builds them), so the
        mesh itself allows it; megatron-core additionally asserts that, unless the order ends with
        pp, the expert dp size equals dp, which fails when cp > 1 and pp > 1.
        """
        if self.megatron_problem:
            raise MeshError(self.megatron_problem)

    @classmethod
    def for_world(
        cls,
        world_size: int,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        order: str = DEFAULT_ORDER,
    ) -> "RankMesh":
        """Build the mesh for ``world_size`` ranks, deriving dp as megatron-core does."""
        world_size = positive_int(world_size, "world_size", MeshError)
        model = positive_int(tp, "tp", MeshError) * positive_int(pp, "pp", MeshError) * positive_int(cp, "cp", MeshError)
        if world_size % model:
            raise MeshError(f"world_size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model}")
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // model, ep=ep, etp=etp, order=order)

    # ----- sizes -------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.dense.world_size

    @property
    def order(self) -> str:
        return self.dense.order

    def size(self, axis: str) -> int:
        """Size of a dense axis, or of ``ep``/``etp``/``edp`` for the expert view."""
        if axis in DENSE_AXES:
            return self.dense.sizes[axis]
        if axis in EXPERT_VIEW:
            return self.expert.sizes[EXPERT_VIEW[axis]]
        raise MeshError(f"unknown axis {axis!r} (known: tp, cp, dp, pp, ep, etp, edp)")

    @property
    def sizes(self) -> dict[str, int]:
        return {axis: self.size(axis) for axis in ("tp", "cp", "ep", "dp", "pp", "etp", "edp")}

    @property
    def global_info(self) -> DistGlobalInfo:
        return DistGlobalInfo(
            tp_size=self.size("tp"),
            dp_size=self.size("dp"),
            pp_size=self.size("pp"),
            cp_size=self.size("cp"),
            ep_size=self.size("ep"),
            etp_size=self.size("etp"),
            edp_size=self.size("edp"),
        )

    def __repr__(self) -> str:
        parts = [f"{a}={self.size(a)}" for a in ("tp", "cp", "dp", "pp")]
        if self.size("ep") > 1:
            parts.append(f"ep={self.size('ep')}")
        if self.size("etp") != self.size("tp"):
            parts.append(f"etp={self.size('etp')}")
        return f"RankMesh({', '.join(parts)}, order={self.order!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankMesh):
            return NotImplemented
        return self.sizes == other.sizes and self.order == other.order

    def __hash__(self) -> int:
        return hash((tuple(self.sizes.items()), self.order))

    def __reduce__(self):
        s = self.sizes
        return (RankMesh, (s["tp"], s["pp"], s["cp"], s["dp"], s["ep"], s["etp"], self.order))

    # ----- coordinates -------------------------------------------------------------------------

    def coords(self, rank: int) -> DistRankInfo:
        """``rank``'s coordinates as verl's :class:`DistRankInfo` (``.tp_rank``, ... ``.edp_rank``), for worker code.

        The same numbers as :meth:`rank_coords`, in verl's shape; for a message naming the rank
        (``rank 5 (tp1 dp0 pp1)``) use ``rank_coords(rank).label()`` or ``.rank_text(rank)``.
        """
        self.dense.check_rank(rank)
        table = self.coord_table()
        return DistRankInfo(
            tp_rank=int(table["tp"][rank]),
            dp_rank=int(table["dp"][rank]),
            pp_rank=int(table["pp"][rank]),
            cp_rank=int(table["cp"][rank]),
            ep_rank=int(table["ep"][rank]),
            etp_rank=int(table["etp"][rank]),
            edp_rank=int(table["edp"][rank]),
        )

    def rank_coords(self, rank: int) -> RankCoords:
        """``rank``'s coordinates as every message prints them: a :class:`RankCoords` with ``.label()``.

        rankmesh's record (``.tp``, ``.dp``, ... and the axes of size > 1); :meth:`coords` gives the
        same numbers as verl's :class:`DistRankInfo` (``.tp_rank``, ...) for worker code.
        """
        self.dense.check_rank(rank)
        table = self.coord_table()
        shown = tuple(a for a in AXES if self.size(a) > 1)
        return RankCoords(**{a: int(table[a][rank]) for a in AXES}, shown=shown)

    def coord_table(self) -> dict[str, np.ndarray]:
        """Every rank's coordinates at once: axis name -> int array indexed by rank (vectorized).

        The dense axes come from the dense grid; ``ep``, ``etp`` and ``edp`` from the expert
        grid (:data:`EXPERT_VIEW`).
        """
        dense, expert = self.dense.coord_table, self.expert.coord_table
        return {**{a: dense[a] for a in DENSE_AXES}, **{name: expert[axis] for name, axis in EXPERT_VIEW.items()}}

    def rank_of(self, tp: int = 0, pp: int = 0, cp: int = 0, dp: int = 0) -> int:
        """The global rank at the given dense coordinates."""
        return self.dense.rank_of(tp=tp, pp=pp, cp=cp, dp=dp)

    # ----- groups ------------------------------------------------------------------------------

    def _grid(self, token: str, expert: bool) -> RankGrid:
        grid = self.expert if expert else self.dense
        names = grid._check_token(token)
        if not expert and "ep" in names and self.size("ep") > 1:
            raise MeshError(
                f"group token {token!r}: ep groups live in the expert view; use groups({token!r}, expert=True)"
            )
        return grid

    def groups(self, token: str, expert: bool = False) -> list[list[int]]:
        """Every group of ``token`` (e.g. ``"tp"``, ``"dp-cp"``), identical to megatron-core's.

        ``expert=True`` asks the expert view (megatron's expert rank generator), where ``"tp"``
        means expert tp, ``"dp"`` expert dp, and ``"ep"`` the expert-parallel groups.
        """
        return self._grid(token, expert).groups(token)

    def groups_array(self, token: str, expert: bool = False) -> np.ndarray:
        return self._grid(token, expert).groups_array(token)

    def group_of(self, rank: int, token: str, expert: bool = False) -> list[int]:
        """The members of ``rank``'s group of ``token``."""
        grid = self._grid(token, expert)
        grid.check_rank(rank)
        table = grid.groups_array(token)
        row = np.nonzero((table == rank).any(axis=1))[0][0]
        return table[row].tolist()

    def rank_in_group(self, rank: int, token: str, expert: bool = False) -> int:
        """``rank``'s index inside its group of ``token`` (what torch.distributed.get_rank(group) gives)."""
        return self.group_of(rank, token, expert).index(rank)

    # ----- roles of ranks ----------------------------------------------------------------------

    def dp_rank(self, rank: int, with_cp: bool = False) -> int:
        """The data-parallel rank; ``with_cp=True`` gives the rank in the dp-cp group, as megatron does."""
        if with_cp:
            return self.rank_in_group(rank, "dp-cp")
        return self.coords(rank).dp_rank

    def is_collect(self, rank: int) -> bool:
        """Whether ``rank`` holds a replica's output: tp==0, last pipeline stage, cp==0."""
        info = self.coords(rank)
        return info.tp_rank == 0 and info.cp_rank == 0 and info.pp_rank == self.size("pp") - 1

    def collect_ranks(self) -> list[int]:
        """The collect ranks, in dp order."""
        return [self.rank_of(dp=d, pp=self.size("pp") - 1) for d in range(self.size("dp"))]

    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank).pp_rank == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank).pp_rank == self.size("pp") - 1

    def stage_ranks(self, stage: int) -> list[int]:
        """All ranks of pipeline stage ``stage`` (negative counts from the last), in rank order."""
        pp = self.size("pp")
        if not is_int(stage) or not -pp <= stage < pp:
            raise MeshError(f"stage {stage!r} is out of range for pp={pp}")
        return np.nonzero(self.coord_table()["pp"] == stage % pp)[0].tolist()

    def first_stage_ranks(self) -> list[int]:
        return self.stage_ranks(0)

    def last_stage_ranks(self) -> list[int]:
        return self.stage_ranks(-1)

    # ----- PyTorch-native view -----------------------------------------------------------------

    def device_mesh_shape(self) -> tuple[tuple[str, ...], np.ndarray]:
        """Dimension names (slowest first) and the rank array a torch ``DeviceMesh`` needs."""
        axes = tuple(a for a in reversed(self.dense.axes) if a in DENSE_AXES)
        shape = [self.size(a) for a in axes]
        return axes, np.arange(self.world_size, dtype=np.int64).reshape(shape)

    def to_device_mesh(self, device_type: str = "cpu") -> "DeviceMesh":
        """A torch ``DeviceMesh`` over the same ranks, with dimensions named pp/dp/cp/tp.

        Call it on every rank inside an initialized default process group (it creates subgroups).
        ``device_mesh["tp"]`` then spans exactly ``self.group_of(rank, "tp")``.
        """
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if not (dist.is_available() and dist.is_initialized()):
            raise MeshError(
                "to_device_mesh() builds process groups, so it needs torch.distributed's default group: call it on "
                "every rank after torch.distributed.init_process_group(...) (in a rankmesh worker, after "
                "init_torch_distributed()); on the controller, device_mesh_shape() gives the names and ranks"
            )
        if dist.get_world_size() != self.world_size:
            raise MeshError(f"to_device_mesh(): the default process group has {dist.get_world_size()} ranks, "
                            f"the mesh {self.world_size}; build the mesh for the group's world size")
        names, ranks = self.device_mesh_shape()
        return DeviceMesh(device_type, torch.from_numpy(ranks), mesh_dim_names=names)

