"""Resharding on Ray: 4 + 4 CPU ranks (no megatron-core), checked against megatron's own cut.

One pool of 4 processes hosts two colocated roles: ``train`` over the group's mesh (tp2·dp2) and
``gen`` over a named mesh (tp1·dp4, the generator's layout); a second pool of 4 hosts a tp2·pp2
group.  Each test moves weights between two of them with :func:`rankmesh.reshard.reshard` and
compares every destination shard with the oracle of tests/reshard_workers.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rankmesh.mesh import RankMesh
from rankmesh.megatron.layouts import global_parameter_names, layouts_from_module
from rankmesh.reshard.run import TRANSPORTS, plan_between, reshard
from rankmesh.reshard.worker import PIECE_BYTES, row_blocks
from rankmesh.reshard import ParamLayout, ReshardError, plan_reshard
from rankmesh.reshard.run import ReshardSession

pytest.importorskip("ray")

from tests.reshard_workers import ShardHolder, full_tensor, holds, megatron_cut  # noqa: E402

TRAIN, GEN, PIPE = RankMesh(tp=2, dp=2), RankMesh(dp=4), RankMesh(tp=2, pp=2)
LAYOUTS = [
    ParamLayout("embed", (64, 32), tp_dim=0),
    ParamLayout("qkv", (96, 32), tp_dim=0, tp_stride=3),
    ParamLayout("proj", (32, 32), tp_dim=1),
    ParamLayout("ln", (32,)),
    # replicated, 1.3 MiB: travels as several pieces of at most PIECE_BYTES (whole rows each)
    ParamLayout("big", (520, 640)),
]
PIPE_LAYOUTS = [p.replace(pp_stage=i % 2) for i, p in enumerate(LAYOUTS)]


@pytest.fixture(scope="module")
def groups(host_bank):
    from rankmesh.backends.ray import RayClassWithInitArgs, create_colocated_worker_cls

    colocated = create_colocated_worker_cls({
        "train": RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=1),
        "gen": RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=None, mesh_name="gen"),
    })
    pair = host_bank.build(colocated, TRAIN, meshes={"gen": GEN})
    pipe = host_bank.build(RayClassWithInitArgs(ShardHolder, PIPE_LAYOUTS, seed=2), PIPE)
    roles = pair.spawn(["train", "gen"])
    yield roles["train"], roles["gen"], pipe
    host_bank.give_back(pair)
    host_bank.give_back(pipe)


def expected(layouts, mesh: RankMesh, seed: int, factor: float = 1.0) -> list[dict[str, np.ndarray]]:
    return [{p.name: megatron_cut(full_tensor(p, seed), p, mesh, r) * np.float32(factor)
             for p in layouts if holds(p, mesh, r)} for r in range(mesh.world_size)]


def assert_shards(got, want) -> None:
    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), rank
        for name in w:
            np.testing.assert_array_equal(g[name], w[name], err_msg=f"rank {rank} {name}")


def test_colocated_refit_moves_only_missing_halves(groups) -> None:
    train, gen, _ = groups
    plan = plan_between(train, gen, colocated=True, dst_mesh=GEN)
    # a tp1 rank already holds its process's half of every tp-split tensor, and all of ln
    split = sum(p.nbytes for p in LAYOUTS if p.tp_dim is not None)
    assert plan.bytes_moved == 4 * split // 2 and plan.bytes_local > 0
    stats = reshard(train, gen, plan)
    assert stats.bytes_moved == plan.bytes_moved
    # one node: every region that leaves its process is read straight from the source process
    assert stats.bytes_direct == plan.bytes_moved and stats.bytes_put == 0 and stats.refused == 0
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=1))


def test_failed_colocated_refit_leaves_nothing_behind(groups) -> None:
    from dataclasses import replace

    from rankmesh.errors import WorkerError
    from rankmesh.reshard import ReshardPlan

    train, gen, _ = groups
    good = plan_between(train, gen, colocated=True, dst_mesh=GEN)
    # One remote region is aimed at a box of another shape: rank 0's receive fails after every
    # source has put its regions and left its local views for the receive of its process.
    bad = next(i for i, t in enumerate(good.transfers) if not t.local and t.dst_rank == 0)
    transfers = list(good.transfers)
    transfers[bad] = replace(transfers[bad], dst_slices=tuple(slice(0, 10**6) for _ in transfers[bad].dst_slices))
    broken = ReshardPlan(good.src, good.dst, good.params, good.dst_params, transfers, colocated=True)
    with pytest.raises(WorkerError, match="rank 0"):
        reshard(train, gen, broken)
    assert train.reshard_pending() == [0, 0, 0, 0]
    reshard(train, gen, good)  # and the roles still refit
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=1))
    assert train.reshard_pending() == [0, 0, 0, 0]


def test_a_failing_source_fails_the_refit_naming_it(groups) -> None:
    from dataclasses import replace

    from rankmesh.errors import WorkerError
    from rankmesh.reshard import ReshardPlan

    _, gen, pipe = groups
    good = plan_between(pipe, gen, dst_mesh=GEN)
    # Source rank 0 (stage 0) is asked for "ln", which only stage 1 holds: its send fails while the
    # receives, submitted with the sends, already wait for it.
    bad = next(i for i, t in enumerate(good.transfers) if t.src_rank == 0 and t.name == "embed")
    transfers = list(good.transfers)
    transfers[bad] = replace(transfers[bad], name="ln", src_slices=(slice(0, 4),), dst_slices=(slice(0, 4),), nbytes=16)
    broken = ReshardPlan(good.src, good.dst, good.params, good.dst_params, transfers)
    with pytest.raises(WorkerError, match=r"(?s)rank 0.*reshard_send.*'ln'"):
        reshard(pipe, gen, broken)
    reshard(pipe, gen, good)  # nothing is left waiting: the next refit works
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=2))


def test_pipelined_source_to_generator_and_back(groups) -> None:
    train, gen, pipe = groups
    plan = plan_between(pipe, gen, dst_mesh=GEN)
    assert plan.dst_params["qkv"].pp_stage is None and plan.params["qkv"].pp_stage == 1
    reshard(pipe, gen, plan)
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=2))
    # an update on the generator side travels back into the pipelined layout
    gen.scale(3.0)
    back = plan_reshard(plan.dst_params, GEN, PIPE, dst_layouts=PIPE_LAYOUTS)
    reshard(gen, pipe, back)
    assert_shards(pipe.shards(), expected(PIPE_LAYOUTS, PIPE, seed=2, factor=3.0))


def test_plan_must_match_the_groups(groups) -> None:
    train, gen, _ = groups
    with pytest.raises(ReshardError, match="source mesh"):
        reshard(train, gen, plan_reshard(LAYOUTS, RankMesh(tp=4), GEN))

    class Renamed:  # a destination whose parameters have other names
        mesh, meshes = gen.mesh, gen.meshes

        @staticmethod
        def param_layouts():
            return [[p.replace(name=p.name + "_x") for p in ps] for ps in gen.param_layouts()]

    with pytest.raises(ReshardError, match="different parameters.*names="):
        plan_between(train, Renamed, dst_mesh=GEN)


@pytest.mark.parametrize("transport", ("auto", "store"))
def test_both_transports_move_the_same_weights(groups, transport) -> None:
    _, gen, pipe = groups
    pipe.refill(5)
    gen.refill(None)
    plan = plan_between(pipe, gen, dst_mesh=GEN)
    stats = reshard(pipe, gen, plan, transport=transport)
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=5))
    direct = transport == "auto"
    assert stats.bytes_direct == (plan.bytes_moved if direct else 0)
    assert (stats.bytes_put == 0) == direct and stats.refused == 0
    # Back into the pipelined tp2 layout: proj splits along dim 1 and qkv with stride 3, so the
    # destination's regions are strided in the source (tp1) and whole in its own shard.
    gen.scale(2.0)
    pipe.refill(None)
    back = plan_reshard(plan.dst_params, GEN, PIPE, dst_layouts=PIPE_LAYOUTS)
    stats = reshard(gen, pipe, back, transport=transport)
    assert_shards(pipe.shards(), expected(PIPE_LAYOUTS, PIPE, seed=5, factor=2.0))
    assert stats.bytes_direct == (back.bytes_moved if direct else 0)


def test_an_unknown_transport_is_refused(groups) -> None:
    train, gen, _ = groups
    plan = plan_between(train, gen, colocated=True, dst_mesh=GEN)
    with pytest.raises(ReshardError, match=r"transport='shm'.*'auto', 'store'"):
        reshard(train, gen, plan, transport="shm")


def test_cuda_ipc_between_cpu_tensors_names_the_pair_and_moves_nothing(groups) -> None:
    """``transport="cuda_ipc"`` needs both tensors of a pair on one GPU: CPU ranks get an error
    naming the first pair (source rank 0 of the pipeline holds stage 0, read by gen rank 0)."""
    _, gen, pipe = groups
    pipe.refill(4)
    gen.refill(None)
    plan = plan_between(pipe, gen, dst_mesh=GEN)
    with pytest.raises(ReshardError, match=r"source rank 0 -> destination rank 0 cannot use CUDA IPC: source on cpu "
                                           r"\(GPU None, pid \d+\), destination on cpu"):
        reshard(pipe, gen, plan, transport="cuda_ipc")
    assert all(not np.any(a) for shard in gen.shards() for a in shard.values())


def test_refused_direct_reads_go_through_the_store(groups, caplog) -> None:
    """A destination that truly cannot read other processes (a seccomp filter, as in some containers)."""
    import logging

    import rankmesh.reshard.run as module
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from tests.seccomp_filter import supported

    if not supported():
        pytest.skip("seccomp filter for this machine not written")
    _, _, pipe = groups
    mesh = RankMesh(dp=2)
    sealed = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=None),
                            mesh=mesh)
    try:
        sealed.forbid_peer_reads()
        pipe.refill(4)
        plan = plan_between(pipe, sealed)
        assert not ReshardSession.of(sealed).warned  # a new destination group: its session has not warned yet
        with caplog.at_level(logging.WARNING, logger=module.__name__):
            stats = reshard(pipe, sealed, plan)
        assert_shards(sealed.shards(), expected(LAYOUTS, mesh, seed=4))
        pairs = {(t.src_rank, t.dst_rank) for t in plan.transfers}
        assert stats.refused == len(pairs) and stats.bytes_direct == 0 and stats.bytes_put > 0
        assert "EPERM" in caplog.text and "transport='store'" in caplog.text and "source rank" in caplog.text
        # remembered: the next refit sends those pairs through the store without trying
        sealed.refill(None)
        stats = reshard(pipe, sealed, plan)
        assert stats.refused == 0 and stats.bytes_direct == 0
        assert_shards(sealed.shards(), expected(LAYOUTS, mesh, seed=4))
    finally:
        sealed.shutdown()


# ----- worker-side helpers, without Ray ------------------------------------------------------------


def test_layouts_from_module_reads_megatron_attributes() -> None:
    module = torch.nn.Module()
    module.layers = torch.nn.ModuleList([torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)])
    for i, layer in enumerate(module.layers):
        layer.layer_number = 5 + i  # megatron: 1-based global number (this stage starts at layer 4)
    w = module.layers[0].weight
    w.tensor_model_parallel, w.partition_dim, w.partition_stride = True, 0, 3
    mesh = RankMesh(tp=2, pp=2)
    layouts = {p.name: p for p in layouts_from_module(module, mesh, rank=3)}
    assert sorted(layouts) == ["layers.4.bias", "layers.4.weight", "layers.5.bias", "layers.5.weight"]
    assert layouts["layers.4.weight"] == ParamLayout("layers.4.weight", (12, 4), tp_dim=0, pp_stage=1, tp_stride=3)
    assert layouts["layers.5.weight"] == ParamLayout("layers.5.weight", (4, 6), pp_stage=1)
    assert global_parameter_names(torch.nn.Linear(2, 2)) == {"weight": "weight", "bias": "bias"}


def test_regions_travel_bit_exact_for_dtypes_numpy_lacks() -> None:
    from rankmesh.reshard.worker import copy_into as _copy_into
    from rankmesh.serialization import numpy_view as _numpy_view

    src = torch.randn(6, 8).to(torch.bfloat16)
    dst = torch.zeros(4, 8, dtype=torch.bfloat16)
    region = np.ascontiguousarray(_numpy_view(src[1:5, 2:6]))  # as a source puts it
    region.setflags(write=False)  # as a destination gets it from the object store
    _copy_into(dst[:, 4:8], region)
    assert torch.equal(dst[:, 4:8], src[1:5, 2:6]) and not dst[:, :4].any()


def test_row_blocks_cut_whole_rows_of_at_most_a_piece() -> None:
    # 520 rows of 640 float32 (2560 bytes): 409 rows fit in 1 MiB
    assert row_blocks((520, 640), 4) == [(0, 409), (409, 520)]
    assert row_blocks((3, 600_000), 4) == [(0, 1), (1, 2), (2, 3)]  # a row above the limit goes alone
    assert row_blocks((10,), 2, limit=8) == [(0, 4), (4, 8), (8, 10)]
    assert row_blocks((), 4) == [(0, 1)]
    assert PIECE_BYTES == 1 << 20


# ----- a rank dies during a refit: the groups' on_rank_death="replace" ------------------------------


def test_a_rank_death_during_a_refit_is_replaced_and_the_refit_completes(ray_session) -> None:
    """A destination rank dies in its receive, then a source rank in its send: each time the group
    that lost it replaces it (a fresh process, built from its constructor arguments) and the
    refit completes, with every shard as megatron cuts it."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.recovery import exit_on_next_call

    dst_mesh = RankMesh(dp=2)
    src = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=6),
                         mesh=TRAIN, on_rank_death="replace", call_timeout_s=180)
    dst = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=None),
                         mesh=dst_mesh, on_rank_death="replace", call_timeout_s=180)
    try:
        plan = plan_between(src, dst)
        dead_dst = exit_on_next_call(dst, 1, "reshard_recv")
        stats = reshard(src, dst, plan)
        assert stats.bytes_moved == plan.bytes_moved == dst_mesh.world_size * sum(p.nbytes for p in LAYOUTS)
        assert [r.ranks for r in dst.replacements] == [[1]] and not src.replacements
        assert dst.node_info[1]["pid"] != dead_dst
        assert_shards(dst.shards(), expected(LAYOUTS, dst_mesh, seed=6))

        dst.refill(None)
        dead_src = exit_on_next_call(src, 2, "reshard_send")
        reshard(src, dst, plan, version=7)
        assert [r.ranks for r in src.replacements] == [[2]] and src.node_info[2]["pid"] != dead_src
        assert_shards(dst.shards(), expected(LAYOUTS, dst_mesh, seed=6))

        # A destination rank dies outside a refit: its replacement is built with the constructor's
        # (zero) weights, and gets what the last refit wrote, and its version, from its live peer
        # before the retried call runs on it.
        dead_dst = exit_on_next_call(dst, 0, "shards")
        assert_shards(dst.shards(), expected(LAYOUTS, dst_mesh, seed=6))
        assert [r.ranks for r in dst.replacements] == [[1], [0]] and dst.node_info[0]["pid"] != dead_dst
        assert dst.held_versions() == [7, 7]
    finally:
        src.shutdown()
        dst.shutdown()


def test_a_rolling_refit_moves_one_replica_at_a_time_and_leaves_the_others(groups) -> None:
    """reshard into ``train.replica(i)``: that replica's bytes only, same-node reads straight from the source."""
    train, _, pipe = groups
    pipe.refill(5)
    # tp2·dp2 by hand: replica 1 is ranks 2, 3; a replica holds each tp-split tensor once and
    # each replicated one on both of its ranks.
    one_replica = sum(p.nbytes if p.tp_dim is not None else 2 * p.nbytes for p in LAYOUTS)
    try:
        view = train.replica(1)
        stats = reshard(pipe, view, plan_between(pipe, view))
        assert stats.bytes_moved == one_replica and stats.bytes_direct > 0
        new, old = expected(LAYOUTS, TRAIN, seed=5), expected(LAYOUTS, TRAIN, seed=1)
        assert_shards(train.shards(), [old[0], old[1], new[2], new[3]])
        stats = reshard(pipe, train.replica(0), plan_between(pipe, train.replica(0)))
        assert stats.bytes_moved == one_replica
        assert_shards(train.shards(), new)
    finally:
        train.refill(1)


def test_a_group_with_named_meshes_refuses_to_change_its_dp_size(groups) -> None:
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.errors import BackendError, RecoveryError

    train, _, _ = groups
    with pytest.raises(RecoveryError, match=r"named meshes \['gen'\] cannot change their dp size"):
        train.grow(1)
    # The shrinking policies are refused when the group is made, before any process starts.
    with pytest.raises(BackendError, match=r"on_rank_death='shrink' changes the group's dp size.*\['gen'\]"):
        RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ShardHolder, LAYOUTS, seed=1),
                       mesh=TRAIN, meshes={"gen": GEN}, on_rank_death="shrink")



def test_a_destination_waits_for_its_sources_no_longer_than_the_calls_timeout(groups) -> None:
    """Every wait bounded: a receive whose source never sends (its node cut off) fails once its
    call's timeout (``RecvJob.wait_s``) has passed, naming the source, and leaves the rank free.
    Before, it waited as long as Ray did: a rollout rank stuck this way held every later refit of
    its group in the chaos soak for over a minute."""
    import time

    import ray

    from rankmesh.errors import WorkerError
    from rankmesh.reshard.worker import ObjectRead, RecvJob

    _, gen, _ = groups

    @ray.remote(num_cpus=0)
    def never_sends() -> None:
        time.sleep(60)

    pending = never_sends.remote()
    try:
        job = RecvJob("never", (ObjectRead(0, 0, ()),), wait_s=1.0)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"source ranks \[0\] had not sent within 1 s") as err:
            gen.call_ranks("reshard_recv", [(job, [pending])], ranks=[0], timeout_s=30)
        assert err.value.rank == 0 and time.monotonic() - start < 15
        assert gen.call_ranks("shards", [()], ranks=[0]) is not None  # the rank is free for the next call
    finally:
        ray.cancel(pending, force=True)
