"""Replica views (``wg.replica(i)`` / ``wg.replicas([...])``) on the in-process backend.

Which ranks a replica holds comes from megatron-core: replica ``i`` is the ``i``-th member of
every dp group ``RankGenerator`` builds.  Which rows a rank computes comes from the worker
itself (it tags each row with its group rank), set against hand-derived tables.
"""

from __future__ import annotations

import json

import pytest
import torch

from rankmesh import DataProto, LocalWorkerGroup, RankMesh
from rankmesh.errors import DispatchError
from rankmesh.replicas import select_replicas
from tests.replica_workers import ReplicaWorker, RolloutReplicaWorker

MESHES = [
    dict(tp=2, pp=2, dp=2),
    dict(tp=2, cp=2, dp=2),
    dict(dp=4),
    dict(tp=2, dp=3),
    dict(tp=2, pp=2, dp=2, order="tp-cp-ep-pp-dp"),
]


def _megatron_replicas(sizes: dict) -> list[list[int]]:
    """Replica i = the i-th rank of every dp group, as megatron-core's RankGenerator builds them."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=sizes.get("tp", 1), ep=1, dp=sizes.get("dp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1),
                        order=sizes.get("order", "tp-cp-ep-dp-pp"))
    groups = gen.get_ranks("dp")
    return [sorted(g[i] for g in groups) for i in range(sizes.get("dp", 1))]


@pytest.mark.parametrize("sizes", MESHES, ids=lambda s: json.dumps(s, sort_keys=True))
def test_a_replica_is_megatrons_dp_slice(sizes):
    mesh = RankMesh(**sizes)
    expected = _megatron_replicas(sizes)
    for i, ranks in enumerate(expected):
        sel = select_replicas(mesh, [i])
        assert sorted(sel.ranks) == ranks
        assert sel.mesh.world_size == len(ranks) and sel.mesh.size("dp") == 1
    both = select_replicas(mesh, [mesh.size("dp") - 1, 0])
    assert sorted(both.ranks) == sorted(expected[-1] + expected[0])
    # view rank s sits at the same tp/cp/pp place in its replica as its group rank does
    for s, g in enumerate(both.ranks):
        view, group = both.mesh.rank_coords(s), mesh.rank_coords(g)
        assert (view.tp, view.cp, view.pp) == (group.tp, group.cp, group.pp)
        assert both.replicas[view.dp] == group.dp


@pytest.fixture()
def wg():
    group = LocalWorkerGroup(ReplicaWorker, mesh=RankMesh(tp=2, pp=2, dp=2))
    yield group
    group.shutdown()


def _batch(n: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(n, dtype=torch.float32)})


def test_megatron_proto_call_on_one_replica_runs_there_and_collects_from_its_collect_rank(wg):
    # tp2·pp2·dp2, order tp-cp-ep-dp-pp: replica 1 = ranks 2, 3, 6, 7; its collect rank (tp0, last pp) is 6.
    batch = _batch(6)
    before = batch.batch["x"].clone()
    out = wg.replica(1).generate(batch)
    assert out.batch["x"].tolist() == before.tolist()
    assert out.batch["rank"].tolist() == [6] * 6 and out.batch["replica"].tolist() == [1] * 6
    assert torch.equal(batch.batch["x"], before) and set(batch.batch.keys()) == {"x"}  # the caller's batch is untouched
    whole = wg.generate(batch)
    assert whole.batch["rank"].tolist() == [4, 4, 4, 6, 6, 6]


def test_pieces_follow_the_order_replicas_are_named_in(wg):
    out = wg.replicas([1, 0]).generate(_batch(4))
    assert out.batch["rank"].tolist() == [6, 6, 4, 4]  # piece 0 went to replica 1
    assert wg.replicas([1, 0]).mesh == RankMesh(tp=2, pp=2, dp=2)


def test_one_to_all_rank_zero_and_call_ranks_use_the_views_ranks(wg):
    view = wg.replica(1)
    assert [r for r, _, _ in view.where()] == [2, 3, 6, 7]
    assert view.execute_rank_zero("where")[0] == 2
    assert [o[0] for o in view.call_ranks("where", [(), ()], ranks=[3, 0])] == [7, 2]
    assert view.world_size == 4 and view.group is wg


def test_dp_compute_over_a_view_splits_over_its_ranks(wg):
    out = wg.replica(0).per_rank_rows(_batch(8))  # dp_compute: one piece per rank of the view
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 4, 4, 5, 5]


def test_uneven_rows_are_padded_and_unpadded_not_dropped(wg):
    from rankmesh.data import DataProtoConfig

    DataProtoConfig.auto_padding = True
    try:
        out = wg.replicas([0, 1]).generate(_batch(5))
    finally:
        DataProtoConfig.auto_padding = False
    assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]


def test_a_named_mesh_method_takes_the_groups_plan_restricted_to_the_view():
    mesh = RankMesh(tp=2, pp=2, dp=2)
    wg = LocalWorkerGroup(RolloutReplicaWorker, mesh=mesh, meshes={"rollout": RankMesh(tp=2, dp=4)})
    # rollout mesh tp2·dp4: dp replicas are rank pairs {0,1} {2,3} {4,5} {6,7}; collect tp0.
    out = wg.replica(1).rollout_rows(_batch(4))  # view ranks 2, 3, 6, 7 hold rollout replicas 1 and 3
    assert out.batch["rank"].tolist() == [2, 2, 6, 6]
    narrow = LocalWorkerGroup(RolloutReplicaWorker, mesh=RankMesh(dp=4), meshes={"rollout": RankMesh(tp=2, dp=2)})
    with pytest.raises(DispatchError, match=r"rollout_rows.*do not cover every data piece"):
        narrow.replica(1).rollout_rows(_batch(4))  # replica 1 is rank 1, a tp1 rank: no collect rank of its piece


@pytest.mark.parametrize(
    "given, match",
    [([], r"replicas\(indices\) must name dp replicas .*got \[\]"),
     ([2], r"0\.\.1 .*got \[2\]"),
     ([0, 0], r"names a replica twice"),
     ("01", r"takes a list of dp replica ids"),
     ([True], r"got \[True\]")],
)
def test_bad_replica_selections_are_refused_naming_the_argument(wg, given, match):
    with pytest.raises(DispatchError, match=match):
        wg.replicas(given)


def test_expert_parallel_groups_cannot_be_split_into_replicas():
    wg = LocalWorkerGroup(ReplicaWorker, mesh=RankMesh(tp=1, dp=4, ep=2))
    with pytest.raises(DispatchError, match=r"expert parallelism \(ep=2\).*call the whole group"):
        wg.replica(0)


def test_a_view_lives_and_dies_with_its_group(wg):
    view = wg.replica(0)
    with pytest.raises(DispatchError, match="shut the group down"):
        view.shutdown()
    assert len(view.where()) == 4
    wg.shutdown()
    with pytest.raises(Exception, match="shut down"):
        view.where()


def test_a_views_calls_are_traced_on_the_groups_tracks(wg, tmp_path):
    path = tmp_path / "trace.json"
    with wg.trace(path):
        wg.replica(1).where()
    events = json.loads(path.read_text())["traceEvents"]
    begins = [e for e in events if e.get("ph") == "B" and "where" in e.get("name", "")]
    assert {e["name"] for e in begins} == {"where [replica 1]"}
    # on the group's rank tracks, as the group numbers them: replica 1 = ranks 2, 3, 6, 7
    assert sorted(e["args"]["rank"] for e in begins if "rank" in e["args"]) == [2, 3, 6, 7]
    with pytest.raises(DispatchError, match="trace its group"):
        with wg.replica(0).trace(tmp_path / "x.json"):
            pass


def test_weight_versions_are_recorded_per_replica(wg):
    assert wg.weight_versions == (0, 0) and wg.weight_version == 0
    wg.replica(1).weight_version = 3  # what a refit into replica 1 records
    assert wg.weight_versions == (0, 3) and wg.replica(1).weight_version == 3
    with pytest.raises(DispatchError, match=r"replicas hold weight versions \(0, 3\); read weight_versions"):
        wg.weight_version
    wg.weight_version = 4
    assert wg.weight_versions == (4, 4)
    with pytest.raises(DispatchError, match=r"weight_version must be a version >= 0, got -1"):
        wg.replicas([0]).weight_version = -1


def test_a_view_is_made_once_and_a_view_of_a_view_is_the_groups():
    wg = LocalWorkerGroup(ReplicaWorker, mesh=RankMesh(dp=4))
    assert wg.replicas([2, 0]) is wg.replicas((2, 0)) and wg.replica(1) is wg.replicas([1])
    assert wg.replicas([3, 1, 2]).replica(0) is wg.replica(3)  # index 0 of the view is group replica 3
    assert wg.replicas([3, 1, 2]).replicas([2, 1]).selection.ranks == (2, 1)
    with pytest.raises(DispatchError, match=r"0\.\.1 .*got \[2\]"):
        wg.replicas([3, 1]).replica(2)
