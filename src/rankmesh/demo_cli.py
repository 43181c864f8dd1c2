"""``rankmesh demo``: the demo's options, entry point and exit codes (the run itself is :mod:`rankmesh.demo`).

Importing this module is cheap (the options come from :mod:`rankmesh.demo_config`): the run's
module, and with it torch, Ray and megatron-core, loads only when the command runs.
Exit codes: 0 every self-check passed, 1 a check failed, 2 bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from typing import Any, Sequence, TextIO

from rankmesh.demo_config import ASYNC_TABLE_LEGEND, SIZE_OPTIONS, TABLE_LEGEND, DemoConfig
from rankmesh.demo_hang import check_hang_rank
from rankmesh.errors import RankMeshError, UsageError
from rankmesh.tracing import check_trace_path, trace
from rankmesh.validate import writable_file

HELP = "run the actor/critic PPO demo on local Ray (CPU, megatron-core); exit 1 if a self-check fails"
"""The one-line help of ``rankmesh demo``."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``rankmesh demo`` and scripts/launch_actor_critic.py)."""
    d = DemoConfig()
    parser.add_argument("--iterations", type=int, default=d.iterations, help="PPO iterations, at least 2 (default %(default)s)")
    parser.add_argument("--layout", default=d.layout, help="layout with actor/ref/critic/rollout roles (default %(default)s)")
    parser.add_argument("--no-layout", dest="layout", action="store_const", const=None,
                        help="ignore layouts; use the --actor-*/--critic-*/--rollout-* sizes")
    for name in SIZE_OPTIONS:  # None when not given: a layout and explicit sizes together are an error
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None,
                            help=f"with --no-layout (default {getattr(d, name)})")
    for name in ("prompts", "samples_per_prompt", "prompt_length", "response_length", "micro_batches", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=getattr(d, name),
                            help="(default %(default)s)")
    for name in ("actor_lr", "critic_lr", "clip_ratio", "tolerance"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float, default=getattr(d, name),
                            help="(default %(default)s)")
    parser.add_argument("--hang-rank", dest="hang_rank", type=int, default=None, metavar="R",
                        help="after start-up, actor rank R blocks in a barrier its peers skip; the call's timeout must "
                             "name R, its coordinates and the collective (a self-check), then R is released")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: local Ray on 127.0.0.1)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--kill-rank", dest="kill_rank", type=int, default=None, metavar="R",
                        help="kill actor rank R's process (on entering update_actor); it is replaced in place")
    parser.add_argument("--kill-at-iteration", dest="kill_at_iteration", type=int, default=None, metavar="K",
                        help="the iteration (1-based) in which --kill-rank strikes (default 1)")
    parser.add_argument("--spares", dest="spares", type=int, default=None, metavar="N",
                        help="each group's pool keeps N warm standby processes; a killed rank's place goes to one")
    parser.add_argument("--call-timeout", dest="call_timeout_s", type=float, default=None, metavar="S",
                        help="bound every call of every group to S seconds; a rank still running one past it is killed "
                             "and replaced, and the call retried once")
    parser.add_argument("--async-staleness", dest="async_staleness", type=int, default=None, metavar="K",
                        help="rollout replicas generate on their own; train on rows at most K weight versions old, "
                             "refitting one replica at a time (K=0 gives the synchronous run's batches and weights)")
    parser.add_argument("--trace", dest="trace_path", metavar="PATH",
                        help="record every group call to a Chrome trace (open in ui.perfetto.dev; rankmesh trace summarize PATH)")


#: The one prefix of every error the demo's options cause (exit code 2).
ERROR_PREFIX = "rankmesh demo: error:"


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The DemoConfig the options say (mesh sizes not given take DemoConfig's defaults)."""
    names = DemoConfig.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    values.update({k: v for k, v in vars(args).items()
                   if k in ("layout", "hang_rank", "kill_rank", "kill_at_iteration", "async_staleness")})
    return DemoConfig(**values)


def checked_config(args: argparse.Namespace) -> DemoConfig:
    """:func:`config_from_args`, with every option checked before anything starts; raises UsageError."""
    from rankmesh.demo import check_config, resolve_meshes

    cfg = config_from_args(args)
    check_config(cfg, given=[n for n in SIZE_OPTIONS if getattr(args, n, None) is not None])
    actor = resolve_meshes(cfg)[0]
    if cfg.hang_rank is not None:  # a bad --hang-rank fails now, not after a minute of start-up
        check_hang_rank(cfg.hang_rank, actor)
    if cfg.async_staleness is not None and cfg.async_staleness < 0:
        raise UsageError(f"--async-staleness must be 0 or more (weight versions a row may lag), got {cfg.async_staleness}")
    if cfg.spares < 0:
        raise UsageError(f"--spares must be 0 or more (warm standby processes of each group), got {cfg.spares}")
    if cfg.call_timeout_s is not None and not cfg.call_timeout_s > 0:
        raise UsageError(f"--call-timeout must be a positive number of seconds, got {cfg.call_timeout_s}")
    if getattr(args, "trace_path", None):  # trace()'s own check, now rather than when the demo is done
        check_trace_path(args.trace_path, "--trace", UsageError)
    if getattr(args, "json_path", None):
        writable_file(args.json_path, "--json", UsageError)
    if cfg.kill_at_iteration is not None and cfg.kill_rank is None:
        raise UsageError("--kill-at-iteration needs --kill-rank")
    if cfg.kill_rank is not None:
        cfg.kill_at_iteration = 1 if cfg.kill_at_iteration is None else cfg.kill_at_iteration
        if not 1 <= cfg.kill_at_iteration <= cfg.iterations:
            raise UsageError(f"--kill-at-iteration must be between 1 and --iterations ({cfg.iterations})")
        if not 0 <= cfg.kill_rank < actor.world_size:
            raise UsageError(f"--kill-rank must be an actor rank, 0 to {actor.world_size - 1}")
    return cfg


def run_from_args(args: argparse.Namespace, out: TextIO | None = None, processes: Any = None) -> int:
    """Run with parsed options, print the table and the checks; the exit code is the verdict.

    ``processes``: where the groups run (see :func:`rankmesh.demo.run_demo`; default new ones)."""
    out = out or sys.stdout
    try:
        cfg = checked_config(args)
    except RankMeshError as exc:
        print(f"{ERROR_PREFIX} {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from rankmesh.demo import format_summary, run_demo

    trace_path = getattr(args, "trace_path", None)
    with trace(trace_path) if trace_path else contextlib.nullcontext():
        result = run_demo(cfg, out, processes)
    print(format_summary(result), file=out)
    if trace_path:
        print(f"trace: {trace_path} (open in https://ui.perfetto.dev, or: rankmesh trace summarize {trace_path})", file=out)
    if getattr(args, "json_path", None):
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(result.to_json(), fh, indent=2, default=str)
    return 0 if result.ok else 1


def setup(parser: argparse.ArgumentParser) -> None:
    """Configure the ``rankmesh demo`` subcommand (:mod:`rankmesh.cli` registers it)."""
    add_arguments(parser)
    parser.epilog = ("The table's columns (\"-\" where a value does not apply): "
                     + "; ".join(f"{name}: {text}" for name, text in TABLE_LEGEND)
                     + ". With --async-staleness K: " + "; ".join(f"{name}: {text}" for name, text in ASYNC_TABLE_LEGEND)
                     + ".")
    parser.set_defaults(handler=run_from_args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python scripts/launch_actor_critic.py`` / ``python -m rankmesh.demo_cli``; returns the exit code."""
    from rankmesh import demo

    parser = argparse.ArgumentParser(prog="launch_actor_critic", description=(demo.__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
