"""The reshard planner against an independent computation, on random meshes and layouts.

The oracle never uses the planner's box arithmetic: it cuts full numpy tensors the way megatron-core
does (``np.split`` into tp*stride blocks, keep ``blocks[rank::tp]``, as ``_initialize_affine_weight_cpu``
does; experts first cut into ep chunks), finds which ranks hold what from ``RankMesh.coords``, then
applies the plan's transfers region by region and compares every destination shard with the
oracle's cut.  The minimum byte count comes from element ids, not from the plan.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from rankmesh.mesh import RankMesh
from rankmesh.reshard import ParamLayout, ReshardError, merge_layouts, plan_reshard
from rankmesh.reshard.plan import linear_boxes

ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "tp-dp-pp", "dp-tp-pp", "pp-tp-dp", "tp-cp-dp-pp")


# ----- the oracle -----------------------------------------------------------------------------


def megatron_cut(full: np.ndarray, layout: ParamLayout, tp: int, tp_rank: int, ep: int, ep_rank: int) -> np.ndarray:
    """A rank's shard, cut as megatron-core cuts it."""
    x = full
    if layout.expert:
        x = np.split(x, ep, axis=layout.ep_dim)[ep_rank]
    if layout.tp_dim is not None:
        blocks = np.split(x, tp * layout.tp_stride, axis=layout.tp_dim)
        x = np.concatenate(blocks[tp_rank :: tp], axis=layout.tp_dim)
    return x


def holds(layout: ParamLayout, mesh: RankMesh, rank: int) -> bool:
    return layout.pp_stage is None or mesh.coords(rank).pp_rank == layout.pp_stage


def shard_of(full: np.ndarray, layout: ParamLayout, mesh: RankMesh, rank: int) -> np.ndarray:
    c = mesh.coords(rank)
    if layout.expert:
        return megatron_cut(full, layout, mesh.size("etp"), c.etp_rank, mesh.size("ep"), c.ep_rank)
    return megatron_cut(full, layout, mesh.size("tp"), c.tp_rank, 1, 0)


def check_plan(params, src, dst, dst_layouts=None, colocated=False, balance=True):
    plan = plan_reshard(params, src, dst, dst_layouts=dst_layouts, colocated=colocated)
    fulls = {p.name: np.arange(int(np.prod(p.shape)), dtype=np.int64).reshape(p.shape) for p in params}
    dst_map = plan.dst_params
    src_shards = {(r, p.name): shard_of(fulls[p.name], p, src, r) for p in params for r in range(src.world_size) if holds(p, src, r)}
    want = {(r, p.name): shard_of(fulls[p.name], dst_map[p.name], dst, r)
            for p in params for r in range(dst.world_size) if holds(dst_map[p.name], dst, r)}
    got = {k: np.full_like(v, -1) for k, v in want.items()}
    writes = {k: np.zeros(v.shape, dtype=np.int64) for k, v in want.items()}
    itemsize = {p.name: p.itemsize for p in params}
    for t in plan.transfers:
        region = src_shards[(t.src_rank, t.name)][t.src_slices]  # KeyError: read from a rank that lacks it
        got[(t.dst_rank, t.name)][t.dst_slices] = region
        writes[(t.dst_rank, t.name)][t.dst_slices] += 1
        assert t.nbytes == region.size * itemsize[t.name]
        assert t.local == (colocated and t.src_rank == t.dst_rank)
    for key in want:
        assert (writes[key] == 1).all(), f"{key}: regions covered {np.unique(writes[key])} times"
        np.testing.assert_array_equal(got[key], want[key], err_msg=str(key))
    # The minimum: bytes destinations keep, less (colocated) what their own process already holds.
    minimum = 0
    for (rank, name), ids in want.items():
        kept = ids.size
        if colocated and (rank, name) in src_shards:
            kept -= np.isin(ids, src_shards[(rank, name)]).sum()
        minimum += int(kept) * itemsize[name]
    assert plan.bytes_moved == minimum
    assert sum(plan.bytes_per_src_rank.values()) == sum(plan.bytes_per_dst_rank.values()) == minimum
    if balance:
        check_balance(plan, params, src)
    check_read_once(plan, params, src, src_shards)
    return plan


def check_balance(plan, params, src):
    """Among ranks holding the same shard, the busiest sends <= mean + one element (and <= 1.25x mean when large)."""
    layouts = {p.name: p for p in params}
    sent: dict[tuple, dict[int, int]] = {}
    for t in plan.transfers:
        if t.local:
            continue
        p = layouts[t.name]
        key = _key(p, src, t.src_rank)
        holders = tuple(r for r in range(src.world_size) if holds(p, src, r) and _key(p, src, r) == key)
        sent.setdefault(holders, dict.fromkeys(holders, 0))[t.src_rank] += t.nbytes
    for holders, load in sent.items():
        mean = sum(load.values()) / len(holders)
        assert max(load.values()) <= mean + 8, (holders, load)
        if mean >= 4 * 8 * len(holders):
            assert max(load.values()) <= 1.25 * mean, (holders, load)


def _key(p, mesh, r):
    c = mesh.coords(r)
    tp = (c.etp_rank if p.expert else c.tp_rank) if p.tp_dim is not None else 0
    key = (tp, c.ep_rank if p.expert else 0)
    return key + (c.pp_rank if p.pp_stage is not None else None,)


def check_read_once(plan, params, src, src_shards):
    """Destinations that keep the same bytes read them from the same holder, so the bytes are put once.

    Per holder set, the element ids its ranks send, counted once per rank, exceed the distinct ids
    sent by at most one element per cut between holders (an element at a cut may be served to some
    readers by one holder and to the others by the next).
    """
    layouts = {p.name: p for p in params}
    per_rank: dict[tuple, dict[int, set]] = {}
    for t in plan.transfers:
        if t.local:
            continue
        p = layouts[t.name]
        key = _key(p, src, t.src_rank)
        holders = tuple(r for r in range(src.world_size) if holds(p, src, r) and _key(p, src, r) == key)
        ids = src_shards[(t.src_rank, t.name)][t.src_slices].ravel().tolist()
        per_rank.setdefault(holders, {}).setdefault(t.src_rank, set()).update((t.name, i) for i in ids)
    for holders, by_rank in per_rank.items():
        repeats = sum(len(s) for s in by_rank.values()) - len(set().union(*by_rank.values()))
        assert repeats <= len(holders) - 1, (holders, repeats)


# ----- random cases -----------------------------------------------------------------------------


def random_mesh(rng: random.Random, world: int | None = None) -> RankMesh:
    while True:
        tp, pp, cp = rng.choice([1, 1, 2, 4]), rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2])
        dp = rng.choice([1, 2, 3]) if world is None else world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
        if not dp or tp * pp * cp * dp > 24:
            continue
        ep = rng.choice([1, 2]) if (tp * cp * dp) % 2 == 0 else 1
        etp = rng.choice([1, tp]) if ep > 1 else tp
        order = rng.choice(ORDERS)
        try:
            mesh = RankMesh(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp, order=order)
            mesh.check_megatron()
        except Exception:  # noqa: BLE001 - an order that leaves out an axis of size > 1, etc.
            continue
        return mesh


def random_params(rng: random.Random, src: RankMesh, dst: RankMesh, n: int = 5):
    params, dst_layouts = [], []
    for i in range(n):
        ndim = rng.choice([1, 2, 2, 3])
        expert = rng.random() < 0.3
        tp_dim = rng.choice([None] + list(range(ndim)))
        stride = rng.choice([1, 1, 2, 3]) if tp_dim is not None else 1
        ep_dim = rng.randrange(ndim)
        shape = [rng.choice([1, 2, 3]) for _ in range(ndim)]
        if expert:
            shape[ep_dim] *= math.lcm(src.size("ep"), dst.size("ep"))
        if tp_dim is not None:
            tp_l = math.lcm(src.size("etp" if expert else "tp"), dst.size("etp" if expert else "tp"))
            shape[tp_dim] *= tp_l * stride * (math.lcm(src.size("ep"), dst.size("ep")) if expert and ep_dim == tp_dim else 1)
        stage = rng.choice([None] + list(range(src.size("pp"))))
        p = ParamLayout(f"p{i}", tuple(shape), tp_dim=tp_dim, pp_stage=stage, expert=expert, tp_stride=stride,
                        dtype=rng.choice(["float32", "bfloat16"]), ep_dim=ep_dim)
        params.append(p)
        if stage is not None and dst.size("pp") not in (1, src.size("pp")):
            dst_layouts.append(p.replace(pp_stage=rng.randrange(dst.size("pp"))))
    return params, dst_layouts


@pytest.mark.parametrize("seed", range(60))
def test_random_meshes_against_megatron_cut(seed: int) -> None:
    rng = random.Random(seed)
    src = random_mesh(rng)
    colocated = rng.random() < 0.3
    dst = random_mesh(rng, world=src.world_size if colocated else None)
    params, dst_layouts = random_params(rng, src, dst)
    check_plan(params, src, dst, dst_layouts, colocated=colocated)


def test_hypothesis_meshes() -> None:
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
    @hypothesis.given(st.integers(0, 2**32 - 1))
    def run(seed: int) -> None:
        rng = random.Random(seed)
        src, dst = random_mesh(rng), random_mesh(rng)
        params, dst_layouts = random_params(rng, src, dst, n=3)
        check_plan(params, src, dst, dst_layouts)

    run()


# ----- the cases of the issue, with exact numbers -------------------------------------------------


def gpt_layouts(layers: int = 2, hidden: int = 64, ffn: int = 256, vocab: int = 128, pp: int = 2):
    out = [ParamLayout("embed", (vocab, hidden), tp_dim=0, pp_stage=0),
           ParamLayout("head", (vocab, hidden), tp_dim=0, pp_stage=pp - 1)]
    for i in range(layers):
        stage = i * pp // layers
        out += [
            ParamLayout(f"l{i}.qkv", (3 * hidden, hidden), tp_dim=0, tp_stride=3, pp_stage=stage),
            ParamLayout(f"l{i}.proj", (hidden, hidden), tp_dim=1, pp_stage=stage),
            ParamLayout(f"l{i}.fc1", (ffn, hidden), tp_dim=0, pp_stage=stage),
            ParamLayout(f"l{i}.fc2", (hidden, ffn), tp_dim=1, pp_stage=stage),
            ParamLayout(f"l{i}.ln", (hidden,), pp_stage=stage),
        ]
    return out


@pytest.mark.parametrize("dst", [RankMesh(dp=8), RankMesh(tp=4, dp=2), RankMesh(tp=2, dp=4, order="tp-dp-pp")])
def test_trainer_to_generator(dst: RankMesh) -> None:
    params = gpt_layouts()
    plan = check_plan(params, RankMesh(tp=2, pp=2, dp=2), dst)
    # Non-colocated: each dp replica keeps the whole model, replicated tensors on each of its tp ranks.
    split = sum(p.nbytes for p in params if p.tp_dim is not None)
    replicated = sum(p.nbytes for p in params if p.tp_dim is None)
    assert plan.bytes_moved == (split + replicated * dst.size("tp")) * dst.size("dp")
    sent = plan.bytes_per_src_rank
    assert max(sent.values()) <= 1.25 * (sum(sent.values()) / len(sent))


def test_colocated_moves_only_what_is_missing() -> None:
    params = gpt_layouts(pp=1)
    same = plan_reshard(params, RankMesh(tp=2, dp=4), RankMesh(tp=2, dp=4), colocated=True)
    assert same.bytes_moved == 0 and all(t.local for t in same.transfers)
    plan = check_plan(params, RankMesh(tp=2, dp=4), RankMesh(tp=1, dp=8), colocated=True)
    # each tp1 rank already holds half of every tp-split tensor, and all of the replicated ones
    split = sum(p.nbytes for p in params if p.tp_dim is not None)
    assert plan.bytes_moved == 8 * split // 2
    assert plan.bytes_local == sum(p.nbytes for p in params) * 8 - plan.bytes_moved


def test_identity_is_one_region_per_shard() -> None:
    params = gpt_layouts()
    plan = check_plan(params, RankMesh(tp=2, pp=2), RankMesh(tp=2, pp=2))
    split = [t for t in plan.transfers if not t.name.endswith(".ln")]
    # a tp-split shard has one holder: it is sent whole, from the rank with the same coordinates
    assert all(t.src_rank == t.dst_rank for t in split)
    assert len(split) == (len(params) - 2) * 2 + 2 * 2 * 2  # qkv: 3 stride blocks (2 layers x 2 ranks x 2 more)
    # a replicated ln (64 floats) has two holders (the tp ranks of its stage); both destinations
    # read the same bytes, so each holder serves one half to both: every byte is read from one rank
    for i, stage_ranks in enumerate([(0, 1), (2, 3)]):
        ln = sorted((t.src_rank, t.dst_rank, t.src_slices[0].start, t.src_slices[0].stop)
                    for t in plan.transfers if t.name == f"l{i}.ln")
        a, b = stage_ranks
        assert ln == [(a, a, 0, 32), (a, b, 0, 32), (b, a, 32, 64), (b, b, 32, 64)]


def test_describe_is_a_table() -> None:
    plan = plan_reshard(gpt_layouts(), RankMesh(tp=2, pp=2, dp=2), RankMesh(dp=8))
    text = plan.describe()
    assert "RankMesh(tp=2" in text and "sends" in text and "receives" in text
    assert len(text.splitlines()) == 3 + 8


def test_linear_boxes_cover_ranges() -> None:
    rng = random.Random(0)
    for _ in range(200):
        shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
        n = int(np.prod(shape))
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        mark = np.zeros(shape, dtype=int)
        for box in linear_boxes(shape, a, b):
            mark[tuple(slice(lo, hi) for lo, hi in box)] += 1
        flat = mark.reshape(-1)
        assert (flat[a:b] == 1).all() and flat[:a].sum() == 0 and flat[b:].sum() == 0
        assert len(linear_boxes(shape, a, b)) <= 2 * len(shape) - 1


# ----- errors that teach ------------------------------------------------------------------------------


def test_errors_name_the_parameter_and_the_fix() -> None:
    with pytest.raises(ReshardError, match=r"'w'.*does not split into tp=4"):
        plan_reshard([ParamLayout("w", (6, 2), tp_dim=0)], RankMesh(tp=2), RankMesh(tp=4))
    with pytest.raises(ReshardError, match=r"dst_layouts=\[ParamLayout\('w'"):
        plan_reshard([ParamLayout("w", (4,), pp_stage=1)], RankMesh(pp=2), RankMesh(pp=4))
    with pytest.raises(ReshardError, match="same processes"):
        plan_reshard([ParamLayout("w", (4,))], RankMesh(dp=2), RankMesh(dp=4), colocated=True)
    with pytest.raises(ReshardError, match="reshapes"):
        plan_reshard([ParamLayout("w", (4,))], RankMesh(), RankMesh(), dst_layouts=[ParamLayout("w", (2, 2))])
    with pytest.raises(ReshardError, match="unknown dtype"):
        ParamLayout("w", (4,), dtype="float128")


def test_merge_layouts() -> None:
    a = ParamLayout("a", (4,), pp_stage=0)
    b0, b1 = ParamLayout("b", (2,), pp_stage=0), ParamLayout("b", (2,), pp_stage=1)
    c = ParamLayout("c", (8, 2), tp_dim=0, pp_stage=1)
    merged = {p.name: p for p in merge_layouts([[a, b0], [b1, c]], pp=2)}
    assert merged["a"].pp_stage == 0 and merged["b"].pp_stage is None and merged["c"].pp_stage == 1
    assert {p.pp_stage for p in merge_layouts([[a.replace(pp_stage=0)]], pp=1)} == {None}
    with pytest.raises(ReshardError, match="rank 1 reports"):
        merge_layouts([[c], [c.replace(tp_dim=1)]], pp=2)
    with pytest.raises(ReshardError, match="stages \\[0, 1\\] of pp=3"):
        merge_layouts([[b0], [b1]], pp=3)
