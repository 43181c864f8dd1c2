#!/usr/bin/env python
"""Chaos soak: the demo on a namespaced 3-node cluster under a seeded stream of faults, then a count of what was lost.

    sudo python scripts/chaos.py --minutes 20 --seed 1        # the soak: about 30 faults
    sudo python scripts/chaos.py --minutes 2 --faults 3       # a short form (the test suite runs one)
    sudo python scripts/chaos.py --sync --kinds kill,stop     # the synchronous demo, weights vs an undisturbed run

The cluster (:class:`rankmesh.testing.cluster.NetnsCluster`) is a head and two nodes, each its
own network namespace inside a private one: nothing the soak sends leaves it.  The head runs
the controller and the warm spares (node labels); the groups' ranks run on the two nodes, one
replica of each group per node (``parallel_layouts/chaos_3node.yaml``).  The demo runs
inside the head's namespace as this script's ``--drive`` mode (the controller), with every group
(actor+ref, critic, rollout) on ``on_rank_death="replace"``, ``--spares`` warm spares each and
``call_timeout_s`` bounding every call (``on_hang="kill"``).  By default it is the asynchronous
demo (``--async-staleness 1``): rollout replicas generate on their own.

Faults, one in each ``minutes / faults`` seconds (at a moment in the slot's first half drawn by
``--seed``), each of ``--kinds`` once per round, in an order drawn by the seed (a kind that
cannot be injected at its turn waits, and the next is tried):

* ``kill``: SIGKILL of a rank of a random group (mid-call: the demo calls all the time, and the
  megatron groups are mostly inside collectives);
* ``stop``: SIGSTOP of a rank: it answers nothing until its call's timeout, then is killed;
* ``partition``: a node's link cut (its ranks live on, cut off) until Ray declares it dead, then
  healed; the old processes are fenced and end with their raylet;
* ``raylet``: a node's raylet SIGKILLed (its ranks end with it);
* ``add``: after each node fault, the node's remains are removed and a new node is added back, so
  the next node fault has room.

A node fault is only drawn for a node whose loss every group survives (each shard of each group
keeps a live copy elsewhere), and only while all three nodes are up.  A fault counts as
survived when the group(s) of its ranks report a replacement covering them (``add``: when the
new node is up) and the run ends with every row accounted for.  Recovery time is from the fault
to that report; for ``stop`` it includes the call timeout.  The run is bounded: the demo stops
``--minutes`` after its first iteration, the soak kills it at ``--deadline`` without progress
(a hang), and the cluster's watchdog removes everything if this script dies.

At the end it prints faults injected and survived by kind, recovery p50/p95/max, rows generated
= trained + dropped + held (checked), hangs, the demo's own checks and, with ``--sync``, whether
the final weights' digest equals an undisturbed run's.  Exit status 0 only when every target is
met (every fault survived, 0 rows lost, 0 hangs, the demo's checks pass, p95 <= ``--p95-target``).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

logger = logging.getLogger("chaos")

KINDS = ("kill", "stop", "partition", "raylet")
#: The demo's layout: one replica of each group on each worker node
#: (``parallel_layouts/chaos_3node.yaml``).
LAYOUT = "chaos_3node"
#: Where what runs, by node label: the ranks on the worker nodes, the warm spares on the head,
#: with the controller.  The head is never cut off or killed, so a node fault never takes the
#: spares that replace its ranks, and those ranks, on the head, stay out of later node faults'
#: way.  (A spare that refills a rank's old bundle lives on that bundle's worker node.)
LABEL = "rankmesh-chaos"
HEAD = {"num_cpus": 8, "labels": {LABEL: "spares"}}
#: A worker node: CPU tokens (not cores) for its ranks and for a lost node's bundles re-placed.
#: Ray places each new placement group on the node with the most room, so the two worker nodes,
#: equal, get one replica of each group each.
NODE = {"num_cpus": 8, "labels": {LABEL: "ranks"}}


def system_config() -> dict[str, int]:
    """The cluster's Ray system config: the tests' health checks (a lost node declared dead in about
    6 s), and a killed process that does not exit by itself (a stopped one) SIGKILLed after 0.5 s
    instead of Ray's default 5 s (``kill_worker_timeout_milliseconds``): ``on_hang="kill"`` kills
    such a process through Ray."""
    from rankmesh.testing.cluster import TEST_HEALTH_CHECKS

    return {**TEST_HEALTH_CHECKS, "kill_worker_timeout_milliseconds": 500}


#: How often the driver writes its state, and the soak reads it (seconds).
STATE_PERIOD_S = 0.25
#: What a driver writes into its run directory and the soak reads back (and so removes first).
RUN_FILES = ("state.json", "state.json.tmp", "result.json")


# ----- the driver: the demo, inside the head's namespace ----------------------------------------


class _Rows(io.TextIOBase):
    """The demo's output: written to a log, with the table's rows counted (progress for the soak)."""

    def __init__(self, path: Path) -> None:
        self.log = open(path, "a", encoding="utf-8")
        self.rows = 0
        self.last_row_at = time.time()

    def write(self, text: str) -> int:
        self.log.write(text)
        for line in text.splitlines():
            first = line.split()[0] if line.split() else ""
            if first.isdigit():
                self.rows += 1
                self.last_row_at = time.time()
        return len(text)

    def flush(self) -> None:
        self.log.flush()


def _shard(coords: Any) -> list[int]:
    return [coords.tp, coords.cp, coords.ep, coords.pp]


def _group_state(group: Any, seen: dict[int, float]) -> dict[str, Any]:
    """One group's ranks (pid, node, shard) and replacements (with when they were first seen)."""
    ranks = []
    for rank, info in enumerate(group.node_info):
        ranks.append({"rank": rank, "pid": info.get("pid"), "node": info.get("node_ip"),
                      "shard": _shard(group.mesh.rank_coords(rank))})
    reports = []
    for i, report in enumerate(group.replacements):
        seen.setdefault(i, time.time())
        reports.append({"ranks": list(report.ranks), "from_spares": list(report.from_spares), "total_s": report.total_s,
                        "detected_s": report.detected_s, "seen_at": seen[i], "stuck": list(report.stuck)})
    return {"ranks": ranks, "replacements": reports}


def drive(args: argparse.Namespace) -> int:
    """Run the demo (this process is the controller) and keep ``state.json`` up to date for the soak."""
    import ray

    from rankmesh.backends.ray import PoolPerGroup, RayResourcePool, RayWorkerGroup
    from rankmesh.demo import run_demo
    from rankmesh.demo_config import DemoConfig
    from rankmesh.testing.cluster import ADDRESS_ENV

    out_dir = Path(args.drive)
    logging.basicConfig(filename=out_dir / "driver.log", level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ray.init(address=os.environ["RAY_ADDRESS"], _node_ip_address=os.environ[ADDRESS_ENV], logging_level="ERROR")

    groups: dict[str, Any] = {}

    class Recorded(PoolPerGroup):
        """The demo's groups: ranks on the worker nodes, spares on the head; each kept by name for the state file."""

        def start(self, process_on_nodes: Any, ray_cls_with_init: Any, mesh: Any, *, pool_name: str | None = None,
                  spares: int = 0, **group_kwargs: Any) -> Any:
            pool = RayResourcePool(list(process_on_nodes), use_gpu=False, name_prefix=pool_name, spares=spares,
                                   node_labels=NODE["labels"], spare_labels=HEAD["labels"] if spares else None)
            group = RayWorkerGroup(pool, ray_cls_with_init, mesh=mesh, **group_kwargs)
            groups[group_kwargs.get("name_prefix") or f"group{len(groups)}"] = group
            return group

    rows = _Rows(out_dir / "demo.log")
    stop = threading.Event()
    seen: dict[str, dict[int, float]] = {}

    def write_state() -> None:
        while not stop.wait(STATE_PERIOD_S):
            try:
                state = {"t": time.time(), "iterations": rows.rows, "last_iteration_at": rows.last_row_at,
                         "groups": {n: _group_state(g, seen.setdefault(n, {})) for n, g in list(groups.items())}}
            except Exception:  # noqa: BLE001 - a group mid-replacement: the next round reads it
                continue
            tmp = out_dir / "state.json.tmp"
            tmp.write_text(json.dumps(state))
            tmp.replace(out_dir / "state.json")

    threading.Thread(target=write_state, name="chaos-state", daemon=True).start()
    cfg = DemoConfig(
        iterations=args.iterations if args.sync else 100_000, layout=LAYOUT, progress=False, spares=args.spares,
        call_timeout_s=args.call_timeout, async_staleness=None if args.sync else 1,
        duration_s=None if args.sync else args.minutes * 60,
    )
    try:
        result = run_demo(cfg, out=rows, processes=Recorded())
        (out_dir / "result.json").write_text(json.dumps(result.to_json(), default=str))
    finally:
        stop.set()
    return 0 if result.ok else 1


# ----- the soak: faults from outside, into the cluster's namespaces ----------------------------


@dataclass
class Fault:
    """One fault: what, when (wall clock), on what, and when the groups had recovered from it."""

    kind: str
    at: float
    target: str
    victims: dict[str, list[int]] = field(default_factory=dict)  # group -> ranks hit
    node: str | None = None  # the node's name, for node faults and ``add``
    recovered_at: float | None = None
    replaced_in: list[float] = field(default_factory=list)  # each covering replacement's own time (seconds)
    spared: list[bool] = field(default_factory=list)  # whether warm spares took all of that replacement's ranks

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.at


@dataclass
class SoakReport:
    """What the soak saw: the faults, the demo's result, hangs, and the targets met."""

    seed: int
    minutes: float
    faults: list[Fault]
    result: dict[str, Any] | None
    hangs: list[str]
    started_s: float = 0.0  # cluster + demo start-up, until the first iteration
    iterations: int = 0
    undisturbed_digest: str | None = None  # --sync: the same run without faults

    def by_kind(self) -> dict[str, tuple[int, int]]:
        kinds: dict[str, list[int]] = {}
        for f in self.faults:
            counts = kinds.setdefault(f.kind, [0, 0])
            counts[0] += 1
            counts[1] += f.recovered_at is not None
        return {k: (v[0], v[1]) for k, v in kinds.items()}

    def recoveries(self) -> list[float]:
        return sorted(f.recovery_s for f in self.faults if f.recovery_s is not None and f.kind != "add")

    def replacements(self, spared: bool | None = None) -> list[float]:
        """The replacements' own times (seconds): all, or those warm spares served (``spared``) or not."""
        return sorted(t for f in self.faults for t, s in zip(f.replaced_in, f.spared) if spared is None or s == spared)

    def rows(self) -> dict[str, int] | None:
        tally = (self.result or {}).get("asynchronous")
        if not tally:
            return None
        return {k: tally[k] for k in ("rows_generated", "rows_trained", "rows_dropped", "rows_left", "generations_failed")}

    def rows_lost(self) -> int | None:
        rows = self.rows()
        if rows is None:
            return None
        return rows["rows_generated"] - rows["rows_trained"] - rows["rows_dropped"] - rows["rows_left"]

    def digest_equal(self) -> bool | None:
        if self.undisturbed_digest is None or not self.result:
            return None
        return self.result.get("final_weights_sha256") == self.undisturbed_digest

    def targets(self, faults: int, p95_s: float) -> dict[str, bool]:
        recoveries = self.replacements(spared=True)
        met = {
            f"{faults} faults injected": len(self.faults) >= faults,
            "every fault survived": all(f.recovered_at is not None for f in self.faults),
            "0 rows lost": self.rows_lost() in (0, None) and (self.result is not None),
            "0 hangs": not self.hangs,
            "the demo's own checks pass": bool(self.result and self.result.get("ok")),
            f"p95 replacement by a warm spare <= {p95_s:g} s": bool(recoveries) and percentile(recoveries, 95) <= p95_s,
        }
        if self.undisturbed_digest is not None:
            met["final weights == the undisturbed run's"] = bool(self.digest_equal())
        return met


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def format_report(report: SoakReport, faults: int, p95_s: float) -> str:
    lines = [f"chaos soak: seed {report.seed}, {report.minutes:g} min of faults, {report.iterations} iterations "
             f"(start-up {report.started_s:.0f} s)", "", "| fault | injected | survived |", "|---|---|---|"]
    for kind, (n, ok) in sorted(report.by_kind().items()):
        lines.append(f"| {kind} | {n} | {ok} |")
    for name, values in (("fault -> recovered", report.recoveries()),
                         ("replacement by warm spares (the group's own time)", report.replacements(spared=True)),
                         ("replacement needing a new process", report.replacements(spared=False))):
        if values:
            lines.append(f"\n{name}: p50 {percentile(values, 50):.2f} s, p95 {percentile(values, 95):.2f} s, "
                         f"max {max(values):.2f} s ({len(values)})")
    rows = report.rows()
    if rows is not None:
        lines.append(f"\nrows: generated {rows['rows_generated']} = trained {rows['rows_trained']} + dropped "
                     f"{rows['rows_dropped']} + held {rows['rows_left']}: lost {report.rows_lost()} "
                     f"(generations failed and given again: {rows['generations_failed']})")
    lines.append(f"hangs past the deadline: {len(report.hangs)}" + "".join(f"\n  {h}" for h in report.hangs))
    if report.undisturbed_digest is not None:
        lines.append(f"final weights digest == the undisturbed run's: {report.digest_equal()}")
    if report.result is not None:
        failed = [name for name, ok in report.result.get("checks", {}).items() if not ok]
        lines.append("demo checks: " + ("all pass" if not failed else "FAILED: " + "; ".join(failed)))
    lines.append("\nfaults:")
    for f in report.faults:
        took = "not recovered" if f.recovery_s is None else f"recovered in {f.recovery_s:.2f} s"
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(f.at))} {f.kind:9} {f.target}: {took}")
    lines.append("\ntargets:")
    lines.extend(f"  [{'x' if ok else ' '}] {name}" for name, ok in report.targets(faults, p95_s).items())
    return "\n".join(lines)


class Soak:
    """One soak: a cluster, the driver inside it, and the faults injected from outside."""

    def __init__(self, args: argparse.Namespace, out_dir: Path) -> None:
        self.args, self.out_dir = args, out_dir
        self.rng = random.Random(args.seed)
        self.faults: list[Fault] = []
        self.hangs: list[str] = []
        self.cluster: Any = None
        self.driver: subprocess.Popen | None = None
        self.pending_node: tuple[Fault, float] | None = None  # a node fault waiting to be cleaned up and added back
        self.queue: list[str] = []  # the kinds still to come in this round

    # -- the driver -----------------------------------------------------------------------------

    def start_driver(self, run_dir: Path, sync_iterations: int | None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        for old in RUN_FILES:  # an earlier soak's, in the same --out: read back, they would pass for this run's
            (run_dir / old).unlink(missing_ok=True)
        argv = [sys.executable, str(Path(__file__).resolve()), "--drive", str(run_dir), "--minutes", str(self.args.minutes),
                "--spares", str(self.args.spares), "--call-timeout", str(self.args.call_timeout)]
        if sync_iterations is not None:
            argv += ["--sync", "--iterations", str(sync_iterations)]
        log = open(run_dir / "driver.out", "w", encoding="utf-8")
        self.driver = self.cluster.popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def state(self, run_dir: Path) -> dict[str, Any] | None:
        try:
            return json.loads((run_dir / "state.json").read_text())
        except (OSError, ValueError):
            return None

    def wait_first_iteration(self, run_dir: Path) -> dict[str, Any]:
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            state = self.state(run_dir)
            if state and state["iterations"] >= 1:
                return state
            if self.driver.poll() is not None:
                raise RuntimeError(f"the demo ended before its first iteration (exit {self.driver.returncode}); "
                                   f"see {run_dir}/driver.out and driver.log")
            time.sleep(0.5)
        raise RuntimeError(f"no iteration within --startup-timeout {self.args.startup_timeout:g} s; see {run_dir}")

    def finish_driver(self, run_dir: Path, limit_s: float) -> dict[str, Any] | None:
        try:
            self.driver.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self.hangs.append(f"the demo did not end within {limit_s:g} s of the soak's end")
            self.driver.kill()
            self.driver.wait()
        try:
            return json.loads((run_dir / "result.json").read_text())
        except (OSError, ValueError):
            return None

    # -- faults -----------------------------------------------------------------------------------

    def inject_next(self, state: dict[str, Any]) -> Fault | None:
        """The next fault: every kind once per round, in an order drawn from the seed.

        A kind that cannot be injected now (a node fault while another is being recovered, or no
        node whose loss every group survives) waits in the round, and the next one is tried, then
        the kinds already done this round, the least injected first; ``None`` when none can be
        injected now."""
        kinds = [k for k in self.args.kinds if k in KINDS]
        if not self.queue:
            self.queue = list(kinds)
            self.rng.shuffle(self.queue)
        done = sorted((k for k in kinds if k not in self.queue), key=lambda k: sum(f.kind == k for f in self.faults))
        for kind in [*self.queue, *done]:
            fault = self.inject(kind, state)
            if fault is not None:
                if kind in self.queue:
                    self.queue.remove(kind)
                return fault
        return None

    def _open(self) -> list[Fault]:
        return [f for f in self.faults if f.recovered_at is None and f.kind != "add"]

    def pick_rank(self, state: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """A random rank of a group with no fault open, whose process still runs.

        The state can name a rank that died since it was written, or that its group killed as
        collateral of another group's fault (a refit's receiver stuck on a stopped source) and
        replaces only at its next call: such a rank is not a place for a new fault."""
        busy = {g for f in self._open() for g in f.victims}
        choices = [(g, r) for g, s in sorted(state["groups"].items()) if g not in busy for r in s["ranks"]
                   if r.get("pid") and _running(r["pid"])]
        return self.rng.choice(choices) if choices else None

    def node_survivable(self, state: dict[str, Any], address: str) -> dict[str, list[int]] | None:
        """The ranks each group has on node ``address``, if every group keeps a live copy of each of their shards."""
        victims: dict[str, list[int]] = {}
        for name, group in state["groups"].items():
            hit = [r for r in group["ranks"] if r["node"] == address]
            kept = {tuple(r["shard"]) for r in group["ranks"] if r["node"] != address}
            if any(tuple(r["shard"]) not in kept for r in hit):
                return None
            if hit:
                victims[name] = [r["rank"] for r in hit]
        return victims or None

    def inject(self, kind: str, state: dict[str, Any]) -> Fault | None:
        now = time.time()
        if kind in ("kill", "stop"):
            picked = self.pick_rank(state)
            if picked is None:
                return None
            group, rank = picked
            try:
                os.kill(rank["pid"], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            except ProcessLookupError:  # died since pick_rank looked: the next slot's turn
                return None
            return Fault(kind, now, f"{group} rank {rank['rank']} (pid {rank['pid']}, {rank['node']})",
                         {group: [rank["rank"]]})
        if self._open() or self.pending_node is not None or len(self.cluster.nodes) < 3:
            return None
        nodes = [n for n in self.cluster.nodes if not n.head]
        self.rng.shuffle(nodes)
        for node in nodes:
            victims = self.node_survivable(state, node.address)
            if victims is None:
                continue
            if kind == "partition":
                self.cluster.partition(node)
            else:
                from rankmesh.testing.cluster import namespace_pids

                raylets = [p for p in namespace_pids(node.namespace) if _comm(p) == "raylet"]
                if not raylets:
                    continue
                for pid in raylets:
                    os.kill(pid, signal.SIGKILL)
            return Fault(kind, now, f"node {node.name} ({node.address}), ranks {victims}", victims, node.name)
        return None

    def update(self, state: dict[str, Any]) -> None:
        """Mark the faults whose ranks every victim group has replaced since."""
        for fault in self._open():
            seen, used = [], []
            for group, ranks in fault.victims.items():
                reports = [r for r in state["groups"].get(group, {}).get("replacements", []) if r["seen_at"] >= fault.at]
                covered = {rank for r in reports for rank in r["ranks"]}
                if not set(ranks) <= covered:
                    break
                used += [r for r in reports if set(r["ranks"]) & set(ranks)]
                seen.append(max(r["seen_at"] for r in used))
            else:
                fault.recovered_at = max(seen)
                fault.replaced_in = [r["total_s"] for r in used]
                fault.spared = [set(r["ranks"]) <= set(r["from_spares"]) for r in used]

    def follow_node(self) -> None:
        """A node fault recovered from: heal the link, remove the node's remains, add a node back."""
        if self.pending_node is None:
            return
        fault, since = self.pending_node
        if fault.recovered_at is None and time.monotonic() - since < self.args.node_wait:
            return
        node = self.cluster.node(fault.node)
        if fault.kind == "partition":
            self.cluster.heal(node)
            time.sleep(self.args.heal_s)  # the healed raylet finds itself dead and exits; fencing is on the ranks
        self.cluster.kill_node(node)
        t0 = time.time()
        added = self.cluster.add_node(NODE)
        self.faults.append(Fault("add", t0, f"node {added.name} ({added.address})", node=added.name,
                                 recovered_at=time.time()))
        self.pending_node = None

    # -- the run ------------------------------------------------------------------------------------

    def run_once(self, run_dir: Path, sync_iterations: int | None, faults: bool) -> tuple[dict[str, Any] | None, int, float]:
        t0 = time.monotonic()
        self.start_driver(run_dir, sync_iterations)
        state = self.wait_first_iteration(run_dir)
        started = time.monotonic() - t0
        if not faults:
            return self.finish_driver(run_dir, self.args.deadline * 10), state["iterations"], started
        # Fault k is due in its own slot of the minutes, at a seeded moment in the slot's first half.
        interval = self.args.minutes * 60 / max(1, self.args.faults)
        begin = time.monotonic()
        end = begin + self.args.minutes * 60
        due = [begin + interval * (k + 0.5 * self.rng.random()) for k in range(self.args.faults)]
        while time.monotonic() < end and self.driver.poll() is None:
            time.sleep(STATE_PERIOD_S)
            state = self.state(run_dir) or state
            self.update(state)
            if time.time() - state["last_iteration_at"] > self.args.deadline:
                self.hangs.append(f"no iteration for {self.args.deadline:g} s after {state['iterations']} "
                                  f"(open faults: {[f.target for f in self._open()]})")
                self.driver.kill()
                break
            self.follow_node()
            injected = len([f for f in self.faults if f.kind != "add"])
            if injected < len(due) and time.monotonic() >= due[injected]:
                fault = self.inject_next(state)
                if fault is not None:
                    logger.info("fault: %s %s", fault.kind, fault.target)
                    self.faults.append(fault)
                    if fault.node is not None:
                        self.pending_node = (fault, time.monotonic())
        while self.pending_node is not None and self.driver.poll() is None:  # every node back before the end
            time.sleep(STATE_PERIOD_S)
            self.update(self.state(run_dir) or state)
            self.follow_node()
        result = self.finish_driver(run_dir, self.args.deadline + 120)
        final = self.state(run_dir) or state
        self.update(final)
        return result, final["iterations"], started

    def run(self) -> SoakReport:
        from rankmesh.testing.cluster import NetnsCluster

        lifetime = (2 if self.args.sync else 1) * (self.args.minutes * 60 + self.args.startup_timeout) + 900
        with NetnsCluster(nodes=[NODE, NODE], head=HEAD, health=system_config(), lifetime_s=lifetime) as self.cluster:
            undisturbed = None
            if self.args.sync:
                base, _, _ = self.run_once(self.out_dir / "undisturbed", self.args.iterations, faults=False)
                undisturbed = (base or {}).get("final_weights_sha256")
            result, iterations, started = self.run_once(self.out_dir / "soak", self.args.iterations if self.args.sync
                                                        else None, faults=True)
        return SoakReport(self.args.seed, self.args.minutes, self.faults, result, self.hangs, started, iterations,
                          undisturbed)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and runs: not gone, not a zombie, not stopped (``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X", "T", "t")


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=20.0, help="minutes of faults after the first iteration (default 20)")
    p.add_argument("--faults", type=int, default=30, help="how many faults to inject, spread over --minutes (default 30)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", type=lambda s: s.split(","), default=list(KINDS),
                   help=f"fault kinds to draw from (default {','.join(KINDS)}; node faults add a node back after)")
    p.add_argument("--sync", action="store_true", help="the synchronous demo, and its weights against an undisturbed run")
    p.add_argument("--iterations", type=int, default=12, help="--sync: iterations of each run (default 12)")
    p.add_argument("--spares", type=int, default=2, help="warm spares per group (default 2)")
    p.add_argument("--call-timeout", type=float, default=10.0, help="every call's bound, seconds (default 10)")
    p.add_argument("--deadline", type=float, default=180.0, help="no iteration this long is a hang (seconds, default 180)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds until the first iteration (default 600)")
    p.add_argument("--node-wait", type=float, default=60.0,
                   help="seconds a node fault may stay unrecovered before its node is removed and added back anyway")
    p.add_argument("--heal-s", type=float, default=8.0, help="seconds between healing a partition and removing the node")
    p.add_argument("--p95-target", type=float, default=5.0, help="p95 of the replacements' own times, seconds (default 5)")
    p.add_argument("--out", type=Path, default=None, help="directory for logs and state (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    p.add_argument("--drive", default=None, help=argparse.SUPPRESS)  # inside the cluster: run the demo
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drive:
        return drive(args)
    from rankmesh.testing.cluster import unavailable

    why = unavailable()
    if why:
        print(f"chaos: cannot build a namespaced cluster here: {why}", file=sys.stderr)
        return 2
    import tempfile

    out_dir = args.out or Path(tempfile.mkdtemp(prefix="rankmesh-chaos-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logger.info("chaos soak: logs and state under %s", out_dir)
    report = Soak(args, out_dir).run()
    print(format_report(report, args.faults, args.p95_target))
    if args.json:
        args.json.write_text(json.dumps(asdict(report), default=str, indent=1))
    return 0 if all(report.targets(args.faults, args.p95_target).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
