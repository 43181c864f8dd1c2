#!/usr/bin/env python
"""Rows trained per second: a synchronous RL step against asynchronous pipelines with staleness K.

Stand-ins, so that the figures measure the pipeline and not a model: a rollout group of
``--replicas`` dp replicas whose generation sleeps a seeded lognormal time per call (a
long-tailed decode), and a one-rank trainer whose step sleeps ``--train-s``.  A refit is a
call that tells the refitted ranks the new weight version.

* ``sync``: generate on every replica and wait for all (the slowest holds everyone), train,
  refit every replica; repeat.
* ``K=k``: every replica generates on its own (``wg.replica(i)``, non-blocking); the controller
  takes finished rows as they arrive (``rankmesh.wait``), puts them in a ``RowBuffer`` with the
  version that made them, refits a finished replica whose weights are behind before it
  generates again (a rolling refit), and trains on the oldest rows at most ``k`` versions old
  while the replicas keep generating.  A step's rows are taken one micro-batch at a time as they
  arrive (``--micro``), since a step makes the next version only at its optimizer step; a
  replica generates only while its rows can still train (``--greedy``: whenever the budget allows).

Each mode runs ``--steps`` training steps per round; the modes alternate for ``--rounds`` rounds
in one run (the machine is shared and noisy), and the table prints the median rows/s of each,
its ratio to sync, and the ideal computed from the stage times measured in the same run:
sync ideal = rows / (E[slowest replica] + train), async ideal = rows / max(mean generation, train)
(every replica always busy, the trainer never waiting), with the sync runs' generation times.
Staleness is checked on every step: no row trained on is more than ``k`` versions older than the
weights it updates, and rows trained + dropped + left in the buffer = rows generated.

    python scripts/bench_async.py                      # 4 replicas, 3 rounds of 12 steps
    python scripts/bench_async.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import rankmesh  # noqa: E402
from rankmesh import DataProto, Dispatch, RankMesh, RowBuffer, Worker, register  # noqa: E402


class Rollout(Worker):
    """Generation stand-in: sleeps a lognormal time drawn from (seed, replica, call), stamps its version."""

    def __init__(self, seed: int, median_s: float, sigma: float) -> None:
        super().__init__()
        self.seed, self.median_s, self.sigma = seed, median_s, sigma
        self.calls = 0

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO)
    def generate(self, prompts: DataProto) -> DataProto:
        replica = self.rank_info.dp_rank
        rng = np.random.default_rng([self.seed, replica, self.calls])
        self.calls += 1
        took = float(self.median_s * math.exp(self.sigma * rng.standard_normal()))
        time.sleep(took)
        out = DataProto.from_dict({"prompt": prompts.batch["prompt"].clone(), "gen_s": torch.full((len(prompts),), took)})
        return self.stamp_weight_version(out)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def generate_later(self, prompts: DataProto) -> DataProto:
        return self.generate(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def refit(self, version: int) -> None:
        self.weight_version = version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def refit_later(self, version: int) -> None:
        """The refit as a non-blocking call: the replica's next call (its generation) runs after it."""
        self.weight_version = version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def restart(self, seed: int) -> None:
        self.seed, self.calls = seed, 0


class Trainer(Worker):
    """Training stand-in: a step of ``micro`` micro-batches sleeps ``train_s`` in all; answers the versions
    and generation times of the rows it trained on."""

    def __init__(self, train_s: float, micro: int) -> None:
        super().__init__()
        self.train_s, self.micro = train_s, micro

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def train(self, batch: DataProto) -> DataProto:
        """A whole step in one call: every micro-batch's rows are there at its start."""
        time.sleep(self.train_s)
        return self.trained_on(batch)

    @register(dispatch_mode=Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def train_micro(self, batch: DataProto) -> DataProto:
        """One micro-batch of a step (gradients accumulate; the last one's optimizer step makes the next version)."""
        time.sleep(self.train_s / self.micro)
        return self.trained_on(batch)

    @staticmethod
    def trained_on(batch: DataProto) -> DataProto:
        """What the controller checks of a step: the versions and generation times of its rows."""
        return DataProto.from_dict({"weight_version": batch.batch["weight_version"], "gen_s": batch.batch["gen_s"]})


@dataclass
class Run:
    mode: str
    rows_trained: int
    seconds: float
    rows_dropped: int
    max_staleness_seen: int
    gen_s: list[float]

    @property
    def rows_per_s(self) -> float:
        return self.rows_trained / self.seconds


def prompts(rows: int, start: int) -> DataProto:
    return DataProto.from_dict({"prompt": torch.arange(start, start + rows)})


def trained_on(future) -> tuple[list[int], list[float]]:
    """The versions and distinct generation times of the rows one training step took."""
    out = future.get()
    return out.batch["weight_version"].tolist(), sorted(set(out.batch["gen_s"].tolist()))


def run_sync(rollout, trainer, steps: int, rows: int) -> Run:
    gen_s: list[float] = []
    worst = 0
    start = time.monotonic()
    for step in range(steps):
        out = rollout.generate(prompts(rows, step * rows))  # every replica; the slowest decides
        versions, took = trained_on(trainer.train(out))
        gen_s += took
        worst = max(worst, step - min(versions))
        rollout.refit(step + 1)
    return Run("sync", steps * rows, time.monotonic() - start, 0, worst, gen_s)


def run_async(rollout, trainer, steps: int, rows: int, staleness: int, replicas: int, ahead: float, queue: int,
              micro: int, greedy: bool) -> Run:
    """The asynchronous pipeline; ``ahead``: how many steps of rows may be generated (or in flight)
    beyond the step being trained; more rows made early only go stale.  ``micro``: a step's rows are
    taken one micro-batch at a time as they arrive (``rows / micro`` each), not all at the step's
    start, so a row made late in one step can still train a micro-batch of the next; ``queue``
    micro-batches are sent ahead of the one running (a rank runs its calls in order).  A replica
    generates only while its rows are wanted (see ``wanted``); ``greedy`` starts every idle replica
    the budget allows."""
    per = rows // replicas
    part = rows // micro
    views = [rollout.replica(i) for i in range(replicas)]
    held = [0] * replicas  # the weight version each replica generates with
    budget = rows + int(ahead * rows)  # before the first step: its rows, plus the look-ahead
    buffer = RowBuffer(capacity_rows=budget)
    version = trained = made = worst = 0
    gen_s: list[float] = []
    running: dict[int, object] = {}
    idle = list(range(replicas))
    start = time.monotonic()

    submitted = done_parts = 0  # micro-batches sent to the trainer, and finished

    def wanted() -> bool:
        """Whether one more generation's rows could still train: the usable rows held and in flight
        fall short of what the micro-batches not yet sent need, up to the last step that rows of the
        current version may train (``version + staleness``).  Rows beyond that would only go stale,
        and the replica making them would miss the next version."""
        if greedy:
            return True
        need = (version + staleness + 1) * rows - submitted * part
        held_rows = buffer.available(max(0, submitted // micro - staleness))
        return held_rows + per * (len(running) + 1) <= need

    def generate() -> None:
        """Set idle replicas generating while their rows are wanted and the rows made and in flight stay within the budget."""
        nonlocal made
        while idle and buffer.rows + per * (len(running) + 1) <= budget and wanted():
            i = idle.pop(0)
            if held[i] < version:  # a rolling refit: this replica alone, the others keep generating;
                views[i].refit_later(version)  # not waited for: the generation sent next runs after it
                held[i] = version
            running[i] = views[i].generate_later(prompts(per, made))
            made += per

    generate()
    # Micro-batch ``m`` belongs to step ``m // micro``, which updates the weights of version
    # ``m // micro``: its rows must be at least ``m // micro - staleness``.  Up to ``queue``
    # micro-batches wait at the trainer behind the running one, at the price of taking their rows earlier.
    trains: list[object] = []
    finished_trains: list[object] = []
    while trained < steps * rows:
        done, _ = rankmesh.wait(list(running.values()) + trains[:1])
        for i, fut in list(running.items()):
            if fut in done:
                buffer.put(running.pop(i), version=held[i], block=False)  # a reference: nothing fetched
                idle.append(i)
        if trains and trains[0] in done:
            finished_trains.append(trains.pop(0))
            done_parts += 1
            version = done_parts // micro  # the last micro-batch's optimizer step makes the next version
        while (submitted < steps * micro and submitted - done_parts <= queue
               and buffer.available(submitted // micro - staleness) >= part):
            step = submitted // micro
            taken = buffer.take(part, min_version=max(0, step - staleness), block=False)
            assert taken.staleness(step) <= staleness, (taken.versions, step)
            trains.append(trainer.train_micro(taken.data))  # the trainer's rank fetches the rows itself
            submitted += 1
        buffer.discard(max(0, submitted // micro - staleness))  # rows no later step may use do not hold the budget
        generate()
        for fut in finished_trains:  # read after the next micro-batch was sent: the trainer does not wait on this
            versions, took = trained_on(fut)
            gen_s += took
            worst = max(worst, trained // rows - min(versions))
            trained += part
        finished_trains.clear()
    seconds = time.monotonic() - start
    for i, fut in running.items():
        fut.get()
        buffer.put(fut, version=held[i], block=False)
    assert made == buffer.put_rows == trained + buffer.dropped_rows + buffer.rows
    return Run(f"K={staleness}", trained, seconds, buffer.dropped_rows, worst, gen_s)


def ideal(runs: list[Run], rows: int, replicas: int, train_s: float) -> dict[str, float]:
    """Rows/s the stage times allow, from the generation times measured in this run.

    ``sync``: one stage after the other, the generation stage lasting its slowest replica.
    ``stages``: the two stages overlapped, a batch's generation still lasting its slowest replica.
    ``async`` (the bound the table holds the modes to): every replica always busy and the trainer
    never waiting, so the mean generation time counts, not the slowest.

    The times come from the sync runs: every generation of a sync run trains, so they are a fair
    sample, while an asynchronous run trains only the rows that did not go stale (the fast ones
    more often) and would understate the mean.
    """
    times = [t for r in runs if r.mode == "sync" for t in r.gen_s]
    mean = statistics.fmean(times)
    rng = np.random.default_rng(0)
    slowest = float(np.mean(rng.choice(times, size=(20000, replicas)).max(axis=1)))
    return {"sync": rows / (slowest + train_s), "stages": rows / max(slowest, train_s), "async": rows / max(mean, train_s),
            "mean_gen_s": mean, "slowest_s": slowest}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32, help="rows per training step (a multiple of --replicas)")
    ap.add_argument("--steps", type=int, default=12, help="training steps per mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--median-s", type=float, default=0.2, help="median generation time of one replica call")
    ap.add_argument("--sigma", type=float, default=0.6, help="lognormal sigma of generation times (the tail)")
    ap.add_argument("--train-s", type=float, default=None, help="training step time (default: the mean generation time)")
    ap.add_argument("--staleness", default="1,2", help="K values to run besides sync")
    ap.add_argument("--ahead", type=float, default=1.0,
                    help="steps of rows the replicas may make beyond the one being trained (default 1)")
    ap.add_argument("--micro", type=int, default=4,
                    help="micro-batches per training step; async modes take each one's rows as they arrive (default 4)")
    ap.add_argument("--queue", type=int, default=1, help="micro-batches sent ahead of the running one (default 1)")
    ap.add_argument("--greedy", action="store_true",
                    help="start every idle replica the budget allows, wanted or not (rows made early go stale)")
    ap.add_argument("--quick", action="store_true", help="1 round of 6 steps")
    ap.add_argument("--json", help="write the runs and the table here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 6
    if args.rows % args.replicas:
        ap.error(f"--rows {args.rows} must be a multiple of --replicas {args.replicas}")
    if args.micro < 1 or args.rows % args.micro:
        ap.error(f"--micro {args.micro} must be at least 1 and divide --rows {args.rows}")
    if args.queue < 0:
        ap.error(f"--queue {args.queue} must be 0 or more")
    train_s = args.train_s if args.train_s is not None else args.median_s * math.exp(args.sigma ** 2 / 2)
    ks = [int(k) for k in args.staleness.split(",") if k]

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, ensure_ray

    ensure_ray(num_cpus=args.replicas + 2)
    rollout = RayWorkerGroup(RayResourcePool([args.replicas], use_gpu=False),
                             RayClassWithInitArgs(Rollout, 0, args.median_s, args.sigma), mesh=RankMesh(dp=args.replicas))
    trainer = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(Trainer, train_s, args.micro))
    warm = prompts(args.rows, 0)
    trainer.train(rollout.generate(warm)).get()  # imports (tensordict) and first calls, outside the timings
    runs: list[Run] = []
    modes = ["sync", *[f"K={k}" for k in ks]]
    for rnd in range(args.rounds):
        for mode in modes:
            rollout.restart(1000 * rnd + 7)  # every mode of a round draws the same generation times
            rollout.refit(0)
            if mode == "sync":
                runs.append(run_sync(rollout, trainer, args.steps, args.rows))
            else:
                runs.append(run_async(rollout, trainer, args.steps, args.rows, int(mode[2:]), args.replicas, args.ahead, args.queue,
                                         args.micro, args.greedy))
            r = runs[-1]
            print(f"round {rnd + 1} {mode:>5}: {r.rows_per_s:7.1f} rows/s  ({r.seconds:.2f} s, dropped {r.rows_dropped}, "
                  f"max staleness {r.max_staleness_seen})", flush=True)
    rollout.shutdown()
    trainer.shutdown()

    best = ideal(runs, args.rows, args.replicas, train_s)
    sync = statistics.median(r.rows_per_s for r in runs if r.mode == "sync")
    table = []
    print(f"\n{args.replicas} replicas, {args.rows} rows/step, generation lognormal(median {args.median_s} s, sigma "
          f"{args.sigma}): mean {best['mean_gen_s']:.3f} s, slowest of {args.replicas} {best['slowest_s']:.3f} s; "
          f"train {train_s:.3f} s")
    print(f"{'mode':>6} {'rows/s':>8} {'x sync':>7} {'ideal':>8} {'of ideal':>9} {'of stages':>10} {'dropped':>8} {'max lag':>8}")
    for mode in modes:
        mine = [r for r in runs if r.mode == mode]
        rate = statistics.median(r.rows_per_s for r in mine)
        top = best["sync"] if mode == "sync" else best["async"]
        row = {"mode": mode, "rows_per_s": rate, "x_sync": rate / sync, "ideal_rows_per_s": top, "of_ideal": rate / top,
               "of_stages_ideal": rate / best["stages"],
               "dropped": sum(r.rows_dropped for r in mine), "max_staleness": max(r.max_staleness_seen for r in mine)}
        table.append(row)
        print(f"{mode:>6} {rate:8.1f} {rate / sync:7.2f} {top:8.1f} {rate / top:9.0%} {rate / best['stages']:10.0%} "
              f"{row['dropped']:8d} {row['max_staleness']:8d}")
    result = {"args": vars(args), "train_s": train_s, "ideal": best, "table": table,
              "runs": [{**asdict(r), "rows_per_s": r.rows_per_s} for r in runs]}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
