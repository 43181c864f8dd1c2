"""The actor/critic demo, fast: two iterations on the session's Ray, every self-check must pass."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("ray")


def test_demo_two_iterations(ray_session, tmp_path, capsys) -> None:
    from rankmesh.demo_cli import main

    report = tmp_path / "demo.json"
    # --hang-rank 5: a few seconds more, and the run must go on undisturbed after it.
    code = main(["--iterations", "2", "--no-progress", "--json", str(report), "--hang-rank", "5"])
    out = capsys.readouterr().out
    assert code == 0, out
    result = json.loads(report.read_text())
    assert result["ok"] and all(result["checks"].values()), result["checks"]
    assert result["logprob_max_diff"] <= 1e-5
    assert result["final_logprob_max_diff"] <= 1e-5
    assert result["replica_max_diff"] == 0.0
    its = result["iterations"]
    assert len(its) == 2
    for it in its:  # on-policy: every update lowers its batch's losses, seen through the refit rollout
        assert it["actor_loss_after"] < it["actor_loss"] and it["critic_loss_after"] < it["critic_loss"]
        assert it["rollout_diff"] <= 1e-5
        assert it["logprob_diff"] <= 1e-5  # measured every iteration, against the actor's current weights
    assert "logp diff: max |actor log-prob" in out  # every column is explained under the table's header
    assert result["final_rollout_diff"] <= 1e-5
    assert result["refit_bytes"] == [result["refit_minimum_bytes"]] * 3  # startup + one per update
    assert "tp=1" in result["rollout_mesh"] and "dp=4" in result["rollout_mesh"]
    assert "tp=2" in result["actor_mesh"] and "pp=2" in result["actor_mesh"] and "dp=2" in result["actor_mesh"]
    assert "demo PASS" in out.strip().splitlines()[-1]
    # Rank 5 of tp2·pp2·dp2 in megatron order (rank = tp + 2*dp + 4*pp) is tp1 dp0 pp1; its dp
    # group keeps tp1 pp1: ranks 5 and 7.
    hang = result["hang"]
    assert hang["ok"] and hang["report_s"] <= 2.0
    assert "hang_in_barrier: ranks [5] did not finish within 3 s" in out
    assert "rank 5 (tp1 dp0 pp1) on node 127.0.0.1: barrier on dp group [5, 7]" in out


def test_demo_controller_math() -> None:
    import torch

    from rankmesh.demo import DemoConfig, group_advantages, make_prompts, score_responses

    cfg = DemoConfig(prompts=2, samples_per_prompt=3, prompt_length=4)
    prompts = make_prompts(cfg, 64)
    assert prompts.batch["prompts"].shape == (6, 4)
    assert torch.equal(prompts.batch["prompts"][0], prompts.batch["prompts"][2])  # one prompt, 3 samples
    assert prompts.batch["sample_seed"].unique().numel() == 6
    scores = score_responses(torch.tensor([[0, 1, 40, 50], [60, 61, 62, 63], [0, 0, 0, 0],
                                           [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]), 64)
    assert scores.tolist() == [0.5, 0.0, 1.0, 1.0, 1.0, 1.0]
    adv, returns = group_advantages(scores, 3, 5)
    assert adv.shape == returns.shape == (6, 5)
    assert abs(float(adv[:3, 0].sum())) < 1e-5  # zero mean within a group
    assert adv[3:].abs().max() < 1e-3  # identical scores: no advantage
    assert torch.equal(returns[:, 0], scores)
