#!/usr/bin/env python
"""Fault drill: run rankmesh's failure scenarios against a live local Ray and print a table.

For each scenario: how long until the failure was detected, the error the controller saw (first
line), whether the data stayed intact (inputs unchanged, nothing half-returned, the surviving
group still echoes exactly) and a verdict.  Every scenario is bounded by a timeout; the exit
status is non-zero if any scenario hung, lost data or did not raise what it should.

    python scripts/fault_drill.py                 # all scenarios, node loss included (~1-2 min)
    python scripts/fault_drill.py --no-node-loss  # skip the simulated multi-node scenario
    python scripts/fault_drill.py --json          # JSON instead of the table
    python scripts/fault_drill.py --only-recovery # just the replacement scenarios (~2-3 min)
    python scripts/fault_drill.py --only-recovery --demo-equality  # + the demo killed vs undisturbed

Scenarios: worker raises (several ranks; futures too); worker SIGKILLed while its peer blocks
in a gloo all_reduce; worker exits (os._exit) under a DataProtoFuture; call timeout; pool too
big for the cluster; shutdown and reuse of the pool; bad input; node removed (subprocess driver
on a simulated cluster, see tests/reliability_node_loss.py).  Recovery (``on_rank_death``, see
docs/ray_backend.md): an 8-rank megatron group (tp2·pp2·dp2) whose ranks are killed and replaced
three times in a row, each retried call returning the undisturbed log-probs with the survivors'
pids unchanged, then the same with a warm spare taking each dead rank's place (target 5 s);
replacement impossible (dp = 1); the 8-rank group shrunk by a death (``on_rank_death="shrink"``,
target 10 s) and grown back (``grow(1)``, target 30 s); the actor resumed from checkpoints on two
other meshes (tests/checkpoint_drill.py); node removed and its ranks re-placed on a spare node,
then, with one spare and no room, a spare taking a rank, a node lost with no spare left (shrink)
and a node added back (grow) (simulated cluster).  Their replacement times, split into process start, import,
init, restore and re-check, are printed under the table.

Hang scenarios (a tp2·dp2 group of tests.hang_workers.HangWorker with real gloo groups): stuck in
user code (two ranks sleep in a named function) and stuck in a collective (three ranks wait in
all_reduce on tp and dp groups for a rank that skipped it).  Their note says how long after the
timeout the report came (target <= 2 s) and for how many stuck ranks it named the right
function, or the right operation and group members (target: all).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Ray workers import the drill's worker classes from tests.reliability_workers.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from tests.drivers import DriverError, run_module  # noqa: E402  (after sys.path: the node-loss drivers)

logger = logging.getLogger("fault_drill")

#: Seconds each scenario may take before it counts as hung.
SCENARIO_LIMIT_S = 60.0


@dataclass
class Outcome:
    """One row of the table."""

    scenario: str
    detected_s: float | None
    error: str
    data_intact: bool
    ok: bool
    note: str = ""


@dataclass
class Probe:
    """What a scenario reports back: the error seen, when, whether data survived, and why not ok."""

    error: BaseException | None = None
    detected_s: float | None = None
    data_intact: bool = True
    expected: bool = True
    note: str = ""
    shown: str | None = None  # the error as text, when it was raised in another process


def first_line(exc: BaseException | None) -> str:
    if exc is None:
        return "-"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:120]


def timed(fn: Callable[[], object]) -> tuple[BaseException | None, float]:
    """Run ``fn``; the exception it raised (None if it returned) and the seconds it took."""
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the drill reports whatever comes
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# ----- scenarios ----------------------------------------------------------------------------------


class Drill:
    """Holds the shared 4-rank group; each method is one scenario returning a :class:`Probe`."""

    def __init__(self) -> None:
        from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from rankmesh.mesh import RankMesh
        from tests.reliability_workers import FaultWorker

        self.RayClassWithInitArgs, self.RayResourcePool, self.RayWorkerGroup = RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        self.FaultWorker = FaultWorker
        self.group = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(FaultWorker), mesh=RankMesh(tp=2, dp=2))

    def small_group(self, pool=None):
        pool = pool or self.RayResourcePool([2], use_gpu=False)
        return pool, self.RayWorkerGroup(pool, self.RayClassWithInitArgs(self.FaultWorker), call_timeout_s=SCENARIO_LIMIT_S)

    def echo_intact(self, wg, rows: int = 8) -> bool:
        """The group returns exactly the rows it was sent, and leaves the input alone."""
        from tests.test_reliability_input import fingerprint, rows_fingerprint

        data = batch(rows)
        before = fingerprint(data)
        out = wg.echo(data)
        return rows_fingerprint(out) == rows_fingerprint(data) and fingerprint(data) == before

    def worker_raises(self) -> Probe:
        from rankmesh.errors import WorkerError

        err, took = timed(lambda: self.group.act(["ok", "raise", "ok", "raise"]))
        fut_err, _ = timed(lambda: self.group.echo_nb(batch(8, plan=["raise", "ok", "ok", "ok"])).get())
        good = (
            isinstance(err, WorkerError)
            and err.rank == 1
            and [o.rank for o in err.others] == [3]
            and bool(err.remote_traceback)
            and isinstance(fut_err, WorkerError)
        )
        return Probe(err, took, self.echo_intact(self.group), good)

    def killed_in_allreduce(self) -> Probe:
        from rankmesh.errors import WorkerDiedError

        from tests.test_reliability_input import fingerprint

        pool, wg = self.small_group()
        self.reuse_pool = pool
        self.failed_group = wg
        data = batch(4, plan=["allreduce", "kill"])
        before = fingerprint(data)
        result: list = []
        err, took = timed(lambda: result.append(wg.echo(data)))
        later, later_s = timed(wg.pid)
        good = isinstance(err, WorkerDiedError) and err.ranks == [1] and isinstance(later, WorkerDiedError) and later_s < 1
        return Probe(err, took, not result and fingerprint(data) == before, good, f"next call failed in {later_s:.2f} s")

    def exit_under_future(self) -> Probe:
        from rankmesh.errors import WorkerDiedError

        _, wg = self.small_group()
        try:
            fut = wg.echo_nb(batch(4, plan=["sleep:30", "exit"]))
            err, took = timed(fut.get)
            return Probe(err, took, True, isinstance(err, WorkerDiedError) and wg.failed is not None)
        finally:
            wg.shutdown()

    def call_timeout(self) -> Probe:
        from rankmesh.errors import FetchTimeoutError

        err, took = timed(lambda: self.group.with_timeout(0.5).act(["ok", "sleep:2", "ok", "ok"]))
        good = isinstance(err, FetchTimeoutError) and err.ranks == [1]
        return Probe(err, took, self.echo_intact(self.group), good, "slow rank finishes, group reused")

    def pool_too_big(self) -> Probe:
        from rankmesh.errors import ResourcePoolError

        err, took = timed(lambda: self.RayResourcePool([64], use_gpu=False, ready_timeout=2.0).slots())
        return Probe(err, took, True, isinstance(err, ResourcePoolError))

    def shutdown_and_reuse(self) -> Probe:
        """Shut the failed group of the kill scenario down; a new group on its pool must work."""
        pool = getattr(self, "reuse_pool", None)
        if pool is None:
            return Probe(None, None, False, False, "kill scenario did not run")
        start = time.monotonic()
        self.failed_group.shutdown()
        released = pool._slots is None
        _, wg = self.small_group(pool)
        try:
            intact = self.echo_intact(wg, 4)
        finally:
            wg.shutdown()
        return Probe(None, time.monotonic() - start, intact, released and pool._slots is None, "restart time")

    def bad_input(self) -> Probe:
        from rankmesh.errors import DispatchError, PaddingError

        from tests.test_reliability_input import fingerprint

        data = batch(6)
        before = fingerprint(data)
        start = time.monotonic()
        errors = [timed(lambda v=v: self.group.echo(v))[0] for v in ("not a batch", {"x": [1]}, None, data)]
        list_err, _ = timed(lambda: self.group.act(["ok"] * 3))
        good = all(isinstance(e, DispatchError) for e in errors[:3]) and isinstance(errors[3], PaddingError)
        good = good and isinstance(list_err, DispatchError)
        return Probe(errors[0], time.monotonic() - start, fingerprint(data) == before and self.echo_intact(self.group), good)


class HangDrill:
    """Hang scenarios on a tp2·dp2 group whose ranks built a gloo group per tp and dp group."""

    #: Each stuck call's timeout (seconds): the report must come at most 2 s after it.
    TIMEOUT_S = 1.0
    #: The target for the report: ready at most this long after the timeout.
    TARGET_S = 2.0

    def __init__(self) -> None:
        from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from rankmesh.mesh import RankMesh
        from tests.hang_workers import HangWorker

        self.group = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(HangWorker), mesh=RankMesh(tp=2, dp=2))
        self.group.setup_groups()

    def _stuck(self, plan: list[str], right: Callable[[object], bool], release: list[str]) -> Probe:
        """Run ``plan`` past the timeout; judge each stuck rank's record with ``right``; ``release`` the ranks."""
        from rankmesh.errors import HangError

        err, took = timed(lambda: self.group.with_timeout(self.TIMEOUT_S).act(plan))
        after = took - self.TIMEOUT_S
        hangs = err.hangs if isinstance(err, HangError) else []
        n_right = sum(1 for h in hangs if right(h))
        self.group.act(release)  # the stuck ranks finish, in order, then run their release plan
        intact = self.group.act(["ok"] * 4) == [0, 1, 2, 3]
        good = bool(hangs) and n_right == len(hangs) and after <= self.TARGET_S
        note = f"reported {after:.2f} s after the {self.TIMEOUT_S:g} s timeout; right place for {n_right}/{len(hangs)} stuck ranks"
        return Probe(err, took, intact, good, note)

    def in_user_code(self) -> Probe:
        return self._stuck(
            ["ok", "sleep:3", "ok", "sleep:3"],
            lambda h: h.rank in (1, 3) and h.place is not None and h.place.function == "stuck_in_user_code",
            ["ok"] * 4,
        )

    def in_collective(self) -> Probe:
        # Rank 0 skips: 1 waits on tp [0, 1], 2 on dp [0, 2], and 3 on dp [1, 3] (1 is busy in tp).
        # Expected groups by hand, megatron order on tp2·dp2: rank = tp + 2*dp.
        expected = {1: ("all_reduce", "tp", (0, 1)), 2: ("all_reduce", "dp", (0, 2)), 3: ("all_reduce", "dp", (1, 3))}
        return self._stuck(
            ["skip", "allreduce:tp", "allreduce:dp", "allreduce:dp"],
            lambda h: h.collective is not None and (h.collective.op, h.collective.group, h.collective.ranks) == expected.get(h.rank),
            ["allreduce:tp,dp", "allreduce:dp", "ok", "ok"],
        )


def node_loss() -> Probe:
    """Simulated two-node cluster in a subprocess driver; one node removed mid-call."""
    try:
        report = run_module("tests.reliability_node_loss", timeout=SCENARIO_LIMIT_S + 30)
    except subprocess.TimeoutExpired:
        return Probe(TimeoutError("node-loss driver hung"), None, False, False)
    except DriverError as exc:
        return Probe(RuntimeError(f"driver failed: {str(exc).strip().splitlines()[-1:]}"), None, False, False)
    shown = f"{report.get('error')}: {report.get('message', '')}"[:120]
    good = report.get("error") == "WorkerDiedError" and report.get("ranks") == report.get("ranks_on_victim")
    return Probe(None, report.get("seconds"), True, good and (report.get("seconds") or 99) < 10, shown=shown)


# ----- recovery scenarios (replacing dead ranks in place) -----------------------------------------

#: Seconds an 8-rank megatron scenario may take (start-up included: megatron-core imports per process).
RECOVERY_LIMIT_S = 420.0
#: The target: a dead rank replaced and the group usable again, 8-rank megatron group.
REPLACE_TARGET_S = 30.0
#: With a warm spare: rank death -> group usable again (issue target, 8-rank megatron actor).
SPARE_TARGET_S = 5.0
#: Seconds one demo run may take (start-up of 16 processes dominates).
DEMO_LIMIT_S = 600.0
#: Lines printed under the table: one per replacement, with its time split.
RECOVERY_LINES: list[str] = []


def wait_spares_warm(wg, timeout: float = 120.0) -> float:
    """Seconds until every spare of ``wg`` is warm (a death between two refills would take a cold one)."""
    start = time.monotonic()
    while not all(s.warm for s in wg.spares):
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"spares not warm within {timeout:g} s: {wg.spares}")
        time.sleep(0.1)
    return time.monotonic() - start


def megatron_killed_and_replaced(victims: tuple[int, ...] = (5, 0, 3), spares: int = 0) -> Probe:
    """tp2·pp2·dp2 actor group, on_rank_death="replace": kill a rank on entering compute_log_prob, thrice.

    With ``spares``, the pool keeps that many warm spares and each kill waits until they are warm."""
    import torch

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool
    from rankmesh.backends.ray.recovery import exit_on_next_call
    from rankmesh.data import DataProto
    from rankmesh.megatron.group import collect_reports, start_megatron_group
    from rankmesh.megatron.reference import TinyConfig
    from rankmesh.megatron.roles import ActorWorker
    from rankmesh.mesh import RankMesh

    cfg = TinyConfig()
    start = time.monotonic()
    wg = start_megatron_group(
        RayResourcePool([8], use_gpu=False, spares=spares),
        RayClassWithInitArgs(ActorWorker, model=cfg.to_dict(), lr=1e-3, micro_batches=2),
        RankMesh(tp=2, pp=2, dp=2),
        on_rank_death="replace",
        call_timeout_s=RECOVERY_LIMIT_S,
        progress=False,
    )
    kind = f"with {spares} warm spare(s)" if spares else "no spares"
    RECOVERY_LINES.append(f"8-rank megatron group (tp2·pp2·dp2, {kind}) started and cross-checked in {time.monotonic() - start:.1f} s")
    try:
        ids = torch.randint(0, cfg.vocab_size, (8, 12), generator=torch.Generator().manual_seed(7))
        data = DataProto.from_dict({"input_ids": ids}, meta_info={"prompt_length": 4})
        want = wg.compute_log_prob(data).batch["log_probs"]
        pids = [r.pid for r in collect_reports(wg)]
        equal = kept = True
        worst = 0.0
        target = SPARE_TARGET_S if spares else REPLACE_TARGET_S
        for victim in victims:
            if spares:
                RECOVERY_LINES.append(f"  spares warm {wait_spares_warm(wg):.1f} s after the previous step")
            exit_on_next_call(wg, victim, "compute_log_prob")
            got = wg.compute_log_prob(data).batch["log_probs"]  # dies, is replaced, retried
            equal = equal and torch.equal(got, want)
            now = [r.pid for r in collect_reports(wg)]
            kept = kept and all(now[r] == pids[r] for r in range(8) if r != victim) and now[victim] != pids[victim]
            pids = now
            rep = wg.replacements[-1]
            worst = max(worst, (rep.detected_s or 0.0) + rep.total_s)
            RECOVERY_LINES.append("  " + rep.format())
        RECOVERY_LINES.append(
            f"target ({kind}): dead rank replaced and group usable again <= {target:g} s: worst {worst:.1f} s "
            f"(detection + replacement) -> {'met' if worst <= target else 'MISSED'}"
        )
        good = equal and kept and [r.ranks for r in wg.replacements] == [[v] for v in victims]
        if spares:
            good = good and all(r.from_spares == r.ranks for r in wg.replacements)
        detected = max(r.detected_s or 0.0 for r in wg.replacements)
        return Probe(None, detected, equal, good, shown=f"{len(victims)} replacements, results equal: {equal}, "
                                                         f"survivor pids kept: {kept}")
    finally:
        wg.shutdown()


#: Issue targets for a shrink and a grow (seconds, this machine).
SHRINK_TARGET_S = 10.0
GROW_TARGET_S = 30.0


def megatron_shrunk_and_grown(victim: int = 5) -> Probe:
    """tp2·pp2·dp2 actor group, on_rank_death="shrink": a rank dies, its replica goes (tp2·pp2·dp1), then grow(1)."""
    import torch

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool
    from rankmesh.backends.ray.recovery import exit_on_next_call
    from rankmesh.data import DataProto
    from rankmesh.megatron.group import collect_reports, start_megatron_group
    from rankmesh.megatron.reference import TinyConfig
    from rankmesh.megatron.roles import ActorWorker
    from rankmesh.mesh import RankMesh

    cfg = TinyConfig()
    wg = start_megatron_group(
        RayResourcePool([8], use_gpu=False),
        RayClassWithInitArgs(ActorWorker, model=cfg.to_dict(), lr=1e-3, micro_batches=2),
        RankMesh(tp=2, pp=2, dp=2),
        on_rank_death="shrink",
        call_timeout_s=RECOVERY_LIMIT_S,
        progress=False,
    )
    try:
        ids = torch.randint(0, cfg.vocab_size, (8, 12), generator=torch.Generator().manual_seed(7))
        data = DataProto.from_dict({"input_ids": ids}, meta_info={"prompt_length": 4})
        want = wg.compute_log_prob(data).batch["log_probs"]
        pids = [r.pid for r in collect_reports(wg)]
        exit_on_next_call(wg, victim, "compute_log_prob")
        shrunk_lp = wg.compute_log_prob(data).batch["log_probs"]  # dies, the replica is dropped, retried on dp1
        shrink = wg.remeshes[-1]
        mesh = RankMesh(tp=2, pp=2, dp=2)
        lost = mesh.rank_coords(victim).dp
        kept = [r.pid for r in collect_reports(wg)] == [p for r, p in enumerate(pids) if mesh.rank_coords(r).dp != lost]
        grown = wg.grow(1)
        grown_lp = wg.compute_log_prob(data).batch["log_probs"]
        diff = max(float((shrunk_lp - want).abs().max()), float((grown_lp - want).abs().max()))
        shrink_s = (shrink.detected_s or 0.0) + shrink.total_s
        RECOVERY_LINES.append("  " + shrink.format())
        RECOVERY_LINES.append("  " + grown.format())
        RECOVERY_LINES.append(
            f"target: shrink (detection + re-form) <= {SHRINK_TARGET_S:g} s: {shrink_s:.1f} s -> "
            f"{'met' if shrink_s <= SHRINK_TARGET_S else 'MISSED'}; grow <= {GROW_TARGET_S:g} s: {grown.total_s:.1f} s -> "
            f"{'met' if grown.total_s <= GROW_TARGET_S else 'MISSED'}; all 8 rows answered after each, log-probs "
            f"within {diff:.1e} of the undisturbed ones")
        ok = shrunk_lp.shape == want.shape and diff <= 1e-5 and kept and wg.mesh == mesh and shrink.lost_replicas == [lost]
        return Probe(None, shrink.detected_s, diff <= 1e-5, ok,
                     shown=f"shrunk to {shrink.new_mesh} in {shrink.total_s:.1f} s, grown back in {grown.total_s:.1f} s, "
                           f"survivor pids kept: {kept}")
    finally:
        wg.shutdown()


def resume_on_another_mesh() -> Probe:
    """The actor saved on tp2·pp2·dp2, resumed on tp1·pp2·dp4, then tp4·dp2 (tests/checkpoint_drill.py)."""
    from tests.checkpoint_drill import resume_on_another_mesh as chain

    got = chain()
    meshes = " -> ".join(str(m) for m in got["meshes"])
    RECOVERY_LINES.append(
        f"  resume on another mesh ({meshes}): save {max(got['save_s']):.2f} s, load {max(got['load_s']):.2f} s "
        f"(slowest rank); weights after resuming within {got['max_abs_deviation']:.1e} of the uninterrupted run "
        f"({got['tolerance_used']:.0%} of the tolerance); with reset Adam state "
        f"{got['fresh_optimizer']['ratio']:.0f}x the tolerance (so the state is really restored)")
    return Probe(None, None, got["ok"], got["ok"], shown=f"{len(got['meshes'])} meshes, deviation {got['max_abs_deviation']:.1e}")


def replacement_impossible() -> Probe:
    """tp2 (dp = 1): the dead rank's shard has no live copy -> ShardLostError naming it."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.backends.ray.recovery import exit_on_next_call
    from rankmesh.errors import ShardLostError
    from rankmesh.mesh import RankMesh
    from tests.recovery_workers import StateWorker

    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(StateWorker), mesh=RankMesh(tp=2),
                        on_rank_death="replace", call_timeout_s=SCENARIO_LIMIT_S)
    try:
        exit_on_next_call(wg, 1, "world_sum")
        err, took = timed(lambda: wg.world_sum([1.0, 2.0]))
        later, _ = timed(wg.whoami)  # the group is failed: later calls raise at once
        lost = {r: c.to_dict() for r, c in err.shards.items()} if isinstance(err, ShardLostError) else None
        good = lost == {1: {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 0}}
        return Probe(err, took, True, good and later is not None, note="later calls raise")
    finally:
        wg.shutdown()


def node_removed_and_replaced() -> Probe:
    """Simulated three-node cluster in a subprocess driver: a node removed, its ranks re-placed on the spare one."""
    try:
        report = run_module("tests.recovery_node_loss", timeout=RECOVERY_LIMIT_S)
    except subprocess.TimeoutExpired:
        return Probe(TimeoutError("node-loss recovery driver hung"), None, False, False)
    except DriverError as exc:
        return Probe(RuntimeError(f"driver failed: {str(exc).strip().splitlines()[-1:]}"), None, False, False)
    RECOVERY_LINES.append("  node removed: " + report.get("format", ""))
    shrink = report.get("shrink") or {}
    if shrink.get("shrink"):
        RECOVERY_LINES.append("  then, replace_or_shrink with 1 spare: the spare took rank 3 in "
                              f"{shrink['spare_taken']['seconds']:.2f} s; its node removed with no spare or room left, "
                              f"the group was usable again {shrink['seconds']:.1f} s later (health checks, "
                              "3 s waiting for room, then the shrink): " + shrink["shrink"]["format"])
        RECOVERY_LINES.append(f"  node added back: {shrink['grow']['format']}")
    moved = all(report["nodes_after"][r] not in (None, report["victim"]) for r in report["ranks_on_victim"])
    good = (report.get("result") == [10.0] * 4 and report.get("replaced") == report.get("ranks_on_victim")
            and moved and report.get("survivor_pids_kept")
            and shrink.get("result") == [3.0, 3.0] and shrink.get("result_after_grow") == [10.0] * 4)
    shown = f"ranks {report.get('replaced')} re-placed on node(s) {sorted({report['nodes_after'][r] for r in report['ranks_on_victim']})}"
    return Probe(None, report.get("seconds"), report.get("result") == [10.0] * 4, good, shown=shown)


def demo_equality(kill_rank: int = 5, kill_at: int = 2) -> Probe:
    """``rankmesh demo`` twice, undisturbed and with ``--kill-rank``: final weights and every loss must be equal."""
    import tempfile

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("undisturbed", []), ("killed", ["--kill-rank", str(kill_rank), "--kill-at-iteration", str(kill_at)])):
            path = os.path.join(tmp, f"{name}.json")
            proc = subprocess.run([sys.executable, "-m", "rankmesh", "demo", "--no-progress", "--json", path, *extra],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=DEMO_LIMIT_S)
            if not os.path.exists(path):
                return Probe(RuntimeError(f"{name} demo failed: {proc.stderr.strip().splitlines()[-1:]}"), None, False, False)
            with open(path, encoding="utf-8") as fh:
                runs[name] = json.load(fh)
    a, b = runs["undisturbed"], runs["killed"]
    keys = ("actor_loss", "actor_loss_after", "critic_loss", "critic_loss_after", "score", "kl", "rollout_diff")
    same_losses = [{k: i[k] for k in keys} for i in a["iterations"]] == [{k: i[k] for k in keys} for i in b["iterations"]]
    same_weights = a["final_weights_sha256"] == b["final_weights_sha256"] != ""
    rep_ = b["replacements"][0] if b["replacements"] else {}
    RECOVERY_LINES.append(
        f"target: the demo with a kill (actor rank {kill_rank}, iteration {kill_at}) equals the undisturbed demo: "
        f"weights sha256 {'equal' if same_weights else 'DIFFER'} ({b['final_weights_sha256'][:16]}), losses of all "
        f"{len(b['iterations'])} iterations {'bitwise equal' if same_losses else 'DIFFER'}, both runs' checks "
        f"{'pass' if a['ok'] and b['ok'] else 'FAIL'} -> {'met' if same_losses and same_weights and a['ok'] and b['ok'] else 'MISSED'}"
    )
    good = same_losses and same_weights and a["ok"] and b["ok"]
    return Probe(None, rep_.get("detected_s"), same_losses and same_weights, good,
                 shown=f"replaced {rep_.get('ranks')} in {rep_.get('total_s', 0):.1f} s; equal: {same_losses and same_weights}")


def recovery_scenarios(node_loss: bool, demo: bool = False) -> list[tuple[str, Callable[[], Probe], float]]:
    out = [
        ("killed and replaced x3 (8-rank megatron)", megatron_killed_and_replaced, RECOVERY_LIMIT_S),
        ("killed x3, a warm spare takes each (8-rank megatron)", lambda: megatron_killed_and_replaced(spares=1),
         RECOVERY_LIMIT_S),
        ("replacement impossible (dp = 1)", replacement_impossible, SCENARIO_LIMIT_S),
        ("killed, replica dropped, then grown (8-rank megatron)", megatron_shrunk_and_grown, RECOVERY_LIMIT_S),
        ("resume on another mesh (8-rank megatron, 3 meshes)", resume_on_another_mesh, RECOVERY_LIMIT_S),
    ]
    if node_loss:
        out.append(("node removed: replaced; then spare, no room: shrink, grow", node_removed_and_replaced,
                    RECOVERY_LIMIT_S))
    if demo:
        out.append(("demo killed == demo undisturbed", demo_equality, 2 * DEMO_LIMIT_S + 30))
    return out


def batch(rows: int, **meta):
    import torch

    from rankmesh.data import DataProto

    return DataProto.from_dict({"x": torch.arange(rows), "f": torch.linspace(0, 1, rows)}, meta_info=dict(meta))


# ----- running ------------------------------------------------------------------------------------


def bounded(name: str, fn: Callable[[], Probe], limit: float = SCENARIO_LIMIT_S) -> Outcome:
    """Run one scenario in a thread; past ``limit`` seconds it counts as hung."""
    box: list = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - a scenario that crashes is a failed scenario
            logger.exception("scenario %s crashed", name)
            box.append(Probe(exc, None, False, False, "scenario crashed"))

    thread = threading.Thread(target=target, name=f"drill-{name}", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return Outcome(name, None, f"HUNG: no outcome within {limit:g} s", False, False, "hang")
    p = box[0]
    seconds = None if p.detected_s is None else round(p.detected_s, 2)
    return Outcome(name, seconds, p.shown or first_line(p.error), p.data_intact, p.expected and p.data_intact, p.note)


def table(rows: list[Outcome]) -> str:
    head = ("scenario", "detected s", "error shown (first line)", "data intact", "verdict", "note")
    body = [
        (r.scenario, "-" if r.detected_s is None else f"{r.detected_s:.2f}", r.error, "yes" if r.data_intact else "NO", "ok" if r.ok else "FAIL", r.note)
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--no-node-loss", action="store_true", help="skip the simulated multi-node scenario")
    parser.add_argument("--no-recovery", action="store_true", help="skip the replacement scenarios")
    parser.add_argument("--only-recovery", action="store_true", help="run only the replacement scenarios")
    parser.add_argument("--demo-equality", action="store_true",
                        help="also run rankmesh demo twice (undisturbed, and with --kill-rank 5) and compare (~2-8 min)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rankmesh").setLevel(logging.CRITICAL)  # the table is the output

    import ray

    from rankmesh.backends.ray.runtime import ensure_ray

    started = time.monotonic()
    # Ray prints worker-death notices on stdout; keep stdout for the table / JSON alone.
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    # Scheduling slots, not cores: the 4-rank drill and hang groups stay up while the 8-rank
    # recovery group (and its replacements) start, so 12 would leave the recovery group unplaced.
    ensure_ray(num_cpus=24, object_store_memory=512 << 20, logging_level="ERROR", log_to_driver=False)
    outcomes: list[Outcome] = []
    drill: Drill | None = None
    hangs: list[HangDrill] = []
    try:
        box: list = []
        setup = (Outcome("-", None, "", True, True) if args.only_recovery else
                 bounded("start 4-rank group", lambda: box.append(Drill()) or Probe(None, None, True, True)))
        if args.only_recovery:
            pass
        elif not setup.ok:
            outcomes.append(setup)
        else:
            drill = box[0]
            for name, fn in [
                ("worker raises (2 ranks + future)", drill.worker_raises),
                ("SIGKILL while peer in gloo all_reduce", drill.killed_in_allreduce),
                ("os._exit under a DataProtoFuture", drill.exit_under_future),
                ("call timeout (0.5 s)", drill.call_timeout),
                ("pool too big for the cluster", drill.pool_too_big),
                ("shutdown and reuse the pool", drill.shutdown_and_reuse),
                ("bad input", drill.bad_input),
            ]:
                outcomes.append(bounded(name, fn))
        hang_setup = None if args.only_recovery else bounded("start 4-rank hang group (tp2·dp2, gloo)", lambda: hangs.append(HangDrill()) or Probe(None, None, True, True))
        if hang_setup is None:
            pass
        elif not hang_setup.ok:
            outcomes.append(hang_setup)
        else:
            outcomes.append(bounded("stuck in user code (2 ranks sleep)", hangs[0].in_user_code))
            outcomes.append(bounded("stuck in a collective (3 ranks, tp+dp)", hangs[0].in_collective))
        if not args.no_node_loss and not args.only_recovery:
            outcomes.append(bounded("node removed mid-call (simulated)", node_loss, SCENARIO_LIMIT_S + 40))
        if not args.no_recovery:
            outcomes += [bounded(name, fn, limit) for name, fn, limit in recovery_scenarios(not args.no_node_loss, args.demo_equality)]
    finally:
        hung = any(o.note == "hang" for o in outcomes)
        if drill is not None and not hung:
            drill.group.shutdown()
        if hangs and not hung:
            hangs[0].group.shutdown()
    total = time.monotonic() - started
    sys.stdout = real_stdout
    if args.json:
        print(json.dumps({"seconds": round(total, 1), "scenarios": [asdict(o) for o in outcomes],
                          "recovery": RECOVERY_LINES}, indent=2))
    else:
        print(table(outcomes))
        if RECOVERY_LINES:
            print("\nrecovery (seconds; import = the worker classes, e.g. megatron-core, in the new process):")
            print("\n".join(RECOVERY_LINES))
        print(f"\n{sum(o.ok for o in outcomes)}/{len(outcomes)} scenarios ok in {total:.1f} s")
    code = 0 if all(o.ok for o in outcomes) else 1
    sys.stdout.flush()
    if hung:  # a hung scenario's thread may hold Ray; do not wait for it
        os._exit(code)
    ray.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main())
