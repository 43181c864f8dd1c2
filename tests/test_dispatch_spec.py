"""Property tests of specs and plans, and of padded round trips, over random meshes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.data import AUTO_PADDING_KEY
from rankmesh.dispatch import MeshSpec
from rankmesh.mesh import RankMesh
from tests.dispatch_workers import RecordingWorker, make_batch, rows_of

ORDERS = ["tp-cp-ep-dp-pp", "tp-pp-dp", "tp-dp-pp", "dp-tp-cp-pp", "pp-dp-cp-tp"]


@st.composite
def meshes(draw):
    tp, cp, dp, pp = (draw(st.integers(1, 3)) for _ in range(4))
    order = draw(st.sampled_from(ORDERS))
    if cp > 1 and "cp" not in order:
        order = "tp-cp-ep-dp-pp"
    return RankMesh(tp=tp, cp=cp, dp=dp, pp=pp, order=order)


@st.composite
def specs(draw, mesh):
    axes = draw(st.lists(st.sampled_from(["tp", "cp", "dp", "pp"]), unique=True, max_size=3))
    coll_axes = draw(st.lists(st.sampled_from(["tp", "cp", "dp", "pp"]), unique=True, max_size=4))
    collect = {a: draw(st.integers(-mesh.size(a), mesh.size(a) - 1)) for a in coll_axes}
    return MeshSpec(split=tuple(axes), collect=collect)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_plan_matches_a_rank_by_rank_reading_of_the_spec(data):
    mesh = data.draw(meshes())
    spec = data.draw(specs(mesh))
    plan = spec.plan(mesh)
    sizes = {a: mesh.size(a) for a in ("tp", "cp", "dp", "pp")}
    pieces, kept = [], []
    for rank in range(mesh.world_size):
        info = mesh.coords(rank)
        c = {"tp": info.tp_rank, "cp": info.cp_rank, "dp": info.dp_rank, "pp": info.pp_rank}
        piece = 0
        for axis in spec.split:
            piece = piece * sizes[axis] + c[axis]
        pieces.append(piece)
        if all(c[a] == v % sizes[a] for a, v in spec.collect_map.items()):
            kept.append((piece, rank))
    assert plan.piece_of_rank == tuple(pieces)
    assert plan.collect_ranks == tuple(r for _, r in sorted(kept))
    n = 1
    for axis in spec.split:
        n *= sizes[axis]
    assert plan.n_pieces == n and sorted(set(pieces)) == list(range(n))
    # every piece is replicated over the same number of ranks
    assert len({pieces.count(p) for p in range(n)}) == 1


@settings(max_examples=40, deadline=None)
@given(tp=st.integers(1, 2), dp=st.integers(1, 3), pp=st.integers(1, 2), rows=st.integers(0, 13), blocking=st.booleans())
def test_padded_round_trip(tp, dp, pp, rows, blocking):
    wg = LocalWorkerGroup(RecordingWorker, RankMesh(tp=tp, dp=dp, pp=pp))
    batch = make_batch(rows, **{AUTO_PADDING_KEY: True})
    for method in ("dp_compute_proto", "megatron_compute_proto", "megatron_pp_as_dp_proto"):
        out = getattr(wg, method + ("" if blocking else "_nb"))(batch)
        out = out if blocking else out.get()
        assert rows_of(out) == list(range(rows)) and len(batch) == rows


def test_builtin_modes_on_every_small_mesh():
    from rankmesh.dispatch import DEFAULT_REGISTRY, Dispatch

    for tp, cp, dp, pp in itertools.product((1, 2), repeat=4):
        mesh = RankMesh(tp=tp, cp=cp, dp=dp, pp=pp)
        for mode in Dispatch:
            entry = DEFAULT_REGISTRY.resolve(mode)
            if isinstance(entry, MeshSpec):
                entry.plan(mesh)  # every built-in spec is valid on every mesh
