"""The reshard planner: which source rank sends which region of which parameter to which destination rank.

Why pure rank arithmetic: both groups' meshes are known exactly, so every rank's shard of every
parameter is a box (a product of per-dimension intervals) of the full tensor, computed the way
megatron-core cuts it.  Intersecting source and destination boxes gives each destination region
exactly once, with no gather anywhere; this is how NVIDIA NeMo-RL refits a generator from the
trainer.  Nothing here imports Ray, torch or megatron-core: the plan is built on the controller.

How a rank's shard is cut (megatron-core's rules):

* an expert parameter (``expert=True``) is first cut into ``ep`` contiguous chunks along
  ``ep_dim``; the rank keeps chunk ``ep_rank`` (expert dims use the expert view's coordinates);
* then ``tp_dim`` (of that chunk) is cut into ``tp * tp_stride`` equal blocks and tp rank ``t``
  keeps blocks ``t, t + tp, t + 2 tp, ...`` concatenated, as megatron's
  ``_initialize_affine_weight_cpu`` does (``weight_list[rank::world_size]``); ``tp`` is the expert
  tp size for expert parameters;
* a parameter with ``pp_stage=k`` lives on pipeline stage ``k`` only, ``None`` on every stage.

Ranks that hold the same shard (dp replicas and cp ranks; expert dp replicas) form a *holder
set*.  Every destination region is read from one holder; the regions a holder set sends are cut
into equal contiguous runs of bytes, one per holder, so the busiest holder sends at most its
share plus one element.  Destinations that want the same source bytes (replicas of the
destination) read them from the same holder, which can then put them into the object store once.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from rankmesh.errors import ReshardError
from rankmesh.mesh import RankMesh
from rankmesh.validate import is_int, non_negative_int, positive_int

#: Bytes per element of the dtypes a parameter may have (torch names, without ``torch.``).
ITEMSIZE: Mapping[str, int] = MappingProxyType({
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
})

Interval = tuple[int, int]
Box = tuple[Interval, ...]
Slices = tuple[slice, ...]


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out over a mesh: its full shape and the axes that cut it.

    ``tp_dim``: the dimension tensor parallelism splits (``None``: replicated over tp).
    ``pp_stage``: the pipeline stage that owns it (``None``: every stage, e.g. tied embeddings).
    ``expert``: split over ep along ``ep_dim`` (and over expert tp), instead of replicated.
    ``tp_stride``: megatron's ``partition_stride`` (interleaved QKV or gate/up blocks).
    ``dtype``: torch dtype name, for byte counts.
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    pp_stage: int | None = None
    expert: bool = False
    tp_stride: int = 1
    dtype: str = "float32"
    ep_dim: int = 0

    def __post_init__(self) -> None:
        what = f"ParamLayout {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ReshardError(f"ParamLayout name must be a non-empty string, got {self.name!r}")
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Iterable):
            raise ReshardError(f"{what}: shape must be a tuple of positive integers, got {self.shape!r}")
        shape = tuple(positive_int(n, f"{what}: shape[{i}]", ReshardError) for i, n in enumerate(self.shape))
        object.__setattr__(self, "shape", shape)
        ndim = len(shape)
        if self.tp_dim is not None:
            if not is_int(self.tp_dim) or not -ndim <= self.tp_dim < ndim:
                raise ReshardError(f"{what}: tp_dim {self.tp_dim!r} is not a dimension of shape {shape}")
            object.__setattr__(self, "tp_dim", int(self.tp_dim) % ndim)
        if self.pp_stage is not None:
            object.__setattr__(self, "pp_stage", non_negative_int(self.pp_stage, f"{what}: pp_stage", ReshardError))
        object.__setattr__(self, "tp_stride", positive_int(self.tp_stride, f"{what}: tp_stride", ReshardError))
        if not is_int(self.ep_dim) or not -ndim <= self.ep_dim < ndim:
            raise ReshardError(f"{what}: ep_dim {self.ep_dim!r} is not a dimension of shape {shape}")
        object.__setattr__(self, "ep_dim", int(self.ep_dim) % ndim)
        object.__setattr__(self, "expert", bool(self.expert))
        if self.dtype not in ITEMSIZE:
            raise ReshardError(f"{what}: unknown dtype {self.dtype!r} (known: {', '.join(ITEMSIZE)})")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def replace(self, **changes: Any) -> "ParamLayout":
        return replace(self, **changes)


@dataclass(frozen=True)
class Transfer:
    """One region: ``src_rank``'s shard ``[src_slices]`` goes to ``dst_rank``'s shard ``[dst_slices]``.

    Slices are in each side's local shard coordinates.  ``local``: both ranks are one process
    (a colocated plan), so the region is copied in place and never travels.
    """

    src_rank: int
    dst_rank: int
    name: str
    src_slices: Slices
    dst_slices: Slices
    nbytes: int
    local: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.src_slices)


@dataclass
class ReshardPlan:
    """Every region each destination rank must receive, and where to read it.

    ``params`` / ``dst_params`` are the layouts on each side; ``transfers`` are sorted by
    (src_rank, dst_rank, name).  Byte counts leave out local transfers (they do not travel).
    """

    src: RankMesh
    dst: RankMesh
    params: dict[str, ParamLayout]
    dst_params: dict[str, ParamLayout]
    transfers: list[Transfer]
    colocated: bool = False
    _by_src: dict[int, list[Transfer]] = field(default_factory=dict, repr=False)
    _by_dst: dict[int, list[Transfer]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for t in self.transfers:
            self._by_src.setdefault(t.src_rank, []).append(t)
            self._by_dst.setdefault(t.dst_rank, []).append(t)

    @property
    def bytes_moved(self) -> int:
        """Bytes that travel between processes (local transfers excluded)."""
        return sum(t.nbytes for t in self.transfers if not t.local)

    @property
    def bytes_local(self) -> int:
        """Bytes a colocated destination copies from its own process."""
        return sum(t.nbytes for t in self.transfers if t.local)

    @property
    def bytes_per_src_rank(self) -> dict[int, int]:
        """Bytes each source rank sends (every rank listed, 0 for idle ones)."""
        out = dict.fromkeys(range(self.src.world_size), 0)
        for t in self.transfers:
            if not t.local:
                out[t.src_rank] += t.nbytes
        return out

    @property
    def bytes_per_dst_rank(self) -> dict[int, int]:
        """Bytes each destination rank receives from other processes."""
        out = dict.fromkeys(range(self.dst.world_size), 0)
        for t in self.transfers:
            if not t.local:
                out[t.dst_rank] += t.nbytes
        return out

    def sends(self, src_rank: int) -> list[Transfer]:
        """The transfers ``src_rank`` serves (local ones included), sorted by destination."""
        return list(self._by_src.get(src_rank, ()))

    def receives(self, dst_rank: int) -> list[Transfer]:
        """The transfers that fill ``dst_rank`` (local ones included), sorted by source."""
        return list(self._by_dst.get(dst_rank, ()))

    def describe(self) -> str:
        """A table a person can read: totals, then bytes sent per source and received per destination."""
        sent, got = self.bytes_per_src_rank, self.bytes_per_dst_rank
        unit, scale = _unit(max([*sent.values(), *got.values(), 1]))
        remote = [t for t in self.transfers if not t.local]
        mean = sum(sent.values()) / max(1, len(sent))
        lines = [
            f"reshard {self.src!r} -> {self.dst!r}{' (colocated)' if self.colocated else ''}",
            f"  {len(self.params)} parameters, {sum(p.nbytes for p in self.params.values()) / scale:.2f} {unit} in full; "
            f"{len(remote)} regions travel ({self.bytes_moved / scale:.2f} {unit}), "
            f"{len(self.transfers) - len(remote)} stay local ({self.bytes_local / scale:.2f} {unit}); "
            f"busiest sender {max(sent.values(), default=0) / scale:.2f} {unit}, mean {mean / scale:.2f} {unit}",
            f"  {'rank':>6} {'sends ' + unit:>10} {'receives ' + unit:>13} {'peers out':>10} {'peers in':>9}",
        ]
        peers_out = {r: len({t.dst_rank for t in self.sends(r) if not t.local}) for r in sent}
        peers_in = {r: len({t.src_rank for t in self.receives(r) if not t.local}) for r in got}
        for r in range(max(len(sent), len(got))):
            s = f"{sent[r] / scale:>10.3f}" if r in sent else f"{'-':>10}"
            g = f"{got[r] / scale:>13.3f}" if r in got else f"{'-':>13}"
            lines.append(f"  {r:>6} {s} {g} {peers_out.get(r, '-'):>10} {peers_in.get(r, '-'):>9}")
        return "\n".join(lines)


def _unit(largest: int) -> tuple[str, int]:
    """The binary unit that prints ``largest`` with at most four integer digits."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if largest >= scale:
            return unit, scale
    return "B", 1


# ----- shards -----------------------------------------------------------------------------------


def shard_intervals(layout: ParamLayout, tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0) -> list[list[tuple[int, int, int]]]:
    """Per dimension, the (full start, full stop, local start) intervals a rank with these coordinates keeps.

    Only ``tp_dim`` can have several intervals (one per stride block); the shard is their product.
    """
    dims = [[(0, n, 0)] for n in layout.shape]
    if layout.expert and ep > 1:
        n = layout.shape[layout.ep_dim] // ep
        dims[layout.ep_dim] = [(ep_rank * n, (ep_rank + 1) * n, 0)]
    if layout.tp_dim is not None and tp > 1:
        ((lo, hi, _),) = dims[layout.tp_dim]
        block = (hi - lo) // (tp * layout.tp_stride)
        dims[layout.tp_dim] = [
            (lo + (s * tp + tp_rank) * block, lo + (s * tp + tp_rank + 1) * block, s * block)
            for s in range(layout.tp_stride)
        ]
    return dims


def local_shape(layout: ParamLayout, mesh: RankMesh) -> tuple[int, ...]:
    """The shape of one rank's shard of ``layout`` on ``mesh``."""
    tp, ep = _tp_ep_sizes(layout, mesh)
    return tuple(sum(hi - lo for lo, hi, _ in d) for d in shard_intervals(layout, tp, 0, ep, 0))


def _tp_ep_sizes(layout: ParamLayout, mesh: RankMesh) -> tuple[int, int]:
    if layout.expert:
        return mesh.size("etp"), mesh.size("ep")
    return mesh.size("tp"), 1


def _check_fits(layout: ParamLayout, mesh: RankMesh, side: str) -> None:
    """Raise unless ``mesh`` can cut ``layout`` into equal shards."""
    tp, ep = _tp_ep_sizes(layout, mesh)
    where = f"parameter {layout.name!r} {layout.shape} on the {side} mesh {mesh!r}"
    extent = list(layout.shape)
    if layout.expert and extent[layout.ep_dim] % ep:
        raise ReshardError(f"{where}: dim {layout.ep_dim} ({extent[layout.ep_dim]}) does not split into ep={ep} expert chunks")
    if layout.expert:
        extent[layout.ep_dim] //= ep
    if layout.tp_dim is not None and extent[layout.tp_dim] % (tp * layout.tp_stride):
        raise ReshardError(
            f"{where}: dim {layout.tp_dim} ({extent[layout.tp_dim]}) does not split into "
            f"{'etp' if layout.expert else 'tp'}={tp} x tp_stride={layout.tp_stride} blocks"
        )
    pp = mesh.size("pp")
    if layout.pp_stage is not None and layout.pp_stage >= pp:
        raise ReshardError(f"{where}: pp_stage {layout.pp_stage} does not exist (pp={pp})")


def _holder_sets(layout: ParamLayout, mesh: RankMesh) -> dict[tuple[int, int, int], list[int]]:
    """Shard key (tp, ep, pp; pp=-1 when every stage holds it) -> ranks holding that shard, ascending."""
    table = mesh.coord_table()
    pp = table["pp"]
    # Coordinates that do not cut this parameter do not tell its holders apart.
    tp = (table["etp"] if layout.expert else table["tp"]) if layout.tp_dim is not None else np.zeros_like(pp)
    ep = table["ep"] if layout.expert else np.zeros_like(pp)
    holds = np.ones(len(tp), dtype=bool) if layout.pp_stage is None else pp == layout.pp_stage
    stage = pp if layout.pp_stage is not None else np.full_like(pp, -1)
    out: dict[tuple[int, int, int], list[int]] = {}
    for rank in np.nonzero(holds)[0].tolist():
        out.setdefault((int(tp[rank]), int(ep[rank]), int(stage[rank])), []).append(rank)
    return out


def _overlaps(src_dims, dst_dims) -> list[tuple[Box, Box]]:
    """(src local box, dst local box) of every non-empty intersection of two shards."""
    per_dim: list[list[tuple[Interval, Interval]]] = []
    for s_list, d_list in zip(src_dims, dst_dims):
        hits = []
        for (s_lo, s_hi, s_loc), (d_lo, d_hi, d_loc) in itertools.product(s_list, d_list):
            lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
            if lo < hi:
                hits.append(((lo - s_lo + s_loc, hi - s_lo + s_loc), (lo - d_lo + d_loc, hi - d_lo + d_loc)))
        if not hits:
            return []
        per_dim.append(hits)
    return [(tuple(h[0] for h in combo), tuple(h[1] for h in combo)) for combo in itertools.product(*per_dim)]


# ----- balancing --------------------------------------------------------------------------------


def linear_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of a C-ordered array of ``shape``, in order (at most 2·ndim-1)."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start, stop),)]
    inner = math.prod(shape[1:])
    full_rest = tuple((0, n) for n in shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:
        return [((r0, r0 + 1),) + b for b in linear_boxes(shape[1:], o0, o1)]
    out: list[Box] = []
    if o0:
        out += [((r0, r0 + 1),) + b for b in linear_boxes(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1),) + full_rest)
    if o1:
        out += [((r1, r1 + 1),) + b for b in linear_boxes(shape[1:], 0, o1)]
    return out


class _Region:
    """A destination region that one of its holders must send (before the holder is chosen)."""

    __slots__ = ("dst_rank", "name", "src_box", "dst_box", "itemsize", "shape", "nbytes")

    def __init__(self, dst_rank: int, name: str, src_box: Box, dst_box: Box, itemsize: int) -> None:
        self.dst_rank, self.name, self.src_box, self.dst_box, self.itemsize = dst_rank, name, src_box, dst_box, itemsize
        self.shape = tuple(hi - lo for lo, hi in src_box)
        self.nbytes = math.prod(self.shape) * itemsize

    def part(self, start: int, stop: int) -> list[tuple[Box, Box, int]]:
        """Elements ``[start, stop)`` of the region as (src box, dst box, bytes) pieces."""
        if start == 0 and stop * self.itemsize == self.nbytes:
            return [(self.src_box, self.dst_box, self.nbytes)]
        out = []
        for b in linear_boxes(self.shape, start, stop):
            src = tuple((s[0] + lo, s[0] + hi) for s, (lo, hi) in zip(self.src_box, b))
            dst = tuple((d[0] + lo, d[0] + hi) for d, (lo, hi) in zip(self.dst_box, b))
            out.append((src, dst, math.prod([hi - lo for lo, hi in b]) * self.itemsize))
        return out


def _spread(holders: list[int], regions: list[_Region]) -> list[tuple[int, _Region, Box, Box, int]]:
    """Cut the holders' work into ``len(holders)`` equal runs; holder ``j`` sends run ``j``.

    Regions that read the same source box (the same bytes, wanted by several destinations, e.g.
    the dp replicas of the destination) form one *content*, so that a content's bytes are mostly
    read from one holder and can be put into the object store once for all its readers.  The work
    is the sequence of (element, reader) units of every content, element-major; it is cut into
    equal runs on unit boundaries, so a holder sends at most its share plus one element.  A
    content crossing a run boundary is split into boxes (:func:`linear_boxes`); only the element
    at the cut may be served to some of its readers by one holder and to the rest by the next.
    """
    k = len(holders)
    contents: dict[tuple[str, Box], list[_Region]] = {}
    for region in regions:
        contents.setdefault((region.name, region.src_box), []).append(region)
    total = sum(r.nbytes for r in regions)
    cuts = [total * j // k for j in range(1, k)]
    out = []
    offset = 0  # bytes of work before this content
    for readers in contents.values():
        item, n, m = readers[0].itemsize, readers[0].nbytes // readers[0].itemsize, len(readers)
        units = n * m
        # unit of this content where each cut falls (the first unit starting at or after it)
        bounds = [0] + [min(units, max(0, -(-(c - offset) // item))) for c in cuts] + [units]
        for j in range(k):
            u0, u1 = bounds[j], bounds[j + 1]
            if u0 >= u1:
                continue
            (e0, r0), (e1, r1) = divmod(u0, m), divmod(u1, m)
            runs: list[tuple[int, int, range]] = []  # (first element, stop element, readers)
            if e0 == e1:
                runs.append((e0, e0 + 1, range(r0, r1)))
            else:
                if r0:
                    runs.append((e0, e0 + 1, range(r0, m)))
                    e0 += 1
                if e1 > e0:
                    runs.append((e0, e1, range(m)))
                if r1:
                    runs.append((e1, e1 + 1, range(r1)))
            for start, stop, who in runs:
                for i in who:
                    for src, dst, nbytes in readers[i].part(start, stop):
                        out.append((holders[j], readers[i], src, dst, nbytes))
        offset += units * item
    return out


# ----- the plan ---------------------------------------------------------------------------------


def _as_layouts(params: Iterable[ParamLayout] | Mapping[str, ParamLayout], what: str) -> dict[str, ParamLayout]:
    items = params.values() if isinstance(params, Mapping) else params
    out: dict[str, ParamLayout] = {}
    for p in items:
        if not isinstance(p, ParamLayout):
            raise ReshardError(f"{what} must hold ParamLayout values, got {type(p).__name__}: {p!r}")
        if p.name in out:
            raise ReshardError(f"{what}: parameter {p.name!r} is listed twice")
        out[p.name] = p
    return out


def _destination_layouts(params: dict[str, ParamLayout], src: RankMesh, dst: RankMesh, overrides) -> dict[str, ParamLayout]:
    """Each parameter's layout on the destination: the override, or the source's with the stage mapped."""
    given = _as_layouts(overrides or {}, "dst_layouts")
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise ReshardError(f"dst_layouts names parameters the source does not have: {unknown[:5]}")
    out = {}
    for name, p in params.items():
        if name in given:
            d = given[name]
            if d.shape != p.shape or d.dtype != p.dtype:
                raise ReshardError(
                    f"parameter {name!r}: the destination layout has shape {d.shape} {d.dtype}, "
                    f"the source {p.shape} {p.dtype}; resharding never reshapes or casts"
                )
        elif p.pp_stage is None or dst.size("pp") == src.size("pp"):
            d = p
        elif dst.size("pp") == 1:
            d = p.replace(pp_stage=None)
        else:
            raise ReshardError(
                f"parameter {name!r} lives on stage {p.pp_stage} of the source's pp={src.size('pp')}, and the "
                f"destination has pp={dst.size('pp')}: say which destination stage owns it, e.g. "
                f"dst_layouts=[ParamLayout({name!r}, {p.shape}, pp_stage=0, ...)]"
            )
        out[name] = d
    return out


def plan_reshard(
    params: Iterable[ParamLayout] | Mapping[str, ParamLayout],
    src: RankMesh,
    dst: RankMesh,
    dst_layouts: Iterable[ParamLayout] | Mapping[str, ParamLayout] | None = None,
    colocated: bool = False,
) -> ReshardPlan:
    """Plan moving every parameter from its shards on ``src`` to its shards on ``dst``.

    Every destination region is covered exactly once and nothing is sent that a destination does
    not keep.  ``dst_layouts`` gives a parameter another tp_dim or stage on the destination (by
    default the source's; a pipelined source's stages collapse when ``dst`` has pp=1).
    ``colocated=True``: destination rank ``i`` lives in source rank ``i``'s process, so it copies
    what that process holds and only the rest travels.
    """
    if not isinstance(src, RankMesh) or not isinstance(dst, RankMesh):
        raise ReshardError(f"src and dst must be RankMesh objects, got {type(src).__name__} and {type(dst).__name__}")
    if colocated and src.world_size != dst.world_size:
        raise ReshardError(
            f"colocated=True needs both meshes over the same processes, but {src!r} has {src.world_size} ranks "
            f"and {dst!r} has {dst.world_size}"
        )
    layouts = _as_layouts(params, "params")
    dst_map = _destination_layouts(layouts, src, dst, dst_layouts)
    rows: list[tuple[int, int, str, Box, Box, int, bool]] = []  # (src, dst, name, src box, dst box, bytes, local)
    pending: dict[tuple[int, ...], list[_Region]] = defaultdict(list)
    for name, p in layouts.items():
        d = dst_map[name]
        _check_fits(p, src, "source")
        _check_fits(d, dst, "destination")
        s_tp, s_ep = _tp_ep_sizes(p, src)
        d_tp, d_ep = _tp_ep_sizes(d, dst)
        src_sets = _holder_sets(p, src)
        for d_key, d_ranks in _holder_sets(d, dst).items():
            d_dims = shard_intervals(d, d_tp, d_key[0], d_ep, d_key[1])
            for s_key, holders in src_sets.items():
                pieces = _overlaps(shard_intervals(p, s_tp, s_key[0], s_ep, s_key[1]), d_dims)
                for rank in d_ranks:
                    at_home = colocated and rank in holders
                    for s_box, d_box in pieces:
                        if at_home:
                            nbytes = math.prod([hi - lo for lo, hi in s_box]) * p.itemsize
                            rows.append((rank, rank, name, s_box, d_box, nbytes, True))
                        else:
                            pending[tuple(holders)].append(_Region(rank, name, s_box, d_box, p.itemsize))
    for holders, regions in pending.items():
        regions.sort(key=lambda r: (r.name, r.src_box, r.dst_rank, r.dst_box))
        for sender, region, s_box, d_box, nbytes in _spread(list(holders), regions):
            rows.append((sender, region.dst_rank, region.name, s_box, d_box, nbytes, False))
    rows.sort(key=lambda row: (row[0], row[1], row[2], row[4]))
    slices: dict[Box, Slices] = {}  # boxes repeat across ranks: build each tuple of slices once

    def as_slices(box: Box) -> Slices:
        out = slices.get(box)
        if out is None:
            out = slices[box] = tuple(slice(lo, hi) for lo, hi in box)
        return out

    transfers = [Transfer(s, d, name, as_slices(sb), as_slices(db), nb, loc) for s, d, name, sb, db, nb, loc in rows]
    return ReshardPlan(src, dst, layouts, dst_map, transfers, colocated)


def merge_layouts(per_rank: Iterable[Iterable[ParamLayout]], pp: int = 1) -> list[ParamLayout]:
    """One layout per parameter from every rank's own report (each rank gives its stage as ``pp_stage``).

    A parameter reported by every one of the ``pp`` stages becomes ``pp_stage=None``; ranks that
    disagree about a parameter's shape, tp_dim, stride or dtype are an error.
    """
    pp = positive_int(pp, "pp", ReshardError)
    seen: dict[str, ParamLayout] = {}
    stages: dict[str, set[int | None]] = defaultdict(set)
    for rank, layouts in enumerate(per_rank):
        for p in layouts or ():
            first = seen.setdefault(p.name, p)
            if first.replace(pp_stage=None) != p.replace(pp_stage=None):
                raise ReshardError(f"parameter {p.name!r}: rank {rank} reports {p}, an earlier rank {first}")
            stages[p.name].add(p.pp_stage)
    out = []
    for name, p in seen.items():
        held = stages[name]
        if None in held or held == set(range(pp)):
            out.append(p.replace(pp_stage=None))
        elif len(held) == 1:
            out.append(p)
        else:
            raise ReshardError(
                f"parameter {name!r} is held by stages {sorted(held)} of pp={pp}: a layout names one stage or all of them; "
                "give the copies different names (e.g. the tied output embedding)"
            )
    return out
