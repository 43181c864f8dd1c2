"""Resharding on the in-process backend: the same worker methods and controller as on Ray, checked against megatron's cut.

Every rank lives in this process (``LocalWorkerGroup``); the backend's objects are plain
references (``backends.local.LocalObjects``).  Expected shards come from the oracle of
tests/reshard_workers.py, expected byte counts from the layouts by hand.
"""

from __future__ import annotations

import json

import pytest

import rankmesh
from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.errors import ReshardError
from rankmesh.mesh import RankMesh
from rankmesh.reshard import ReshardWorker, plan_between, plan_reshard, reshard
from tests.reshard_workers import ShardHolder
from tests.test_reshard_ray import GEN, LAYOUTS, PIPE, PIPE_LAYOUTS, assert_shards, expected

#: A GEN rank (tp1, no pipeline) holds every full tensor, and starts with none of it.
GEN_BYTES = GEN.world_size * sum(p.nbytes for p in LAYOUTS)


def groups(src_seed: int = 2):
    pipe = LocalWorkerGroup(ShardHolder, mesh=PIPE, init_args=(PIPE_LAYOUTS, src_seed))
    gen = LocalWorkerGroup(ShardHolder, mesh=GEN, init_args=(LAYOUTS, None))
    return pipe, gen


def test_in_process_refit_matches_megatrons_cut_both_ways() -> None:
    pipe, gen = groups()
    plan = plan_between(pipe, gen)
    stats = reshard(pipe, gen, plan)
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=2))
    assert stats.bytes_moved == GEN_BYTES and stats.bytes_direct == 0  # in-process: no node, no direct reads
    # A region the four dp replicas read is put once for all of them.
    assert stats.bytes_put == sum(p.nbytes for p in LAYOUTS)
    gen.scale(3.0)
    back = plan_reshard(plan.dst_params, GEN, PIPE, dst_layouts=PIPE_LAYOUTS)
    reshard(gen, pipe, back)
    assert_shards(pipe.shards(), expected(PIPE_LAYOUTS, PIPE, seed=2, factor=3.0))


def test_a_traced_refit_shows_its_sends_and_receives_with_bytes(tmp_path) -> None:
    pipe, gen = groups(src_seed=3)
    plan = plan_between(pipe, gen)
    path = tmp_path / "refit.json"
    with rankmesh.trace(path):
        reshard(pipe, gen, plan)
    assert_shards(gen.shards(), expected(LAYOUTS, GEN, seed=3))
    events = json.loads(path.read_text())["traceEvents"]
    calls = sorted(e["name"] for e in events if e.get("cat") == "call" and e["ph"] == "B")
    assert calls == ["reshard_recv", "reshard_send"]
    returned = {}
    for e in events:
        if e.get("name") == "return" and e["ph"] == "B":
            returned.setdefault(e["args"]["method"], {})[e["args"]["rank"]] = e["args"]["bytes"]
    # Each destination rank wrote every full tensor; the sources put each region once.
    assert returned["reshard_recv"] == {r: sum(p.nbytes for p in LAYOUTS) for r in range(GEN.world_size)}
    assert set(returned["reshard_send"]) == set(range(PIPE.world_size))
    assert sum(returned["reshard_send"].values()) == sum(p.nbytes for p in LAYOUTS) > 0


def test_a_worker_without_layouts_is_told_how_to_describe_them() -> None:
    class Bare(ReshardWorker):
        pass

    wg = LocalWorkerGroup(Bare, mesh=RankMesh(dp=2))
    with pytest.raises(Exception, match=r"(?s)reshard_layouts\(\).*MegatronReshardWorker"):
        wg.param_layouts()
    with pytest.raises(ReshardError, match="without a backend's objects"):
        Bare().reshard_objects()  # built outside any backend


def test_a_refit_into_one_replica_moves_only_its_bytes_and_leaves_the_others() -> None:
    """Rolling refit: reshard into ``gen.replica(i)``, one replica after the other."""
    pipe, gen = groups(src_seed=4)
    replicas = GEN.size("dp")
    refit = expected(LAYOUTS, GEN, seed=4)
    untouched = expected(LAYOUTS, GEN, seed=4, factor=0.0)  # a GEN rank starts at zero (seed=None)
    pipe.weight_version = 7
    for i in range(replicas):
        view = gen.replica(i)
        plan = plan_between(pipe, view)
        stats = reshard(pipe, view, plan)
        assert stats.bytes_moved == GEN_BYTES // replicas  # one tp1 replica: every full tensor once
        shards = gen.shards()
        want = [refit[r] if GEN.coords(r).dp_rank <= i else untouched[r] for r in range(GEN.world_size)]
        assert_shards(shards, want)
        # The source's version went with the weights: recorded for replica i, known by its ranks.
        assert gen.weight_versions == tuple(7 if j <= i else 0 for j in range(replicas))
        assert gen.held_versions() == [7 if GEN.coords(r).dp_rank <= i else 0 for r in range(GEN.world_size)]
    reshard(pipe, gen.replica(0), plan_between(pipe, gen.replica(0)), version=8)
    assert gen.weight_versions == (8, 7, 7, 7) and gen.replica(0).weight_version == 8
    with pytest.raises(rankmesh.errors.DispatchError, match=r"replicas hold weight versions \(8, 7, 7, 7\)"):
        gen.weight_version
    with pytest.raises(ReshardError, match=r"source's replicas hold weight versions \[7, 8\]; pass version="):
        reshard(gen, pipe, plan_reshard(plan.dst_params, GEN, PIPE, dst_layouts=PIPE_LAYOUTS))
    with pytest.raises(ReshardError, match=r"reshard\(version=-1\)"):
        reshard(pipe, gen, plan_between(pipe, gen), version=-1)
