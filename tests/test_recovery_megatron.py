"""Replacing a dead MegatronWorker rank: parallel_state rebuilt and re-checked, state restored bit-exact.

tp2·dp2 (order tp-cp-ep-dp-pp, so rank = tp + 2 * dp by hand): rank 2 (tp 0, dp 1) dies after a
training step; its dp peer is rank 0.  The dp replicas were trained on different rows but
all-reduce their gradients, so before the death rank 2 and rank 0 hold the same bytes; after the
replacement the new rank 2 must hold them too, parameters and Adam state alike.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("ray")

import torch  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool  # noqa: E402
from rankmesh.backends.ray.recovery import exit_on_next_call  # noqa: E402
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.errors import WorkerDiedError  # noqa: E402
from rankmesh.megatron.group import start_megatron_group  # noqa: E402
from rankmesh.megatron.reference import TinyConfig  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests.recovery_megatron_workers import TrainActor  # noqa: E402


def batch(seed: int) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    cfg = TinyConfig()
    ids = torch.randint(0, cfg.vocab_size, (4, 8), generator=gen)
    return DataProto.from_dict(
        {"input_ids": ids, "old_log_probs": torch.full((4, 5), -4.0), "advantages": torch.randn(4, 5, generator=gen)},
        meta_info={"prompt_length": 3},
    )


def test_megatron_rank_replaced_and_restored_bit_exact(ray_session):
    mesh = RankMesh(tp=2, dp=2)
    wg = start_megatron_group(
        RayResourcePool([4], use_gpu=False),
        RayClassWithInitArgs(TrainActor, model=TinyConfig().to_dict(), lr=1e-2, micro_batches=1),
        mesh,
        on_rank_death="keep",
        call_timeout_s=120,
    )
    try:
        wg.update_actor(batch(1))
        before = wg.state_bytes()
        assert before[2]["params"] == before[0]["params"] and before[2]["opt"] == before[0]["opt"]
        assert before[2]["opt"] and all("step" in s for s in before[2]["opt"].values())
        logp = wg.compute_log_prob(batch(2)).batch["log_probs"]

        exit_on_next_call(wg, 2, "compute_log_prob")
        with pytest.raises(WorkerDiedError):
            wg.compute_log_prob(batch(2))
        report = wg.replace_dead_ranks(timeout_s=120)  # also re-runs the parallel_state cross-check

        assert report.ranks == [2] and report.peers == {2: 0}
        after = wg.state_bytes()
        assert [a["pid"] for i, a in enumerate(after) if i != 2] == [b["pid"] for i, b in enumerate(before) if i != 2]
        assert after[2]["pid"] != before[2]["pid"]
        for r in range(4):  # every rank, the new one included, holds exactly what it held before
            assert after[r]["params"] == before[r]["params"], r
            assert after[r]["opt"] == before[r]["opt"], r
        assert torch.equal(wg.compute_log_prob(batch(2)).batch["log_probs"], logp)
        wg.update_actor(batch(3))  # training goes on: tp groups re-pointed, dp all-reduce across old and new
        trained = wg.state_bytes()
        assert trained[2]["params"] == trained[0]["params"] != before[0]["params"]
    finally:
        wg.shutdown()
