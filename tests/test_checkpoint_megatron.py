"""Checkpoints saved on one mesh and loaded on another through dist_checkpointing (real Ray, real megatron-core).

The chain tp2·dp2 -> tp1·pp2·dp2 -> tp4 runs on one set of 4 processes (tests/checkpoint_drill.py),
one PPO step per mesh.  Expected values: the uninterrupted run on tp2·dp2, which never saw a
checkpoint.  That the optimizer state really travels is shown by the same last hop with reset
optimizers: it lands ~1000 times farther from the uninterrupted run than the tolerance allows.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("ray")

from rankmesh.errors import WorkerError  # noqa: E402
from rankmesh.megatron.checkpoint import agreed  # noqa: E402
from rankmesh.megatron.reference import TinyConfig  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests.checkpoint_drill import MeshHosts, deviation, full_weights, run_chain, train  # noqa: E402


@pytest.fixture(scope="module")
def mesh_hosts(host_bank):
    hosts = MeshHosts(host_bank)
    yield hosts
    hosts.drop()


def test_a_run_resumed_on_other_meshes_ends_where_the_uninterrupted_run_ends(mesh_hosts, tmp_path):
    meshes = [RankMesh(tp=2, dp=2), RankMesh(tp=1, pp=2, dp=2), RankMesh(tp=4)]
    chain = run_chain(mesh_hosts, meshes, tmp_path, steps=1)

    assert len(chain.deviations) == 2 and all(d.ok for d in chain.deviations), chain
    assert chain.fresh_deviation.ratio > 100, chain  # lost Adam moments would show
    assert chain.versions == [1, 2]  # the weight version each checkpoint was saved with


def test_a_round_trip_on_the_same_mesh_is_bit_exact(mesh_hosts, tmp_path):
    wg = mesh_hosts.group or mesh_hosts.build(RankMesh(tp=2, dp=2))  # any mesh, any weights
    train(wg, range(1))
    wg.save_checkpoint(str(tmp_path / "step1"))
    saved = full_weights(wg)
    train(wg, range(1, 2))
    trained = full_weights(wg)

    wg.load_checkpoint(str(tmp_path / "step1"))
    assert deviation(full_weights(wg), saved).max_abs == 0.0
    train(wg, range(1, 2))  # the same step again, from the restored weights and Adam state
    assert deviation(full_weights(wg), trained).max_abs == 0.0


def test_each_rank_raises_its_own_problem_or_names_the_rank_that_found_one():
    # Pure: what ``agree`` raises on each rank once every rank's problem is known.  tp2·dp2 by hand:
    # rank = tp + 2*dp, so rank 2 is tp0 dp1.  A rank's own problem does not name the rank: the
    # controller's WorkerError names it, and the other failing ranks, once.
    mesh = RankMesh(tp=2, dp=2)
    problems = [None, None, "tensor 'w' is (4,) there, (2,) here", "tensor 'w' is (4,) there, (3,) here"]
    assert agreed(problems, 3, mesh) == "tensor 'w' is (4,) there, (3,) here"
    assert agreed(problems, 2, mesh) == "tensor 'w' is (4,) there, (2,) here"
    assert agreed(problems, 0, mesh) == "rank 2 (tp0 dp1) found: tensor 'w' is (4,) there, (2,) here"
    assert agreed([None] * 4, 1, mesh) is None


def test_checkpoint_errors_name_the_path_and_the_tensor(mesh_hosts, tmp_path):
    wg = mesh_hosts.group or mesh_hosts.build(RankMesh(tp=2, dp=2))
    missing = tmp_path / "nowhere"
    with pytest.raises(WorkerError, match="no checkpoint at .*nowhere.*does not exist") as nowhere:
        wg.load_checkpoint(str(missing))
    # Every rank found it: the ranks are said once (the group is whichever 4-rank mesh the module holds).
    text = str(nowhere.value)
    assert wg.mesh.world_size == 4
    assert text.startswith("rank 0 (") and text.count("rank 0 (") == 1 and text.count("other rank") == 1, text
    assert " and 3 other ranks [1, 2, 3] failed in " in text and "more rank" not in text, text

    saved = tmp_path / "saved"
    wg.save_checkpoint(str(saved))
    with pytest.raises(WorkerError, match="saved.* is not empty"):
        wg.save_checkpoint(str(saved))

    other = mesh_hosts.build(wg.mesh, model=TinyConfig(ffn_hidden_size=48).to_dict())
    with pytest.raises(WorkerError) as caught:
        other.load_checkpoint(str(saved))
    text = str(caught.value)
    assert str(saved) in text and "model.stage.layers.0.fc1.weight" in text, text
    assert "(64, 32)" in text and "(48, 32)" in text, text
