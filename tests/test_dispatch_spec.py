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


def _expected_builtin_plans(tp: int, cp: int, dp: int, pp: int) -> dict[str, tuple]:
    """Each built-in mode's plan on RankMesh(tp, cp, dp, pp), from megatron's default order by hand.

    In the order tp-cp-ep-dp-pp (ep = 1) tp varies fastest: rank = t + tp*(c + cp*(d + dp*p)).
    A plan is (n_pieces, piece_of_rank, collect_ranks, run_ranks).
    """
    world = tp * cp * dp * pp
    rank = {(t, c, d, p): t + tp * (c + cp * (d + dp * p))
            for t, c, d, p in itertools.product(range(tp), range(cp), range(dp), range(pp))}
    coords = {r: k for k, r in rank.items()}
    every = tuple(range(world))
    per_rank = (world, every, every, every)  # split over "rank": rank r gets piece r, all come back
    # Megatron's collect: tp 0, cp 0, the last pipeline stage; one rank per dp piece, in dp order.
    megatron = (dp, tuple(coords[r][2] for r in every), tuple(rank[0, 0, d, pp - 1] for d in range(dp)), every)
    # pp as dp: the piece counts cp, then dp, then pp (pp fastest); tp 0 of every piece comes back.
    pp_as_dp_piece = {r: (coords[r][1] * dp + coords[r][2]) * pp + coords[r][3] for r in every}
    pp_as_dp = (cp * dp * pp, tuple(pp_as_dp_piece[r] for r in every),
                tuple(sorted((r for r in every if coords[r][0] == 0), key=pp_as_dp_piece.get)), every)
    return {
        "ONE_TO_ALL": (1, (0,) * world, every, every),
        "ALL_TO_ALL": per_rank,
        "RANK_ZERO": (1, (0,) * world, (0,), (0,)),
        "DP_COMPUTE": per_rank,
        "DP_COMPUTE_PROTO": per_rank,
        "DP_COMPUTE_PROTO_WITH_FUNC": per_rank,
        "DP_COMPUTE_METRIC": per_rank,
        "MEGATRON_COMPUTE": megatron,
        "MEGATRON_COMPUTE_PROTO": megatron,
        "MEGATRON_PP_AS_DP": pp_as_dp,
        "MEGATRON_PP_AS_DP_PROTO": pp_as_dp,
        # No split; tp, dp and cp 0 of every pipeline stage come back, in stage order.
        "MEGATRON_PP_ONLY": (1, (0,) * world, tuple(rank[0, 0, 0, p] for p in range(pp)), every),
    }


def test_builtin_modes_on_every_small_mesh():
    from rankmesh.dispatch import DEFAULT_REGISTRY, Dispatch

    for tp, cp, dp, pp in itertools.product((1, 2), repeat=4):
        mesh = RankMesh(tp=tp, cp=cp, dp=dp, pp=pp)
        expected = _expected_builtin_plans(tp, cp, dp, pp)
        for name, want in expected.items():
            plan = DEFAULT_REGISTRY.resolve(name).plan(mesh)
            got = (plan.n_pieces, plan.piece_of_rank, plan.collect_ranks, plan.run_ranks)
            assert got == want, (name, mesh)
        for mode in Dispatch:
            entry = DEFAULT_REGISTRY.resolve(mode)
            if isinstance(entry, MeshSpec):
                entry.plan(mesh)  # every spec registered (built-in or added since) is valid on every mesh
