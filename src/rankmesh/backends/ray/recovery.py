"""Replacing dead ranks in place: survivors keep their processes, new ones take the dead ranks' places.

A group created with ``on_rank_death="keep"`` (or ``"replace"``) keeps its surviving processes
when a rank dies; :func:`replace_dead_ranks` then rebuilds the group around them, in steps that
:class:`ReplacementReport` times:

1. **find the lost shards first**: each dead rank needs a live rank with the same
   (tp, cp, ep, pp) coordinates (a dp peer) to copy its state from; if one has none (dp = 1, or
   its whole dp group died) nothing is started and :class:`~rankmesh.errors.ShardLostError`
   names the shard, so the user falls back to a checkpoint;
2. **drain**: every survivor leaves torch.distributed once its own call has ended (the call
   that failed with the death, queued before it).  Leaving closes its gloo connections, which
   ends the calls of peers that wait on it (see :mod:`.rejoin`); a survivor still busy after
   ``timeout_s`` is named in a :class:`~rankmesh.errors.RecoveryError` instead of waited for;
3. **start**: a warm spare takes the dead rank's place when the group keeps spares
   (:mod:`.spares`: on the rank's node if one is there, else any); otherwise one new host process
   per dead rank in the rank's own placement-group bundle: on its old node, whose bundle is free
   again since the process died, or, when the node itself is gone, wherever Ray re-placed the
   bundle (a node with room).  A node of theirs that no node agent of the group serves gets
   one now, while they start (:meth:`.executor.RayExecutor.ready_agents`).  When no spare is
   there to take and no shrink to choose, the new processes are asked for before the drain, so
   their start runs while the survivors leave;
4. **re-form**: rank 0 (old or new) reserves a fresh MASTER_PORT (race-free, as at start-up);
   the new processes build their workers from the dead ranks' own setup (same rank, coordinates,
   environment, classes and constructor arguments; colocated roles together) while the
   survivors re-form torch.distributed and rebuild their groups in place;
5. **restore**: each new rank and its live dp peer run ``restore_from_peer`` together
   (:meth:`rankmesh.worker.Worker.restore_from_peer`);
6. **check**: the checks registered on the group run (megatron groups re-check
   parallel_state against the controller's mesh).

On any failure after step 1 the group is failed for good (every process stopped), as after a
death with ``on_rank_death="fail"``.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group_table

from rankmesh.backend import Shared
from rankmesh.errors import RecoveryError, ShardLostError, WorkerDiedError
from rankmesh.mesh import RankCoords, RankMesh

from rankmesh.deadline import Deadline

from .forked import kill_host
from .executor import RayExecutor
from .hangs import hang_inspector
from .hosts import HostSet, start_host
from .spares import prune_dead_spares, refill_spares, take_spares, usable_spares
from .runtime import alive_nodes
from .tasks import start_step
from .waiting import PROCESS_DIED, fetch_outputs

logger = logging.getLogger(__name__)

#: A survivor still busy this long after the last other survivor left is blocked for good (seconds).
STUCK_GRACE_S = 5.0
#: How long a liveness probe waits for an idle rank's answer when no death was recorded (seconds).
PROBE_TIMEOUT = 5.0
#: How long survivors may take to cut their connections to a lost node (control thread: milliseconds).
SEVER_WAIT_S = 5.0
#: With ``on_rank_death="replace_or_shrink"``: how long a dead rank's bundle may take to be placed
#: again (its node gone, Ray looking for room) before the group shrinks instead (seconds).
PLACE_TIMEOUT_S = 3.0


@dataclass
class ReplacementReport:
    """What one replacement did and how long each step took (seconds, controller clock)."""

    ranks: list[int]
    peers: dict[int, int] = field(default_factory=dict)  # new rank -> live peer its state came from
    coords: dict[int, RankCoords] = field(default_factory=dict)  # each replaced rank's place in the mesh
    old_nodes: dict[int, str | None] = field(default_factory=dict)  # node address, before and after
    new_nodes: dict[int, str | None] = field(default_factory=dict)
    #: Node ids where a node agent was started during the replacement, for the next call: new
    #: processes' nodes that no agent of the group served.
    agents_started: list[str] = field(default_factory=list)
    moved: dict[int, bool] = field(default_factory=dict)  # the new process runs on another Ray node
    stuck: list[int] = field(default_factory=list)  # survivors blocked for good, replaced with the dead
    from_spares: list[int] = field(default_factory=list)  # ranks whose place a warm spare took
    #: Per rank taken by a spare: (process start, import) seconds the spare paid before the death.
    spare_paid: dict[int, tuple[float, float]] = field(default_factory=dict)
    new_pids: dict[int, int] = field(default_factory=dict)
    detected_s: float | None = None  # failed call submitted -> WorkerDiedError (set by the retry policy)
    drain_s: float = 0.0  # survivors' calls ended and they left torch.distributed
    start_s: float = 0.0  # new processes up after the drain (Python, Ray and rankmesh imported; a start begun before the drain overlaps it)
    import_s: float = 0.0  # the worker classes imported in the new processes (setup unpickled)
    init_s: float = 0.0  # workers built on the new ranks, survivors rejoined: the world re-formed
    restore_s: float = 0.0
    check_s: float = 0.0
    total_s: float = 0.0

    def format(self) -> str:
        def who(r: int) -> str:
            return f"rank {r}" if r not in self.coords else self.coords[r].rank_text(r)

        where = ", ".join(
            f"{who(r)}: {self.old_nodes.get(r)} -> {self.new_nodes.get(r)}{' (another node)' if self.moved.get(r) else ''} "
            f"(pid {self.new_pids.get(r)}, "
            f"restored from rank {self.peers[r]})" if r in self.peers else who(r)
            for r in self.ranks
        )
        detected = "" if self.detected_s is None else f"detected in {self.detected_s:.2f}s; "
        if self.stuck:
            detected += f"survivors {self.stuck} stayed blocked and were replaced too; "
        if self.from_spares:
            paid = ", ".join(f"{s:.2f} + {i:.2f}" for s, i in self.spare_paid.values())
            detected += f"warm spares took ranks {self.from_spares} (they had paid process start + import {paid} before); "
        start = "spare taken" if set(self.from_spares) == set(self.ranks) else "process start"
        return (
            f"replaced ranks {self.ranks} ({where}): {detected}replaced in {self.total_s:.2f}s = "
            f"drain {self.drain_s:.2f} + {start} {self.start_s:.2f} + import {self.import_s:.2f} + "
            f"init {self.init_s:.2f} + restore {self.restore_s:.2f} + check {self.check_s:.2f}"
        )

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        """The :meth:`format` text (nodes by address, seconds to 2 decimals); the fields stay exact."""
        return f"ReplacementReport({self.format()})"


@dataclass
class Recovery:
    """The recovery state of one group's processes, shared by the role groups spawned from it.

    ``checks`` run after every replacement (zero-argument callables that raise on a mismatch);
    ``reports`` lists every replacement done.
    """

    policy: str = "fail"
    checks: list[Callable[[], Any]] = field(default_factory=list)
    reports: list[ReplacementReport] = field(default_factory=list)
    replacing: bool = False
    #: Every shrink and grow done (:class:`.remesh.RemeshReport`).
    remeshes: list[Any] = field(default_factory=list)
    #: The role groups over these processes (weak references), re-planned when the mesh changes.
    groups: list[weakref.ref] = field(default_factory=list)

    def add_group(self, group: Any) -> None:
        self.groups.append(weakref.ref(group))

    def live_groups(self) -> list[Any]:
        """The role groups still referenced somewhere (a dropped role group needs no re-planning)."""
        alive = [g() for g in self.groups]
        self.groups = [ref for ref, g in zip(self.groups, alive) if g is not None]
        return [g for g in alive if g is not None]


def shard_of(mesh: RankMesh, rank: int) -> RankCoords:
    """Which shard ``rank`` holds (:meth:`~rankmesh.mesh.RankCoords.shard`)."""
    return mesh.rank_coords(rank).shard()


def copy_nodes(hosts: HostSet, mesh: RankMesh, rank: int, live: Sequence[int]) -> set[str]:
    """The nodes where a rank of ``live`` holds a copy of ``rank``'s shard (where its replacement
    should not go: one node's loss would take both copies)."""
    want = shard_of(mesh, rank)
    return {hosts.info[p]["node_id"] for p in live if p != rank and shard_of(mesh, p) == want}


def restore_peers(mesh: RankMesh, dead: Sequence[int]) -> dict[int, int]:
    """Dead rank -> the live rank it restores from: the lowest live one with identical shard coordinates.

    Raises :class:`ShardLostError` naming every shard with no live copy.
    """
    dead_set = set(dead)
    peers, lost = {}, {}
    for rank in sorted(dead_set):
        want = shard_of(mesh, rank)
        live = [p for p in range(mesh.world_size) if p not in dead_set and shard_of(mesh, p) == want]
        if live:
            peers[rank] = live[0]
        else:
            lost[rank] = mesh.rank_coords(rank)
    if lost:
        shards = ", ".join(c.rank_text(r) for r, c in lost.items())
        why = "dp = 1" if mesh.size("dp") == 1 else "every dp copy of it died"
        raise ShardLostError(
            f"cannot replace ranks {sorted(lost)}: no live rank holds the shard of {shards} ({why}), so its "
            "parameters and optimizer state are lost; restart the group from a checkpoint",
            ranks=sorted(lost),
            shards=lost,
        )
    return peers


def restore_rounds(peers: Mapping[int, int]) -> list[dict[int, int]]:
    """Split the (new rank -> peer) pairs into rounds in which each live peer serves one new rank."""
    rounds: list[dict[int, int]] = []
    for rank, peer in sorted(peers.items()):
        for rnd in rounds:
            if peer not in rnd.values():
                rnd[rank] = peer
                break
        else:
            rounds.append({rank: peer})
    return rounds


def probe_dead(hosts: HostSet, timeout: float = PROBE_TIMEOUT) -> set[int]:
    """Ranks whose process is gone, found by pinging every rank (on its control thread: a busy rank answers too)."""
    refs = {a.ping.remote(): r for r, a in enumerate(hosts.actors)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout, fetch_local=False)
    dead = set()
    for ref in ready:
        try:
            ray.get(ref)
        except PROCESS_DIED:
            dead.add(refs[ref])
    return dead


def lost_addresses(hosts: HostSet, dead: Iterable[int]) -> set[str]:
    """The addresses of the dead ranks' nodes that no live node of the cluster has (nodes declared dead).

    On a cluster whose nodes share one address (simulated ones, on 127.0.0.1) there are none."""
    live = {node.get("NodeManagerAddress") for node in alive_nodes().values()}
    return {hosts.nodes[r] for r in dead if hosts.nodes[r]} - live


def sever_lost(executor: RayExecutor, survivors: Sequence[int], addresses: set[str]) -> None:
    """Have ``survivors`` cut their connections to ``addresses`` (nodes declared dead), so that a call
    blocked in a collective with a rank there ends now (:func:`.rejoin.sever`); bounded, best effort."""
    if not addresses or not survivors:
        return
    refs = [executor.hosts.actors[r].sever.remote(sorted(addresses)) for r in survivors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SEVER_WAIT_S)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a survivor that died meanwhile is found by the drain
            logger.info("a survivor could not cut its connections to %s: %s", sorted(addresses), exc)


def drain(executor: RayExecutor, survivors: Sequence[int], mesh: RankMesh, timeout: float,
          lost: set[str] = frozenset()) -> tuple[set[int], set[int]]:
    """Every survivor leaves torch.distributed once the call it runs has ended.

    First each survivor cuts its connections to ``lost`` (the dead ranks' node addresses that
    the cluster declared dead: a partition, where nothing closes them), which ends a call
    blocked on a rank there (:func:`sever_lost`).

    Leaving is a host step (:meth:`.executor.RayExecutor.start_step`): it queues behind the call a
    survivor still runs (the host's lock), so no process group is torn down under a live
    collective.  Returns (ranks found dead meanwhile, survivors that stayed blocked and are to be
    replaced too).  A survivor counts as blocked when no other survivor has finished for
    :data:`STUCK_GRACE_S` while it is still busy (it waits on nothing that will come); it is
    replaced only if a free survivor holds its shard.  Otherwise the drain waits up to
    ``timeout`` and raises :class:`RecoveryError` naming the survivors still busy.
    """
    sever_lost(executor, survivors, lost)
    pending = executor.start_step("leave_distributed", survivors)
    deadline = Deadline.after(timeout)
    died, failed, free = set(), [], set()
    stuck: set[int] = set()
    last = time.monotonic()
    while pending:
        got = executor.watch(pending, deadline.bounded(STUCK_GRACE_S))
        for i, outcome in got.outcomes.items():
            rank = pending[i].rank
            last = time.monotonic()
            if outcome.error is None:
                free.add(rank)
            elif isinstance(outcome.error, PROCESS_DIED):
                died.add(rank)
            else:
                failed.append(f"rank {rank}: {str(outcome.error).strip().splitlines()[-1]}")
        pending = [pending[i] for i in got.unfinished]
        busy = {p.rank for p in pending}
        if busy and time.monotonic() - last >= STUCK_GRACE_S:
            want = {r: shard_of(mesh, r) for r in busy}
            if all(any(shard_of(mesh, p) == c for p in free) for c in want.values()):
                stuck = busy
                break
        if busy and deadline.expired():
            raise RecoveryError(
                f"cannot replace dead ranks: survivor ranks {sorted(busy)} are still busy {timeout:g}s after the "
                "death (blocked in user code, or in a collective that never errors) and no free rank holds their "
                "shard; their main thread must be free to re-form torch.distributed. The group is stopped",
                ranks=sorted(busy),
            )
    if failed:
        raise RecoveryError("cannot replace dead ranks: survivors failed to leave torch.distributed: " + "; ".join(failed))
    if stuck:
        logger.warning("survivor ranks %s stayed blocked %.0fs after their peers left: replacing them too",
                       sorted(stuck), STUCK_GRACE_S)
    return died, stuck


def start_replacements(hosts: HostSet, ranks: Sequence[int], timeout: float,
                       placed: Callable[[list[str]], Any] | None = None) -> dict[int, dict[str, Any]]:
    """Start one host per rank in the rank's bundle (old node, or where Ray re-placed it); their node info.

    ``placed(node_ids)``: told the nodes of the bundles once they are placed, before the hosts
    start (the group starts node agents there meanwhile, :meth:`.executor.RayExecutor.ready_agents`)."""
    return finish_replacements(hosts, begin_replacements(hosts, ranks, timeout, placed), timeout)


def begin_replacements(hosts: HostSet, ranks: Sequence[int], timeout: float,
                       placed: Callable[[list[str]], Any] | None = None) -> dict[int, Any]:
    """The first half of :func:`start_replacements`: each rank's host asked for in its bundle, not waited for."""
    if not ranks:
        return {}
    if hosts.pool is None:
        raise RecoveryError("cannot replace ranks of a group attached with from_detached (it has no pool)", list(ranks))
    slots = hosts.slots
    for rank in ranks:
        kill_host(hosts.actors[rank])  # make sure: a half-dead process holds its bundle
    deadline = Deadline.after(timeout)
    for pg in {id(slots[r].pg): slots[r].pg for r in ranks}.values():
        # A bundle whose node died is rescheduled by Ray onto a node with room.
        if not pg.wait(timeout_seconds=max(0.1, deadline.left())):
            raise RecoveryError(f"the placement group of ranks {list(ranks)} is not placed again within {timeout:g}s "
                                "(no node has room for the lost bundles)", list(ranks))
    if placed is not None:
        tables = {id(slots[r].pg): placement_group_table(slots[r].pg)["bundles_to_node_id"] for r in ranks}
        placed([tables[id(slots[r].pg)].get(slots[r].bundle_index, "") for r in ranks])
    return {r: start_host(hosts.pool, slots[r], r, hosts.name_prefix, hosts.detached, hosts.options, hosts.forking)
            for r in ranks}


def finish_replacements(hosts: HostSet, actors: Mapping[int, Any], timeout: float) -> dict[int, dict[str, Any]]:
    """The second half of :func:`start_replacements`: wait for the hosts :func:`begin_replacements`
    asked for, and put each in its rank's place; their node info."""
    if not actors:
        return {}
    pend = [start_step(a, r, "node_info", what="start") for r, a in actors.items()]
    info = fetch_outputs(pend, deadline=Deadline.after(timeout), inspect=hang_inspector(dict(actors)))
    for (rank, actor), got in zip(actors.items(), info):
        hosts.put_rank(rank, actor, got)
    return dict(zip(actors, info))


def reform(executor: RayExecutor, new: Sequence[int], survivors: Sequence[int], timeout: float,
           moved: bool = False) -> list[tuple[int, int]]:
    """A fresh rendezvous for the whole world: new ranks build their workers, survivors rejoin (host steps).

    ``moved``: the survivors changed rank (a shrink or a grow, :mod:`.remesh`), so each also gets
    its new setup (``hosts.setups``).  Returns each new rank's (classes imported, workers built)
    times on its own clock (ns).
    """
    hosts = executor.hosts
    deadline = Deadline.after(timeout)
    (master,) = executor.step("reserve_master_port", [0], [(True,)], timeout)
    hosts.set_rendezvous(tuple(master))
    env = {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
    pending = executor.start_step("setup", new, [(hosts.setups[r],) for r in new], "setup (replacement)")
    pending += executor.start_step("rejoin_distributed", survivors,
                                   [(env, hosts.setups[r] if moved else None) for r in survivors])
    done = fetch_outputs(pending, deadline=deadline, inspect=executor.inspect, advice=executor.advice)
    return [tuple(d) for d in done[: len(new)]]


def restore(executor: RayExecutor, peers: Mapping[int, int], timeout: float) -> None:
    """Each new rank receives its state from its live peer: over torch.distributed (both ends
    called at once, round by round), then what goes through the object store (each peer's
    ``recovery_state``, handed to its new ranks by reference: the controller never fetches it)."""
    deadline = Deadline.after(timeout)
    for rnd in restore_rounds(peers):
        ranks, args = [], []
        for rank, peer in rnd.items():
            ranks += [rank, peer]
            args += [(peer, False), (rank, True)]
        fetch_outputs(executor.start_step("restore_from_peer", ranks, args), deadline=deadline,
                      inspect=executor.inspect, advice=executor.advice)
    if not peers:
        return
    sources = sorted(set(peers.values()))
    states = dict(zip(sources, executor.start_step("recovery_state", sources)))
    loads = executor.start_step("load_recovery_state", list(peers), [(Shared(states[p].handle),) for p in peers.values()])
    fetch_outputs(loads, deadline=deadline, inspect=executor.inspect, advice=executor.advice)


def check_recoverable(hosts: HostSet, executor: RayExecutor, what: str) -> None:
    """Refuse to ``what`` (replace, shrink) a group that is shut down, failed for good, or stopped by policy."""
    if hosts.closed:
        raise RecoveryError(f"cannot {what}: the group has been shut down")
    failed = executor.failed
    if failed is not None and not isinstance(failed, WorkerDiedError):
        raise RecoveryError(f"cannot {what}: the group failed for good earlier ({failed})")
    if executor.on_rank_death == "fail" and failed is not None:
        raise RecoveryError(
            f"cannot {what}: the group was created with on_rank_death='fail', so its survivors were "
            "stopped; create it with on_rank_death='keep', 'replace', 'shrink' or 'replace_or_shrink'",
            sorted(executor.dead),
        )


def bundles_placed(hosts: HostSet, ranks: Sequence[int], timeout: float) -> bool:
    """Whether the bundles of ``ranks`` are placed (again) within ``timeout``: a new process can start there."""
    deadline = time.monotonic() + timeout
    for pg in {id(hosts.slots[r].pg): hosts.slots[r].pg for r in ranks}.values():
        if not pg.wait(timeout_seconds=max(0.1, deadline - time.monotonic())):
            return False
    return True


def replace_dead_ranks(
    hosts: HostSet, executor: RayExecutor, mesh: RankMesh, recovery: Recovery, timeout: float,
    shrink: Callable[[set[int]], Any] | None = None,
) -> Any:
    """Replace every dead rank of the group in place (see the module docstring); ``None`` if none is dead.

    ``shrink`` (policy ``"replace_or_shrink"``): when neither a spare nor a placed bundle is there
    for a dead rank within :data:`PLACE_TIMEOUT_S`, the drained group is handed to
    ``shrink(dead)`` instead (:func:`.remesh.shrink_dead_replicas`), whose report is returned.
    """
    check_recoverable(hosts, executor, "replace dead ranks")
    t0 = time.monotonic()
    dead = set(executor.dead) or probe_dead(hosts, min(PROBE_TIMEOUT, timeout))
    if not dead:
        return None
    recovery.replacing = True
    early: dict[int, Any] = {}  # rank -> a new host asked for and not yet in the group
    try:
        try:
            peers = restore_peers(mesh, sorted(dead))
            survivors = [r for r in range(len(hosts.actors)) if r not in dead]
            agents_started: list[str] = []

            def placed(node_ids: list[str]) -> None:
                agents_started.extend(executor.ready_agents(node_ids))

            # With no spare to take and no shrink to choose, the dead ranks' new processes start
            # while the survivors drain (forked, a start is about as long as the drain).
            if shrink is None and not usable_spares(hosts.spares):
                early.update(begin_replacements(hosts, sorted(dead), timeout, placed))
            more, stuck = drain(executor, survivors, mesh, timeout, lost_addresses(hosts, dead))
            if more or stuck:  # died while the others drained, or blocked for good: replace them too
                dead |= more | stuck
                peers = restore_peers(mesh, sorted(dead))
                survivors = [r for r in survivors if r not in dead]
            report = ReplacementReport(
                sorted(dead), peers, {r: mesh.rank_coords(r) for r in dead}, old_nodes={r: hosts.nodes[r] for r in dead}
            )
            report.stuck = sorted(stuck)
            old_ids = {r: hosts.info[r].get("node_id") for r in dead}
            t1 = time.monotonic()
            report.drain_s = t1 - t0
            prune_dead_spares(hosts)
            unspared = report.ranks[len(usable_spares(hosts.spares)):]
            if shrink is not None and unspared and not bundles_placed(hosts, unspared, PLACE_TIMEOUT_S):
                logger.warning("no process can be had for ranks %s (no spare, their bundles are not placed within %gs): "
                               "shrinking the group instead", unspared, PLACE_TIMEOUT_S)
                return shrink(dead)
            unstarted = [r for r in report.ranks if r not in early]
            info = take_spares(hosts, unstarted, timeout, {r: copy_nodes(hosts, mesh, r, survivors) for r in unstarted})
            report.from_spares = sorted(info)
            report.spare_paid = {r: (i["spare_start_s"], i["spare_import_s"]) for r, i in info.items()}
            agents_started += executor.ready_agents([i.get("node_id") for i in info.values()])
            early.update(begin_replacements(hosts, [r for r in unstarted if r not in info], timeout, placed))
            info.update(finish_replacements(hosts, early, timeout))
            early.clear()  # the group holds them now
            report.agents_started = agents_started
            t2 = time.monotonic()
            report.start_s = t2 - t1
            report.new_nodes = {r: i.get("node_ip") for r, i in info.items()}
            report.new_pids = {r: i["pid"] for r, i in info.items()}
            report.moved = {r: i.get("node_id") != old_ids[r] for r, i in info.items()}
            sent_ns = time.time_ns()
            built = reform(executor, report.ranks, survivors, timeout)
            t3 = time.monotonic()
            report.import_s = max(0.0, max((imp - sent_ns) / 1e9 for imp, _ in built))
            report.init_s = (t3 - t2) - report.import_s
            restore(executor, peers, timeout)
            t4 = time.monotonic()
            report.restore_s = t4 - t3
        except Exception as exc:
            for actor in early.values():  # asked for, never the group's: nothing else would stop them
                kill_host(actor)
            err = exc if isinstance(exc, RecoveryError) else RecoveryError(f"replacing dead ranks {sorted(dead)} failed: {exc}", sorted(dead))
            executor.abandon(err)
            if err is exc:
                raise
            raise err from exc
        executor.recovered(report.ranks)
        for check in recovery.checks:
            try:
                check()
            except BaseException as exc:
                executor.abandon(RecoveryError(f"the re-formed group failed its check: {exc}", report.ranks))
                raise
        report.check_s = time.monotonic() - t4
        report.total_s = time.monotonic() - t0
        refill_spares(hosts)  # in the background: the group is usable now
    finally:
        recovery.replacing = False
    recovery.reports.append(report)
    return report


def exit_on_next_call(group: Any, rank: int, method: str) -> int:
    """Fault injection (drills, the demo): ``rank`` of ``group`` SIGKILLs itself on entering its next ``method`` call.

    Nothing of that call runs on the rank.  Returns the pid of the process that will die.
    """
    return group.executor.step("exit_on_next_call", [rank], [(group.role, method)], 60.0)[0]
