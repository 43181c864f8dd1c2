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
    spares: int = 0  # warm standby processes the actor's pool keeps (--spares N; a killed rank takes one)
    async_staleness: int | None = None  # --async-staleness K: rankmesh.demo_async (None: the synchronous loop)


#: Options that size the meshes without a layout (``--no-layout``); with a layout they would be ignored.
SIZE_OPTIONS = ("actor_tp", "actor_pp", "actor_dp", "critic_tp", "critic_dp", "rollout_dp")


#: What each column of the demo's table measures (printed under its header and in ``--help``).
TABLE_LEGEND = (
    ("actor loss", "the PPO clipped surrogate of the update, on its own batch (near 0: advantages are centred per "
                   "prompt group and the ratio starts at 1)"),
    ("-> after", "the same loss from the refit rollout's log-probs after the update (lower is better)"),
    ("critic loss", "half the mean squared error of the values against the returns, before -> after the critic's update"),
    ("score", "mean reward of the responses"),
    ("kl", "mean actor minus reference log-prob over the response tokens"),
    ("logp diff", "max |actor log-prob - one process holding the actor's gathered weights|"),
    ("roll diff", "max |rollout log-prob - actor log-prob| (the rollout generates with the last refit)"),
    ("seconds", "time of each phase (gen, logp, ref, values, adv, upd_actor, upd_critic, refit) and of the iteration"),
)
