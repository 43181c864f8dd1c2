"""The actor/critic demo: PPO-style iterations over Megatron-parallel worker groups on local Ray.

An actor group on a 3D mesh (tp2·pp2·dp2 from ``parallel_layouts/cpu_demo.yaml``) hosts a
colocated reference role in the same processes; a critic group (tp2·dp2) and a rollout group
(tp1·dp4, the generator's layout: whole model per rank, no pipeline) run in pools of their own.
Every iteration goes through the dispatch modes: generate on the rollout (DP_COMPUTE_PROTO),
log-probs, reference log-probs and values (MEGATRON_COMPUTE_PROTO), advantages on the controller,
the actor and critic updates, then the refit: :func:`rankmesh.reshard.reshard` moves the actor's
new weights from its shards into the rollout's processes (planned once from the two meshes).

The loop is on-policy, and the demo checks itself and exits non-zero unless

* the actor's log-probs from the 3D-parallel group equal those of the same model built unsharded
  in the controller from the same seed (before training, and after it from the gathered weights),
* the reference's log-probs match the controller every iteration,
* after every refit the rollout's log-probs equal the actor's on the same batch,
* every refit moves exactly the bytes the rollout keeps (the minimum), and
* every update lowers the actor's loss on its batch, as seen through the refit rollout (the update
  is visible in the next rollout), and the critic's.

``--kill-rank R --kill-at-iteration K`` kills actor rank R's process on entering ``update_actor``
in iteration K; the actor group (created with ``on_rank_death="replace"``) replaces it in place
and retries the update, and the run must end with the same losses and weights as an undisturbed
one (compare ``final_weights_sha256``; docs/ray_backend.md, "Recovery model", says why it is exact).

``--async-staleness K`` lets the rollout's replicas generate on their own, trains on rows at most K
weight versions old and refits one replica at a time (:mod:`rankmesh.demo_async`); with ``K=0``
it reproduces the synchronous run's batches and final weights.

Sampling seeds are fixed per row, so a run is deterministic (see docs/megatron.md).  Nothing here
imports megatron-core or Ray at module level (the roles and the Ray backend are imported when the
groups start).  The command line (``rankmesh demo``, options and exit codes) is
:mod:`rankmesh.demo_cli`, and the knobs it builds its options from are :mod:`rankmesh.demo_config`,
so the ``rankmesh`` command imports this module (and torch) only when the demo runs.
"""

from __future__ import annotations

import logging
import math
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, TextIO

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib import DummyTqdmFile

from rankmesh.data import DataProto
from rankmesh.errors import RankMeshError, UsageError, WorkerError
from rankmesh.demo_async import FAULT_ERRORS, AsyncRollout, AsyncTally, lost_input
from rankmesh.demo_config import SIZE_OPTIONS, DemoConfig, table_legend
from rankmesh.demo_hang import HangDrill, run_hang_drill
from rankmesh.layout import load_layout
from rankmesh.megatron.group import check_megatron_group, shutdown_megatron_group
from rankmesh.megatron.reference import ReferenceModel, TinyConfig, token_log_probs
from rankmesh.mesh import RankMesh

logger = logging.getLogger(__name__)


@dataclass
class IterationStats:
    """One row of the table."""

    iteration: int
    actor_loss: float
    critic_loss: float
    score: float
    kl: float
    logprob_diff: float
    ref_diff: float
    rollout_diff: float
    actor_loss_after: float = float("nan")
    critic_loss_after: float = float("nan")
    times: dict[str, float] = field(default_factory=dict)  # seconds per phase (_PHASES)

    def seconds(self, *phases: str) -> float:
        """The time these phases took together."""
        return sum(self.times.get(p, 0.0) for p in phases)


@dataclass
class DemoResult:
    """Everything the demo measured, and whether each self-check passed."""

    config: DemoConfig
    actor_mesh: str = ""
    critic_mesh: str = ""
    rollout_mesh: str = ""
    rollout_replicas: int = 0
    refit_bytes: list[int] = field(default_factory=list)
    refit_minimum_bytes: int = 0
    final_rollout_diff: float = float("nan")
    iterations: list[IterationStats] = field(default_factory=list)
    startup_s: float = 0.0
    total_s: float = 0.0
    logprob_max_diff: float = float("nan")
    final_logprob_max_diff: float = float("nan")
    replica_max_diff: float = float("nan")
    final_weights_sha256: str = ""  # the trained actor's gathered weights, to compare runs bit by bit
    replacements: list[dict[str, Any]] = field(default_factory=list)  # ReplacementReport fields per kill
    checks: dict[str, bool] = field(default_factory=dict)
    hang: HangDrill | None = None
    asynchronous: AsyncTally | None = None  # --async-staleness: rows made, trained, dropped; rolling refits

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        return data


# ----- controller-side math (plain torch) ------------------------------------------------------


def make_prompts(cfg: DemoConfig, vocab_size: int):
    """``prompts`` rows, each prompt repeated ``samples_per_prompt`` times, one sampling seed and index (``row``) per row."""
    gen = torch.Generator().manual_seed(cfg.seed)
    base = torch.randint(0, vocab_size, (cfg.prompts, cfg.prompt_length), generator=gen)
    prompts = base.repeat_interleave(cfg.samples_per_prompt, dim=0)
    seeds = torch.arange(len(prompts), dtype=torch.int64) + cfg.seed * 1000
    rows = torch.arange(len(prompts), dtype=torch.int64)  # which prompt a generated row answers
    return DataProto.from_dict(
        {"prompts": prompts, "sample_seed": seeds, "row": rows}, meta_info={"response_length": cfg.response_length}
    )


def score_responses(responses, vocab_size: int):
    """The task's reward: the fraction of response tokens in the lowest quarter of the vocabulary."""
    return (responses < vocab_size // 4).float().mean(dim=-1)


def group_advantages(scores, group_size: int, response_length: int, eps: float = 1e-6):
    """Scores normalized within each prompt's group of samples, broadcast to every response token.

    Critic-free (GRPO-style) so that, on the fixed replay batch, the actor's loss is a function of
    the actor alone; the critic learns the returns alongside and reports its own loss.
    """
    grouped = scores.view(-1, group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)
    adv = adv.reshape(-1, 1).expand(-1, response_length).contiguous()
    returns = scores.view(-1, 1).expand(-1, response_length).contiguous()
    return adv, returns


def _mean_metric(proto: Any, key: str) -> float:
    values = proto.meta_info["metrics"][key]
    values = values if isinstance(values, list) else [values]
    return float(sum(values) / len(values))


# ----- groups ----------------------------------------------------------------------------------


def _demo_layout(cfg: DemoConfig):
    """The layout ``cfg.layout`` names, with the three roles the demo starts; a UsageError naming it otherwise."""
    try:
        layout = load_layout(cfg.layout)
        for role in ("actor", "critic", "rollout"):
            layout.role(role)
    except RankMeshError as exc:
        raise UsageError(f"--layout {cfg.layout}: {exc} (or pass --no-layout to use the --actor-*/--critic-*/--rollout-* sizes)") from None
    return layout


def resolve_meshes(cfg: DemoConfig):
    """(actor mesh, actor pool counts, critic mesh, critic pool counts, where they came from)."""
    if cfg.layout:
        layout = _demo_layout(cfg)
        actor, critic = layout.role("actor"), layout.role("critic")
        return (actor.mesh(), list(actor.pool.process_on_nodes), critic.mesh(),
                list(critic.pool.process_on_nodes), f"layout {layout.name}")
    try:
        actor = RankMesh(tp=cfg.actor_tp, pp=cfg.actor_pp, dp=cfg.actor_dp)
        critic = RankMesh(tp=cfg.critic_tp, dp=cfg.critic_dp)
    except RankMeshError as exc:
        raise UsageError(f"--actor-*/--critic-* sizes: {exc}") from None
    return actor, [actor.world_size], critic, [critic.world_size], "explicit sizes"


def resolve_rollout(cfg: DemoConfig):
    """(rollout mesh, pool counts): the layout's ``rollout`` role, else tp1 x ``cfg.rollout_dp``."""
    if cfg.layout:
        role = _demo_layout(cfg).role("rollout")
        return role.mesh(), list(role.pool.process_on_nodes)
    mesh = RankMesh(dp=cfg.rollout_dp)
    return mesh, [mesh.world_size]


def check_config(cfg: DemoConfig, given: Iterable[str] = ()) -> None:
    """Every option checked against the layout and the model before Ray starts.

    Raises one :class:`UsageError` naming the option at fault and the fix, so a run that could
    not finish fails in a second instead of after the groups' start-up.  ``given``: the options
    the user set (a layout ignores the explicit mesh sizes, so setting both is an error).
    """
    for name in ("iterations", "prompts", "samples_per_prompt", "prompt_length", "response_length", "micro_batches"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    if cfg.iterations < 2:
        raise UsageError("--iterations must be at least 2 (the loss check compares first and last)")
    for name in ("actor_lr", "critic_lr", "tolerance"):
        if not getattr(cfg, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.layout:
        clash = [n for n in SIZE_OPTIONS if n in given]
        if clash:
            flags = ", ".join(f"--{n.replace('_', '-')}" for n in clash)
            raise UsageError(f"{flags}: explicit mesh sizes need --no-layout (--layout {cfg.layout} gives the meshes); "
                             f"add --no-layout to use them, or drop {flags}")
    else:
        for name in SIZE_OPTIONS:
            if getattr(cfg, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}")
    actor, _, critic, _, source = resolve_meshes(cfg)
    rollout, _ = resolve_rollout(cfg)
    model = TinyConfig()
    where = "" if source == "explicit sizes" else f" ({source})"
    for role, mesh, flag in (("actor", actor, "--actor-tp"), ("critic", critic, "--critic-tp")):
        tp = mesh.size("tp")
        for field_name in ("num_heads", "hidden_size", "ffn_hidden_size", "vocab_size"):
            size = getattr(model, field_name)
            if size % tp:
                raise UsageError(f"{flag} {tp}{where}: the demo model's {field_name}={size} is not divisible by tp={tp}; "
                                 f"use a tp that divides {size}")
    if actor.size("pp") > model.num_layers:
        raise UsageError(f"--actor-pp {actor.size('pp')}{where}: the demo model has {model.num_layers} layers, "
                         f"at most one pipeline stage per layer")
    if critic.size("pp") != 1:
        raise UsageError(f"the critic's mesh{where} has pp={critic.size('pp')}; the demo's critic runs without a pipeline")
    if rollout.size("tp") != 1 or rollout.size("pp") != 1:
        raise UsageError(f"the rollout's mesh{where} is {rollout!r}: the demo's rollout holds the whole model per rank (tp1, pp1)")
    rows = cfg.prompts * cfg.samples_per_prompt
    for role, mesh, flag in (("actor", actor, "--actor-dp"), ("critic", critic, "--critic-dp"), ("rollout", rollout, "--rollout-dp")):
        dp = mesh.size("dp")
        if rows % dp:
            raise UsageError(f"--prompts x --samples-per-prompt = {rows} rows do not split evenly over the {role}'s "
                             f"dp={dp}{where} ({flag}); choose sizes whose product is a multiple of {dp}")


def start_rollout(cfg: DemoConfig, model: dict, processes: Any):
    """Start the rollout group (plain workers: no torch.distributed, no megatron-core)."""
    from rankmesh.backends.ray import RayClassWithInitArgs
    from rankmesh.megatron.rollout import RolloutWorker

    mesh, counts = resolve_rollout(cfg)
    return processes.start(counts, RayClassWithInitArgs(RolloutWorker, model=model), mesh, pool_name="rollout_pool",
                           name_prefix="rollout", spares=cfg.spares, **recovery_policy(cfg))


def recovery_policy(cfg: DemoConfig) -> dict[str, Any]:
    """What every group does with a dead or stuck rank: replace it and retry the call once, when a
    kill is planned, spares are kept or calls are bounded (``--call-timeout``: a rank stuck past it
    is killed, ``on_hang="kill"``); else the groups' defaults."""
    policy: dict[str, Any] = {}
    if cfg.kill_rank is not None or cfg.spares or cfg.call_timeout_s is not None:
        policy["on_rank_death"] = "replace"
    if cfg.call_timeout_s is not None:
        policy.update(call_timeout_s=cfg.call_timeout_s, on_hang="kill")
    return policy


def ppo_loss(log_probs, old_log_probs, advantages, clip_ratio: float):
    """The actor's clipped surrogate, as ``ActorWorker.update_actor`` computes it (one micro-batch)."""
    import torch

    ratio = torch.exp(log_probs - old_log_probs)
    return float(torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio)).mean())


def start_groups(cfg: DemoConfig, model: dict, processes: Any):
    """Start actor+ref (colocated) and critic, each cross-checked against its mesh."""
    from rankmesh.backends.ray import RayClassWithInitArgs, create_colocated_worker_cls
    from rankmesh.megatron.roles import ActorWorker, CriticWorker, RefWorker

    actor_mesh, actor_counts, critic_mesh, critic_counts, source = resolve_meshes(cfg)
    common = {"model": model, "micro_batches": cfg.micro_batches}
    colocated = create_colocated_worker_cls({
        "actor": RayClassWithInitArgs(ActorWorker, lr=cfg.actor_lr, clip_ratio=cfg.clip_ratio, **common),
        "ref": RayClassWithInitArgs(RefWorker, **common),
    })
    policy = recovery_policy(cfg)
    # Every role forks its ranks from a warm process per node, the default for rankmesh's own
    # workers (docs/ray_backend.md, "Process models"): the refit between actor and rollout goes
    # through the ranks' holders.
    actor_group = processes.start(actor_counts, colocated, actor_mesh, pool_name="actor_pool", spares=cfg.spares,
                                  name_prefix="actor+ref", **policy)
    roles = check_megatron_group(actor_group, actor_mesh, roles=["actor", "ref"])
    critic_group = processes.start(critic_counts, RayClassWithInitArgs(CriticWorker, lr=cfg.critic_lr, **common),
                                   critic_mesh, pool_name="critic_pool", name_prefix="critic", spares=cfg.spares,
                                   **policy)
    return roles["actor"], roles["ref"], check_megatron_group(critic_group, critic_mesh), source


def gathered_actor_weights(actor) -> tuple[dict, float]:
    """The actor's full weights (dp replica 0, all stages) and the largest difference between replicas."""
    pieces = [p for p in actor.gather_full_weights() if p is not None]
    by_dp: dict[int, dict[str, np.ndarray]] = {}
    for p in pieces:
        by_dp.setdefault(p["dp"], {}).update(p["weights"])
    first = by_dp[0]
    diff = max((float(np.abs(w[k] - first[k]).max()) for w in by_dp.values() for k in first), default=0.0)
    return {k: torch.from_numpy(np.array(v)) for k, v in first.items()}, diff


# ----- the run -----------------------------------------------------------------------------------


def run_demo(cfg: DemoConfig, out: TextIO | None = None, processes: Any = None) -> DemoResult:
    """Start the groups, run ``cfg.iterations`` PPO-style iterations, check, shut down.

    ``processes``: where the groups run (``start``/``stop``, default
    :class:`~rankmesh.backends.ray.group.PoolPerGroup`: a new pool and processes per group).
    """
    from rankmesh.backends.ray import PoolPerGroup
    from rankmesh.backends.ray.runtime import ensure_ray
    from rankmesh.reshard.run import plan_between, reshard

    out = out or sys.stdout
    processes = processes if processes is not None else PoolPerGroup()
    t_start = time.perf_counter()
    result = DemoResult(cfg)
    tcfg = TinyConfig(seed=cfg.seed, max_seq_len=cfg.prompt_length + cfg.response_length)
    bar = _progress_bar(cfg, sys.stderr)
    if bar.disable or not _is_terminal(out):  # a log (or a terminal without the bar) hears of the start-up now
        _say(out, _startup_line(cfg))
    conn = actor = ref = critic = rollout = None
    try:
        bar.set_description("starting Ray")
        conn = ensure_ray(cfg.address, num_cpus=16 + 3 * cfg.spares)
        bar.set_description("starting actor+ref and critic")
        actor, ref, critic, source = start_groups(cfg, tcfg.to_dict(), processes)
        bar.set_description("starting rollout")
        rollout = start_rollout(cfg, tcfg.to_dict(), processes)
        result.actor_mesh, result.critic_mesh, result.rollout_mesh = repr(actor.mesh), repr(critic.mesh), repr(rollout.mesh)
        result.rollout_replicas = rollout.mesh.size("dp")
        # Planned once from the two meshes and the actor's own parameter attributes.
        bar.set_description("first refit")
        plan = plan_between(actor, rollout)
        result.refit_minimum_bytes = rollout.world_size * sum(p.numel() * p.element_size() for p in ReferenceModel(tcfg).parameters())
        result.refit_bytes.append(reshard(actor, rollout, plan).bytes_moved)
        result.startup_s = time.perf_counter() - t_start
        sent = plan.bytes_per_src_rank
        _say(out, f"actor+ref: {actor.mesh!r} ({actor.world_size} processes, {source})\n"
                  f"critic:    {critic.mesh!r} ({critic.world_size} processes)\n"
                  f"rollout:   {rollout.mesh!r} ({rollout.world_size} processes),\n"
                  f"           refit from the actor by reshard: {len(plan.transfers)} regions, "
                  f"{plan.bytes_moved / 1024:.0f} KiB, busiest sender {max(sent.values()) / 1024:.0f} KiB "
                  f"(mean {sum(sent.values()) / len(sent) / 1024:.0f} KiB)\n"
                  f"groups started and cross-checked against parallel_state in {result.startup_s:.1f}s")
        for group in (actor, critic):
            report = group.startup_report()
            if report is not None:
                _say(out, report.format())
        if cfg.hang_rank is not None:
            bar.set_description("hang drill")
            result.hang = run_hang_drill(actor, cfg.hang_rank)
            _say(out, result.hang.format())
        _say(out, _table_header(cfg))
        bar.start_iterations()
        reference = ReferenceModel(tcfg).eval()
        prompts = make_prompts(cfg, tcfg.vocab_size)
        resp = slice(cfg.prompt_length - 1, None)
        source = None
        if cfg.async_staleness is not None:
            plans: dict[tuple[int, ...], Any] = {}

            def refit_replica(view) -> int:
                key = view.selection.replicas
                if key not in plans:
                    plans[key] = plan_between(actor, view)
                return refit(actor, view, plans[key]).bytes_moved

            source = AsyncRollout(rollout, prompts, cfg.async_staleness, cfg.iterations, refit_replica, cfg.call_timeout_s)
        t_first = time.perf_counter()
        for it in range(cfg.iterations):
            if cfg.duration_s is not None and it and time.perf_counter() - t_first >= cfg.duration_s:
                break
            bar.set_description(f"iteration {it + 1}/{cfg.iterations}")
            times: dict[str, float] = {}

            def timed(name: str, fn, *args):
                t = time.perf_counter()
                value = fn(*args)
                times[name] = time.perf_counter() - t
                return value

            t_iter = time.perf_counter()
            if source is None:
                batch = timed("gen", rollout.generate_sequences, prompts)
            else:  # rows as the replicas finish them, at most K versions old
                batch = timed("gen", source.take, it)
            batch = batch.union(timed("logp", actor.compute_log_prob, batch))
            batch = batch.union(timed("ref", ref.compute_ref_log_prob, batch))
            batch = batch.union(timed("values", critic.compute_values, batch))
            t = time.perf_counter()
            with torch.no_grad():
                expected = token_log_probs(reference(batch.batch["input_ids"]), batch.batch["input_ids"])[:, resp]
            lp, ref_lp = batch.batch["log_probs"], batch.batch["ref_log_prob"]
            # The actor against one process holding the actor's current (gathered) weights.
            current = ReferenceModel(tcfg).eval()
            current.load_state_dict(gathered_actor_weights(actor)[0])
            with torch.no_grad():
                expected_actor = token_log_probs(current(batch.batch["input_ids"]), batch.batch["input_ids"])[:, resp]
            scores = score_responses(batch.batch["responses"], tcfg.vocab_size)
            adv, returns = group_advantages(scores, cfg.samples_per_prompt, cfg.response_length)
            batch = batch.union(DataProto.from_dict({
                "advantages": adv, "returns": returns, "old_log_probs": batch.batch["rollout_log_probs"].clone(),
            }))
            times["adv"] = time.perf_counter() - t
            if cfg.kill_rank is not None and it + 1 == cfg.kill_at_iteration:
                pid = kill_actor_rank(actor, cfg.kill_rank)
                _say(out, f"--kill-rank {cfg.kill_rank}: actor rank {cfg.kill_rank} (pid {pid}) is killed on entering "
                          f"update_actor; its group replaces it and retries")
            m_actor = timed("upd_actor", actor.update_actor, batch)
            # The group reports each replacement in one line of its own (a warning); the summary counts them.
            result.replacements += [asdict(report) for report in actor.replacements[len(result.replacements):]]
            m_critic = timed("upd_critic", critic.update_critic, batch)
            actor.weight_version = it + 1
            if source is None:
                result.refit_bytes.append(timed("refit", refit, actor, rollout, plan).bytes_moved)
            else:  # idle replicas behind are refit one by one now, the others when they finish
                timed("refit", source.updated, it + 1)
            times["total"] = time.perf_counter() - t_iter
            if source is None:
                # The update as the next rollout sees it: the refit rollout's log-probs on this batch.
                new_lp = rollout.compute_log_prob(batch).batch["rollout_log_probs"]
            else:  # the rollout is refit replica by replica: see the update through the actor itself
                new_lp = actor.compute_log_prob(batch).batch["log_probs"]
            # Rows made by the weights this step trained (all of them, synchronously) match the actor's.
            made_now = batch.batch["weight_version"] == it
            rollout_diff = (float((batch.batch["rollout_log_probs"] - lp)[made_now].abs().max()) if bool(made_now.any())
                            else float("nan"))
            values_after = critic.compute_values(batch).batch["values"]
            stats = IterationStats(
                iteration=it,
                actor_loss=_mean_metric(m_actor, "actor/pg_loss"),
                critic_loss=_mean_metric(m_critic, "critic/vf_loss"),
                actor_loss_after=ppo_loss(new_lp, batch.batch["old_log_probs"], adv, cfg.clip_ratio),
                critic_loss_after=float(0.5 * (values_after - returns).pow(2).mean()),
                score=float(scores.mean()),
                kl=float((lp - ref_lp).mean()),
                logprob_diff=float((lp - expected_actor).abs().max()),
                ref_diff=float((ref_lp - expected).abs().max()),
                # The rollout generated with the weights of the last refit: they must be the actor's.
                rollout_diff=rollout_diff,
                times=times,
            )
            result.iterations.append(stats)
            _say(out, _table_row(stats))
            bar.update(1)
        bar.set_description("final check")
        if source is not None:
            result.asynchronous = source.finish()
            result.refit_bytes.append(refit(actor, rollout, plan).bytes_moved)  # every replica on the final weights
            new_lp = rollout.compute_log_prob(batch).batch["rollout_log_probs"]
        weights, result.replica_max_diff = gathered_actor_weights(actor)
        result.final_weights_sha256 = weights_digest(weights)
        trained = ReferenceModel(tcfg).eval()
        trained.load_state_dict(weights)
        final = actor.compute_log_prob(batch).batch["log_probs"]
        with torch.no_grad():
            final_ref = token_log_probs(trained(batch.batch["input_ids"]), batch.batch["input_ids"])[:, resp]
        result.final_logprob_max_diff = float((final - final_ref).abs().max())
        result.final_rollout_diff = float((new_lp - final).abs().max())
    finally:
        bar.close()  # and the log handlers it routed through tqdm.write get their streams back
        if ref is not None:
            try:  # colocated: parallel_state goes when its last role lets go
                ref.destroy_megatron()
            except Exception as exc:  # noqa: BLE001 - the processes are stopped next anyway
                logger.warning("ref.destroy_megatron failed: %s", exc)
        for group in (actor, critic):
            if group is not None:
                shutdown_megatron_group(group, processes.stop)
        if rollout is not None:
            processes.stop(rollout)
        if conn is not None:
            conn.close()
    result.total_s = time.perf_counter() - t_start
    _judge(result)
    return result


#: How long a refit is tried again after faults (seconds): a rank of either group may die during
#: it, and a node lost with its agents is only declared dead by the GCS seconds later.
REFIT_RETRY_S = 120.0
#: The pause between two tries of a refit (seconds).
REFIT_PAUSE_S = 0.5


def refit(actor: Any, rollout: Any, plan: Any) -> Any:
    """``reshard(actor, rollout, plan)`` (the rollout, or a replica view of it), again from the start
    while a rank of either group died or was stuck during it (or a destination lost its input with
    a source rank that died after sending), for up to :data:`REFIT_RETRY_S`: a
    refit is two groups' calls, so neither group's own retry covers it, and each group recovers its
    dead ranks on its next call.  The rollout's weights and version are only recorded once a whole
    refit went through."""
    from rankmesh.reshard.run import reshard

    deadline = time.monotonic() + REFIT_RETRY_S
    while True:
        try:
            return reshard(actor, rollout, plan)
        except (*FAULT_ERRORS, WorkerError) as err:
            if time.monotonic() > deadline or not (isinstance(err, FAULT_ERRORS) or lost_input(err)):
                raise
            logger.warning("refit: %s; refitting again (each group recovers first)", str(err).splitlines()[0])
            time.sleep(REFIT_PAUSE_S)


def kill_actor_rank(actor: Any, rank: int) -> int:
    """Arm actor ``rank`` to SIGKILL itself on entering ``update_actor``: before it changes any state; returns its pid.

    Every rank's optimizer step follows the dp gradient all-reduce, which no rank can finish
    without the dead rank's replica, so the survivors abort the step with weights and Adam state
    untouched; the retried update then runs on exactly the state the first attempt saw.
    """
    from rankmesh.backends.ray.recovery import exit_on_next_call

    return exit_on_next_call(actor, rank, "update_actor")


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the weights' names and bytes, in name order (equal digests: bitwise equal weights)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


#: The updates whose losses must fall (the demo's default run): a long run (a soak) stops learning.
LEARNING_CHECKED = DemoConfig.iterations


def _judge(result: DemoResult) -> None:
    tol, its, tally = result.config.tolerance, result.iterations, result.asynchronous
    result.logprob_max_diff = max((s.logprob_diff for s in its), default=float("nan"))
    # Asynchronously, only rows made by the weights a step trains can match the actor's log-probs.
    measured = [s.rollout_diff for s in its if _applies(s.rollout_diff)]
    replicas = max(1, result.rollout_replicas)
    refits_exact = bool(result.refit_bytes) and all(b == result.refit_minimum_bytes for b in result.refit_bytes)
    if tally is not None:
        refits_exact = refits_exact and all(b * replicas == result.refit_minimum_bytes for b in tally.refit_bytes)
    seen = "the refit rollout" if tally is None else "the actor's log-probs"
    # Learning is checked over the first updates: later, every sample of a prompt scores the same
    # (zero advantages, nothing left to learn) and Adam's momentum may lift a batch's loss a little.
    learning = its[:LEARNING_CHECKED]
    first = "" if len(its) <= LEARNING_CHECKED else f" of the first {LEARNING_CHECKED}"
    result.checks = {
        "actor log-probs (3D-parallel) == one process with the actor's weights, every iteration": result.logprob_max_diff <= tol,
        "actor log-probs after training == reference from gathered weights": result.final_logprob_max_diff <= tol,
        "reference log-probs == single-process reference, every iteration": all(s.ref_diff <= tol for s in its),
        ("rollout log-probs == actor log-probs after every refit (same batch)" if tally is None else
         "rollout log-probs of rows made by the weights being trained == actor log-probs, and after the final refit"):
            (len(measured) == len(its) if tally is None else bool(measured))
            and all(d <= tol for d in measured) and result.final_rollout_diff <= tol,
        ("every refit moved exactly the bytes the rollout keeps" if tally is None else
         "every refit moved exactly the bytes its replicas keep (rolling: one replica's)"): refits_exact,
        "dp replicas hold identical weights": result.replica_max_diff <= tol,
        f"actor loss falls with every update{first} (seen through {seen})":
            bool(its) and all(s.actor_loss_after < s.actor_loss for s in learning),
        f"critic loss falls with every update{first}": bool(its) and all(s.critic_loss_after < s.critic_loss for s in learning),
    }
    if tally is not None:
        k = tally.staleness
        result.checks[f"every row trained on is at most {k} version(s) older than the weights it updates"] = (
            len(tally.lags) == len(its) and tally.max_lag <= k)
        result.checks["rows trained + dropped + left over = rows generated"] = (
            tally.rows_trained == len(its) * result.config.prompts * result.config.samples_per_prompt
            and tally.rows_trained + tally.rows_dropped + tally.rows_left == tally.rows_generated)
    if result.hang is not None:
        result.checks["--hang-rank: the timeout names the rank, its coordinates, node and collective"] = result.hang.ok
    if result.config.kill_rank is not None:
        # One replacement, of the killed rank (plus any survivor that stayed blocked, see docs/ray_backend.md).
        result.checks["the killed actor rank was replaced in place and the update retried"] = (
            len(result.replacements) == 1 and result.config.kill_rank in result.replacements[0]["ranks"])
        if result.config.spares:
            result.checks["--spares: a warm spare took the killed rank's place"] = bool(result.replacements) and (
                result.config.kill_rank in result.replacements[0]["from_spares"])


# ----- what the demo prints ------------------------------------------------------------------------

#: The phases of an iteration the demo times (IterationStats.times; --json has each, the table adds some up).
_PHASES = ("gen", "logp", "ref", "values", "adv", "upd_actor", "upd_critic", "refit", "total")


def _applies(value: float) -> bool:
    """False for NaN, the demo's mark of a measurement that does not apply to a row (the table shows ``-``).

    Asynchronously a batch may hold no row made by the weights it trains: its roll diff does not apply.
    """
    return not math.isnan(value)


@dataclass(frozen=True)
class _Column:
    """One column of the table: the group named above it, its header, its width and what it shows of a row."""

    group: str
    header: str
    width: int
    #: A format spec (".2e"), or the most decimals of a fixed-point number, fewer where the width needs it.
    format: str | int
    value: Callable[[IterationStats], float]
    gap: str = " "  # written before the column


#: The table, 116 columns wide: every value a run can show fits its column, so a 120-column
#: terminal does not wrap a row and the columns line up under their headers.
_COLUMNS = (
    _Column("", "iter", 4, "d", lambda s: s.iteration + 1, gap=""),
    _Column("actor loss", "before", 9, ".2e", lambda s: s.actor_loss),
    _Column("", "after", 9, ".2e", lambda s: s.actor_loss_after),
    _Column("critic loss", "before", 8, 5, lambda s: s.critic_loss),
    _Column("", "after", 8, 5, lambda s: s.critic_loss_after),
    _Column("", "score", 5, 3, lambda s: s.score),
    _Column("", "kl", 9, ".2e", lambda s: s.kl),
    _Column("", "logp diff", 9, ".1e", lambda s: s.logprob_diff),
    _Column("", "roll diff", 9, ".1e", lambda s: s.rollout_diff),
    _Column("seconds", "gen", 5, 3, lambda s: s.seconds("gen"), gap=" | "),
    _Column("", "fwd", 5, 3, lambda s: s.seconds("logp", "ref", "values")),
    _Column("", "adv", 5, 3, lambda s: s.seconds("adv")),
    _Column("", "upd", 5, 3, lambda s: s.seconds("upd_actor", "upd_critic")),
    _Column("", "refit", 5, 3, lambda s: s.seconds("refit")),
    _Column("", "total", 5, 3, lambda s: s.seconds("total")),
)


#: The table's width (116): the legend and the summary wrap to it.
_WIDTH = sum(len(c.gap) + c.width for c in _COLUMNS)


def _wrap(text: str, indent: str = "") -> str:
    """``text`` in lines of at most the table's width, each line after the first indented two more."""
    return textwrap.fill(text, width=_WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def _cell(value: float, column: _Column) -> str:
    """``value`` right-aligned in the column's width; ``-`` where it does not apply."""
    if not _applies(value):
        text = "-"
    elif isinstance(column.format, int):
        for decimals in range(column.format, -1, -1):
            text = f"{value:.{decimals}f}"
            if len(text) <= column.width:
                break
    else:
        text = format(value, column.format)
    return text.rjust(column.width)


def _table_header(cfg: DemoConfig) -> str:
    """The legend of the run's mode, wrapped to the table's width, then the header's two lines."""
    groups, names = "", ""
    for c in _COLUMNS:
        names += c.gap
        if c.group:
            groups = groups.ljust(len(names)) + c.group
        names += c.header.rjust(c.width)
    legend = [_wrap(f"{name}: {text}", "  ") for name, text in table_legend(cfg.async_staleness)]
    return "\n".join(["", *legend, groups, names])


def _table_row(s: IterationStats) -> str:
    return "".join(c.gap + _cell(c.value(s), c) for c in _COLUMNS)


def _startup_line(cfg: DemoConfig) -> str:
    """Said before the start-up, which is most of a run: what starts, and that the table follows."""
    actor, _, critic, _, _ = resolve_meshes(cfg)
    rollout, _ = resolve_rollout(cfg)
    return (f"starting the groups (actor+ref: {actor.world_size} ranks, critic: {critic.world_size}, "
            f"rollout: {rollout.world_size}); start-up is most of the run, the table follows")


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a StringIO, a file or a pipe is not)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _say(out: TextIO, text: str) -> None:
    """One of the demo's lines: above the progress bar while it is live, never onto its line, and
    flushed at once (a redirected stdout is block-buffered: a log or a pipe would get it at the end)."""
    tqdm.write(text, file=out)
    out.flush()


class _DemoBar(tqdm):
    """The demo's progress bar: start-up with no count, rate or ETA, then the iterations; no log line lands on it.

    tqdm's rate and ETA assume steps alike, and the start-up (most of a run) is not an iteration:
    during it the bar says what is starting, and it counts from the first iteration on
    (:meth:`start_iterations`).  While the bar is live, the package's log records (the group's one
    line per handled rank death) go above it, as the demo's own lines do (:func:`_say`): the
    console handlers they reach write through ``tqdm.write`` until the bar closes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        super().__init__(*args, **kwargs)
        if not self.disable:
            std = (sys.stdout, sys.stderr)
            self._handlers = [(h, h.stream) for h in _package_handlers()
                              if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in std)]
            for handler, stream in self._handlers:
                handler.setStream(DummyTqdmFile(stream))

    def start_iterations(self) -> None:
        """Count iterations from now, with their rate and ETA: the start-up is not one of them."""
        self.bar_format = None
        self.set_description("iterations", refresh=False)
        self.reset(total=self.total)

    def close(self) -> None:
        super().close()
        for handler, stream in self._handlers:  # the streams they were given
            handler.setStream(stream)
        self._handlers = []


def _package_handlers() -> list[logging.Handler]:
    """The handlers a rankmesh log record reaches: the package logger's, then its ancestors' while it propagates."""
    handlers: list[logging.Handler] = []
    log: logging.Logger | None = logging.getLogger("rankmesh")
    while log is not None:
        handlers += log.handlers
        log = log.parent if log.propagate else None
    return handlers


def _progress_bar(cfg: DemoConfig, file: TextIO) -> _DemoBar:
    """The run's bar on ``file``, live only on a terminal (a redirected stream gets no bar), in its start-up form."""
    return _DemoBar(total=cfg.iterations, desc="starting", unit="iteration", bar_format="{desc}...", file=file,
                    disable=not (cfg.progress and _is_terminal(file)))


def format_summary(result: DemoResult) -> str:
    """The checks, one line each, and the final verdict line."""
    its, tally, cfg = result.iterations, result.asynchronous, result.config
    lines = [""]
    if its:
        k = 0 if tally is None else tally.staleness
        policy = "on-policy" if k == 0 else f"asynchronous: rows up to {k} weight version{'s' if k > 1 else ''} old"
        lines.append(_wrap(f"each update, on its own batch: actor loss {its[0].actor_loss:.3e} -> {its[0].actor_loss_after:.3e} "
                           f"(first) ... {its[-1].actor_loss:.3e} -> {its[-1].actor_loss_after:.3e} (last); critic loss "
                           f"{its[0].critic_loss:.5f} -> {its[0].critic_loss_after:.5f} ... {its[-1].critic_loss:.5f} -> "
                           f"{its[-1].critic_loss_after:.5f}; score {its[0].score:.3f} -> {its[-1].score:.3f} ({policy})"))
        diffs = [d for d in [s.rollout_diff for s in its] + [result.final_rollout_diff] if _applies(d)]
        lines.append(_wrap(f"refits: {len(result.refit_bytes)} x {result.refit_minimum_bytes / 1024:.0f} KiB "
                           f"(the minimum), rollout vs actor log-probs max diff {max(diffs, default=float('nan')):.1e}"))
    if tally is not None:
        per = result.refit_minimum_bytes // max(1, result.rollout_replicas)
        lines.append(_wrap(f"asynchronous, K={tally.staleness}: rows generated {tally.rows_generated}, trained {tally.rows_trained}, "
                           f"dropped as stale {tally.rows_dropped}, left over {tally.rows_left}; lag of the oldest row per step "
                           f"{tally.lags} (at most {tally.staleness}); {len(tally.refit_bytes)} rolling refits x {per / 1024:.0f} KiB"))
    if result.replacements:  # each reported in full when it happened (the group's warning) and in --json
        done = "; ".join(f"ranks {r['ranks']} replaced in place{' by warm spares' if r['from_spares'] else ''} "
                         f"in {r['total_s']:.2f}s" for r in result.replacements)
        cause = "" if cfg.kill_rank is None else f" (--kill-rank {cfg.kill_rank} in iteration {cfg.kill_at_iteration})"
        lines.append(_wrap(f"rank deaths handled: {len(result.replacements)}{cause}: {done}, update_actor retried"))
    lines.append(f"final actor weights sha256 {result.final_weights_sha256[:16]}")
    lines.append(_wrap(f"log-prob max |3D-parallel - single-process|: {result.logprob_max_diff:.2e} over the iterations, "
                       f"{result.final_logprob_max_diff:.2e} after training (tolerance {cfg.tolerance:.0e}); "
                       f"dp replicas differ by {result.replica_max_diff:.1e}"))
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}" for name, ok in result.checks.items()]
    verdict = "PASS" if result.ok else "FAIL"
    lines.append(f"demo {verdict}: {len(its)} iterations in {result.total_s:.1f}s "
                 f"(startup {result.startup_s:.1f}s)")
    return "\n".join(lines)
