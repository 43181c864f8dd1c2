"""Replacing a dead MegatronWorker rank: parallel_state rebuilt and re-checked, state restored bit-exact.

tp2·dp2 (order tp-cp-ep-dp-pp, so rank = tp + 2 * dp by hand): rank 2 (tp 0, dp 1) dies after a
training step; its dp peer is rank 0.  The dp replicas were trained on different rows but
all-reduce their gradients, so before the death rank 2 and rank 0 hold the same bytes; after the
replacement the new rank 2 must hold them too, parameters and Adam state alike.  Then rank 3 dies
and the group shrinks to tp2·dp1, grows back to tp2·dp2, and its weights after every update
equal one process holding the whole model and taking the same global batches (within 1e-5, the
demo's tolerance: only the float summation order differs).
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
from rankmesh.megatron.reference import ReferenceModel, TinyConfig, token_log_probs  # noqa: E402
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

        # Shrink: rank 3 (tp1 dp1) dies; replica 1 goes, ranks 0, 1 go on as tp2·dp1, parallel_state
        # rebuilt and cross-checked against the new mesh; the next update takes the same 4-row batch.
        exit_on_next_call(wg, 3, "compute_log_prob")
        with pytest.raises(WorkerDiedError):
            wg.compute_log_prob(batch(2))
        shrunk = wg.shrink_dead_replicas(timeout_s=120)
        assert shrunk.lost_replicas == [1] and wg.mesh == RankMesh(tp=2, dp=1)
        assert [s["pid"] for s in wg.state_bytes()] == [after[0]["pid"], after[1]["pid"]]
        wg.update_actor(batch(4))
        # Grow back to tp2·dp2: the new replica copies ranks 0, 1; the next update runs on 4 ranks.
        grown = wg.grow(1)
        assert grown.peers == {2: 0, 3: 1} and wg.mesh == mesh
        now = wg.state_bytes()
        assert now[2]["params"] == now[0]["params"] and now[2]["opt"] == now[0]["opt"]
        assert now[3]["params"] == now[1]["params"] and now[3]["opt"] == now[1]["opt"]
        wg.update_actor(batch(5))

        # The update math is that of the global batch whatever the dp size: one process holding
        # the whole model, Adam(lr=1e-2), one step per 4-row batch (mean over rows and tokens).
        model = ReferenceModel(TinyConfig())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for seed in (1, 3, 4, 5):
            data = batch(seed)
            ids = data.batch["input_ids"]
            lp = token_log_probs(model(ids), ids)[:, 2:]
            ratio = torch.exp(lp - data.batch["old_log_probs"])
            adv = data.batch["advantages"]
            opt.zero_grad()
            torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean().backward()
            opt.step()
        expected = model.state_dict()
        gathered = [g for g in wg.gather_full_weights() if g is not None]
        assert sorted(g["dp"] for g in gathered) == [0, 1]
        for g in gathered:
            assert g["weights"].keys() == expected.keys()
            for name, value in g["weights"].items():
                assert torch.allclose(torch.tensor(value), expected[name], atol=1e-5), (g["dp"], name)
    finally:
        wg.shutdown()
