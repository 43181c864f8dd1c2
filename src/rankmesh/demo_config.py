"""The demo's knobs (:class:`DemoConfig`), its mesh-size options and its table's legend.

Why a module of their own: the ``rankmesh`` command builds every subcommand's options when it
starts, the demo's from these, and that must not import what a run needs (torch, the model, Ray),
so that ``rankmesh layout ...`` and ``rankmesh --help`` start in a fraction of a second.  The run is
:mod:`rankmesh.demo`; the command line, :mod:`rankmesh.demo_cli`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DemoConfig:
    """Knobs of the demo; the defaults finish in about a minute on a 2-core machine."""

    iterations: int = 4
    layout: str | None = "cpu_demo"
    actor_tp: int = 2
    actor_pp: int = 2
    actor_dp: int = 2
    critic_tp: int = 2
    critic_dp: int = 2
    rollout_dp: int = 4
    prompts: int = 8
    samples_per_prompt: int = 4
    prompt_length: int = 4
    response_length: int = 8
    actor_lr: float = 2e-3
    critic_lr: float = 1e-3
    clip_ratio: float = 0.2
    micro_batches: int = 2
    seed: int = 1234
    tolerance: float = 1e-5
    address: str | None = None
    progress: bool = True
    hang_rank: int | None = None  # --hang-rank: rankmesh.demo_hang
    kill_rank: int | None = None  # actor rank whose process is killed (with kill_at_iteration, 1-based)
    kill_at_iteration: int | None = None
    spares: int = 0  # warm standby processes each group's pool keeps (--spares N; a killed rank takes one)
    async_staleness: int | None = None  # --async-staleness K: rankmesh.demo_async (None: the synchronous loop)
    #: Bounds every call of every group (--call-timeout S); a rank still running one past it is
    #: killed and replaced (``on_hang="kill"``), and a blocking call is retried once.
    call_timeout_s: float | None = None
    #: Stop after the first iteration that ends this long after the start (``iterations`` is then
    #: the most it runs): how a soak (``scripts/chaos.py``) runs the demo for a given time.
    duration_s: float | None = None


#: Options that size the meshes without a layout (``--no-layout``); with a layout they would be ignored.
SIZE_OPTIONS = ("actor_tp", "actor_pp", "actor_dp", "critic_tp", "critic_dp", "rollout_dp")


#: What each column of the demo's table measures in the synchronous loop (printed above the table,
#: and in ``--help``).  A value that does not apply to a row shows ``-``.
TABLE_LEGEND = (
    ("actor loss", "the PPO clipped surrogate on the update's own batch, before -> after the update; after: from the "
                   "refit rollout's log-probs (lower is better); before: near 0 (advantages are centred per prompt "
                   "group and the ratio starts at 1)"),
    ("critic loss", "half the mean squared error of the values against the returns, before -> after the critic's update"),
    ("score", "mean reward of the responses"),
    ("kl", "mean actor minus reference log-prob over the response tokens"),
    ("logp diff", "max |actor log-prob - one process holding the actor's gathered weights|"),
    ("roll diff", "max |rollout log-prob - actor log-prob| (the rollout generates with the last refit)"),
    ("seconds", "gen: generation; fwd: actor log-probs, reference log-probs and values; adv: advantages and the "
                "controller's checks; upd: actor and critic updates; refit: the new weights to the rollout; total: "
                "the iteration (every phase apart: --json)"),
)

#: The columns whose meaning changes under ``--async-staleness K``: rows up to K weight versions
#: old, a rollout refit one replica at a time.
ASYNC_TABLE_LEGEND = (
    ("actor loss", "the PPO clipped surrogate on the update's own batch, before -> after the update; after: from the "
                   "actor's log-probs (the rollout is refit one replica at a time); before: the ratio is taken against "
                   "the log-probs of the weights that made each row, so it starts at 1 only for rows the current "
                   "weights made"),
    ("roll diff", "max |rollout log-prob - actor log-prob| over the batch's rows made by the weights being trained, "
                  "\"-\" if the batch holds none (all its rows older, by up to K versions)"),
    ("seconds", "gen: waiting for the batch's rows (replicas that finish behind the actor are refit meanwhile); fwd: "
                "actor log-probs, reference log-probs and values; adv: advantages and the controller's checks; upd: "
                "actor and critic updates; refit: refitting the replicas idle when the update ends; total: the "
                "iteration (every phase apart: --json)"),
)


def table_legend(async_staleness: int | None) -> tuple[tuple[str, str], ...]:
    """The legend of the table a run prints: the synchronous one, or with ``--async-staleness`` its changed columns."""
    if async_staleness is None:
        return TABLE_LEGEND
    changed = dict(ASYNC_TABLE_LEGEND)
    return tuple((name, changed.get(name, text)) for name, text in TABLE_LEGEND)
