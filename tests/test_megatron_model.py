"""The tiny model on megatron-core tensor-parallel layers, the CPU pipeline, and the PPO roles.

Every test runs a real gloo group of forked processes (megatron imported once, in the parent)
and compares with the unsharded single-process model built from the same seed.
"""

from __future__ import annotations

import pytest
import torch

from rankmesh.mesh import RankMesh

pytest.importorskip("megatron.core")

from rankmesh.data.proto import DataProto  # noqa: E402
from rankmesh.megatron.reference import (  # noqa: E402
    ReferenceModel,
    TinyConfig,
    full_weights,
    sample,
    shard_dim,
    token_log_probs,
)
from tests.megatron_workers import construct_worker, run_forked  # noqa: E402

CFG = TinyConfig()
TOKENS = torch.randint(0, CFG.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0))
PROMPT = 4


def test_shard_dims_and_stage_layers() -> None:
    from rankmesh.megatron.model import stage_layers

    assert shard_dim("layers.1.q.weight") == 0 and shard_dim("layers.0.fc2.weight") == 1
    assert shard_dim("embed.weight") == 0 and shard_dim("final_ln.weight") is None
    assert shard_dim("layers.0.proj.bias") is None  # row-parallel bias is added after the reduce
    assert [list(stage_layers(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(2, 2, r)) for r in range(2)] == [[0], [1]]


def test_full_weights_reproducible() -> None:
    a, b = full_weights(CFG), full_weights(CFG)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(full_weights(CFG, seed=7)["embed.weight"], a["embed.weight"])


def test_sampler_log_probs_match_model() -> None:
    model = ReferenceModel(CFG).eval()
    seqs, logps = sample(model, TOKENS[:3, :PROMPT], 5, [1, 2, 3])
    with torch.no_grad():
        lp = token_log_probs(model(seqs), seqs)[:, PROMPT - 1 :]
    assert seqs.shape == (3, PROMPT + 5)
    assert torch.allclose(lp, logps, atol=1e-5)
    again, _ = sample(model, TOKENS[:3, :PROMPT], 5, [1, 2, 3])
    assert torch.equal(seqs, again)  # one seeded generator per row


@pytest.mark.parametrize("mesh", [RankMesh(tp=2, pp=2, dp=2), RankMesh(tp=4), RankMesh(pp=2, dp=2, order="tp-pp-dp")], ids=repr)
def test_parallel_log_probs_and_one_ppo_step_match_single_process(mesh: RankMesh) -> None:
    """Log-probs, then one PPO step: the gathered weights equal a single-process Adam step."""
    from rankmesh.megatron.roles import ActorWorker

    dp = mesh.size("dp")
    adv = torch.randn(TOKENS.shape[0], TOKENS.shape[1] - PROMPT, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        old = token_log_probs(ReferenceModel(CFG)(TOKENS), TOKENS)[:, PROMPT - 1 :]
    full = DataProto.from_dict({"input_ids": TOKENS, "old_log_probs": old - 0.05, "advantages": adv},
                               meta_info={"prompt_length": PROMPT})

    def fn(rank: int, world: int):
        actor = construct_worker(ActorWorker, mesh, rank, lr=1e-2, micro_batches=2)
        try:
            piece = full.chunk(dp)[actor.rank_info.dp_rank]
            lp = actor.compute_log_prob(piece)
            metrics = actor.update_actor(piece)
            weights = actor.gather_full_weights()
            keep = mesh.is_collect(rank)  # what MEGATRON_COMPUTE_PROTO would collect
            return {"lp": lp.batch["log_probs"] if keep else None, "dp": actor.rank_info.dp_rank,
                    "metrics": metrics.meta_info["metrics"] if keep else None, "weights": weights}
        finally:
            actor.destroy_megatron()

    results = run_forked(fn, mesh.world_size)
    collected = [r for r in results if r["lp"] is not None]
    assert len(collected) == len(mesh.collect_ranks())
    got = torch.cat([r["lp"] for r in sorted(collected, key=lambda r: r["dp"])])
    assert (got - old).abs().max() < 1e-5

    # The same step in one process: 2*dp equal micro-batches, mean loss, Adam(lr=1e-2).
    model = ReferenceModel(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    n = 2 * dp
    for part in full.chunk(n):
        lp = token_log_probs(model(part.batch["input_ids"]), part.batch["input_ids"])[:, PROMPT - 1 :]
        ratio = torch.exp(lp - part.batch["old_log_probs"])
        a = part.batch["advantages"]
        (torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2)).mean() / n).backward()
    opt.step()
    expected = model.state_dict()
    merged: dict[int, dict] = {}
    for r in results:
        if r["weights"] is not None:
            merged.setdefault(r["weights"]["dp"], {}).update(r["weights"]["weights"])
    assert sorted(merged) == list(range(dp))
    for replica in merged.values():
        assert replica.keys() == expected.keys()
        for name, value in replica.items():
            assert torch.allclose(torch.from_numpy(value), expected[name], atol=1e-5), name
    losses = {r["metrics"]["actor/pg_loss"] for r in results if r["metrics"] is not None}
    assert len(losses) == 1  # every dp replica reports the dp-averaged loss


def test_colocated_roles_share_parallel_state_and_critic_values() -> None:
    """Actor and reference in one process share parallel_state; the critic's values match too."""
    from rankmesh.megatron.roles import ActorWorker, CriticWorker, RefWorker

    mesh = RankMesh(tp=2, pp=2)
    data = DataProto.from_dict({"input_ids": TOKENS[:4]}, meta_info={"prompt_length": PROMPT})

    def fn(rank: int, world: int):
        actor = construct_worker(ActorWorker, mesh, rank)
        ref = construct_worker(RefWorker, mesh, rank)
        critic = construct_worker(CriticWorker, mesh, rank)
        try:
            out = (actor.compute_log_prob(data), ref.compute_ref_log_prob(data), critic.compute_values(data))
            if not mesh.is_collect(rank):
                return [None, None, None]
            return [dict(o.batch.items()) for o in out]
        finally:
            for w in (critic, ref, actor):
                w.destroy_megatron()

    results = [r for r in run_forked(fn, mesh.world_size) if r[0] is not None]
    assert len(results) == 1  # tp 0 of the last stage
    lp, ref_lp, values = results[0]
    with torch.no_grad():
        want_lp = token_log_probs(ReferenceModel(CFG)(TOKENS[:4]), TOKENS[:4])[:, PROMPT - 1 :]
        want_v = ReferenceModel(CFG, value_head=True)(TOKENS[:4])[:, PROMPT - 1 : -1]
    assert (lp["log_probs"] - want_lp).abs().max() < 1e-5
    assert torch.equal(lp["log_probs"], ref_lp["ref_log_prob"])
    assert (values["values"] - want_v).abs().max() < 1e-5
