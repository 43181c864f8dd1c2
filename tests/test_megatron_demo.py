"""The actor/critic demo, fast: two iterations on the session's Ray, every self-check must pass.

All runs but one build their groups in the host bank's running processes (tests/hosts.py): a
megatron process costs 4-5 CPU-seconds to start, and the runs here would start 31 of them.  The
synchronous run of the K=0 comparison starts its own pools and processes, as the command does, so
the comparison also shows that a run in reused processes ends exactly where a run in new ones ends.
"""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("ray")


def demo(argv: list[str], bank) -> int:
    """``rankmesh demo ARGV``'s run and exit code; its groups built in ``bank``'s processes, or in
    new ones (new pools, as the command starts them) with ``bank=None``."""
    from rankmesh.demo_cli import add_arguments, run_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv), processes=None if bank is None else bank.processes())


def test_demo_two_iterations(host_bank, tmp_path, capsys) -> None:
    report = tmp_path / "demo.json"
    # --hang-rank 5: a few seconds more, and the run must go on undisturbed after it.
    code = demo(["--iterations", "2", "--no-progress", "--json", str(report), "--hang-rank", "5"], host_bank)
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


#: The smallest meshes that still pipeline the actor: 2 + 1 + 2 processes.
SMALL = ["--iterations", "2", "--no-progress", "--no-layout", "--actor-tp", "1", "--actor-pp", "2", "--actor-dp", "1",
         "--critic-tp", "1", "--critic-dp", "1", "--rollout-dp", "2"]


def _run(tmp_path, bank, name: str, *extra: str) -> dict:
    report = tmp_path / f"{name}.json"
    assert demo([*SMALL, "--json", str(report), *extra], bank) == 0
    return json.loads(report.read_text())


def test_async_demo_trains_on_rows_at_most_k_versions_old(host_bank, tmp_path, capsys) -> None:
    result = _run(tmp_path, host_bank, "k1", "--async-staleness", "1", "--iterations", "3")
    out = capsys.readouterr().out
    assert result["ok"] and all(result["checks"].values()), result["checks"]
    tally = result["asynchronous"]
    # Step 0 trains on version-0 rows; later steps may take rows made one update earlier, never two.
    assert tally["lags"][0] == 0 and max(tally["lags"]) == 1 and len(tally["lags"]) == 3
    assert tally["rows_trained"] == 3 * 8 * 4  # three steps of 8 prompts x 4 samples
    assert tally["rows_trained"] + tally["rows_dropped"] + tally["rows_left"] == tally["rows_generated"]
    # Rolling refits: each moves one replica's bytes (the rollout keeps a whole copy per replica).
    assert tally["refit_bytes"] and all(2 * b == result["refit_minimum_bytes"] for b in tally["refit_bytes"])
    assert "asynchronous, K=1" in out and "demo PASS" in out.strip().splitlines()[-1]


def test_async_demo_with_k0_is_the_synchronous_run(host_bank, tmp_path) -> None:
    sync = _run(tmp_path, None, "sync")  # new processes, as the command starts them
    k0 = _run(tmp_path, host_bank, "k0", "--async-staleness", "0")
    assert sync["ok"] and k0["ok"], (sync["checks"], k0["checks"])
    assert k0["final_weights_sha256"] == sync["final_weights_sha256"]  # the same batches, the same updates
    assert [i["actor_loss"] for i in k0["iterations"]] == [i["actor_loss"] for i in sync["iterations"]]
    assert k0["asynchronous"]["rows_dropped"] == 0 and k0["asynchronous"]["lags"] == [0, 0]
