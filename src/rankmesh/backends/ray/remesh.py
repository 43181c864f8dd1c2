"""Changing a group's dp size in place: drop the replicas of dead ranks (shrink), add new ones (grow).

Why: a dead rank is replaced in place (:mod:`.recovery`) when a process can be had for it.  When
none can (its node is gone, no other node has room, no spare is left), a data-parallel job can
still go on with one replica fewer, and take it back when capacity returns: every dp replica is
a whole copy of the model, so dropping one loses no state, and a new one copies its state from a
live replica.  Both keep every surviving process and everything in it; what changes is where
each process stands: its rank, the world size, the mesh (``dp`` - lost or + added), its
torch.distributed world and megatron's parallel_state.

Which rank a process gets is the replica arithmetic of :func:`rankmesh.replicas.select_replicas`:
the kept replicas of the old mesh, in order, are the new mesh's replicas ``0..dp'-1`` (shrink);
the old replicas are the new mesh's first ones and the added replicas come after them (grow).
Expert parallelism (``ep > 1``) is refused: its groups span the dense replicas.

Shrink (:func:`shrink_dead_replicas`; the survivors have drained, as for a replacement):

1. **plan** the lost replicas (every dead rank's dp coordinate) and the new mesh; refused with
   :class:`~rankmesh.errors.ShardLostError` when no replica would be left (``dp = 1``, or every
   replica lost a rank), naming the shard and the way out (a checkpoint);
2. **stop** the lost replicas' live ranks; their bundles stay the group's (``HostSet.free_slots``)
   for a later grow or spare;
3. **re-form**: the new rank 0 reserves a fresh MASTER_PORT; every kept process gets its new
   setup (rank, world size, mesh, RANK/WORLD_SIZE), its workers move there
   (:func:`rankmesh.worker.move`) and it rejoins (a MegatronWorker rebuilds parallel_state for
   the new mesh);
4. **re-plan** the controller's side (the executor and every role group) and run the checks
   (megatron: parallel_state cross-checked against the new mesh).

Grow (:func:`grow`): processes first (warm spares, then bundles the group holds without a rank,
then a new STRICT_PACK placement group per replica on any node with room), so that a grow that
cannot get them fails before touching the group; then every rank leaves torch.distributed, the
new processes build their workers and the old ones move and rejoin, each new rank restores from
the live rank holding its shard (:meth:`rankmesh.worker.Worker.restore_from_peer`), and the
checks run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group

from rankmesh.errors import RecoveryError, ShardLostError
from rankmesh.mesh import RankMesh
from rankmesh.replicas import select_replicas

from .forked import kill_host
from .executor import RayExecutor
from .hangs import hang_inspector
from .hosts import HostSet, actor_name, start_host
from .pool import Slot
from .recovery import Recovery, drain, lost_addresses, reform, restore, shard_of
from .spares import refill_spares, spare_order, warm_refs
from .tasks import start_step
from .waiting import fetch_outputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Remesh:
    """Where every process of a group goes when its dp size changes.

    ``moves``: old rank -> new rank of every kept process; ``dropped``: old ranks not kept (the
    lost replicas); ``added``: new ranks without a process yet (the added replicas).
    """

    old: RankMesh
    new: RankMesh
    moves: dict[int, int]
    dropped: tuple[int, ...] = ()
    added: tuple[int, ...] = ()
    lost_replicas: tuple[int, ...] = ()


def shrink_plan(mesh: RankMesh, dead: Sequence[int]) -> Remesh:
    """The group without the dp replicas of ``dead`` ranks; :class:`ShardLostError` if none is left."""
    lost = sorted({mesh.rank_coords(r).dp for r in dead})
    kept = [d for d in range(mesh.size("dp")) if d not in lost]
    if not kept:
        shards = {r: mesh.rank_coords(r) for r in sorted(dead)}
        named = ", ".join(c.rank_text(r) for r, c in shards.items())
        why = "dp = 1" if mesh.size("dp") == 1 else f"every one of the {mesh.size('dp')} dp replicas lost a rank"
        raise ShardLostError(
            f"cannot shrink the group: no dp replica is left without a dead rank ({why}; dead: {named}), so no live "
            "copy of the model remains; restart the group from a checkpoint (e.g. MegatronWorker.load_checkpoint)",
            ranks=sorted(dead),
            shards=shards,
        )
    selection = select_replicas(mesh, kept, "shrink")
    moves = {old: new for new, old in enumerate(selection.ranks)}
    dropped = tuple(r for r in range(mesh.world_size) if r not in moves)
    return Remesh(mesh, selection.mesh, moves, dropped=dropped, lost_replicas=tuple(lost))


def grow_plan(mesh: RankMesh, replicas: int) -> Remesh:
    """The group with ``replicas`` more dp replicas, after the old ones."""
    sizes = mesh.sizes
    new = RankMesh(tp=sizes["tp"], pp=sizes["pp"], cp=sizes["cp"], dp=sizes["dp"] + replicas, order=mesh.order)
    selection = select_replicas(new, range(sizes["dp"]), "grow")  # view rank s is old rank s
    moves = dict(enumerate(selection.ranks))
    added = tuple(r for r in range(new.world_size) if r not in set(moves.values()))
    return Remesh(mesh, new, moves, added=added)


@dataclass
class RemeshReport:
    """What one shrink or grow did, and how long its steps took (seconds, controller clock)."""

    kind: str  # "shrink" or "grow"
    old_mesh: RankMesh
    new_mesh: RankMesh
    lost_replicas: list[int] = field(default_factory=list)  # shrink: the replicas dropped
    dead: list[int] = field(default_factory=list)  # shrink: the dead ranks (old numbering)
    added: list[int] = field(default_factory=list)  # grow: the new ranks
    from_spares: list[int] = field(default_factory=list)  # grow: new ranks whose process was a warm spare
    peers: dict[int, int] = field(default_factory=dict)  # grow: new rank -> the live rank it restored from
    agents_started: list[str] = field(default_factory=list)  # grow: node ids given a node agent for the new ranks
    detected_s: float | None = None
    drain_s: float = 0.0
    start_s: float = 0.0  # grow: processes had (spares taken, new ones started)
    reform_s: float = 0.0
    restore_s: float = 0.0
    check_s: float = 0.0
    total_s: float = 0.0

    def format(self) -> str:
        detected = "" if self.detected_s is None else f"detected in {self.detected_s:.2f}s; "
        if self.kind == "shrink":
            what = f"dropped dp replicas {self.lost_replicas} (dead ranks {self.dead})"
            steps = f"drain {self.drain_s:.2f} + re-form {self.reform_s:.2f} + re-check {self.check_s:.2f}"
        else:
            spares = f", {len(self.from_spares)} from warm spares" if self.from_spares else ""
            what = f"added ranks {self.added}{spares}, restored from ranks {sorted(set(self.peers.values()))}"
            steps = (f"processes {self.start_s:.2f} + drain {self.drain_s:.2f} + re-form {self.reform_s:.2f} + "
                     f"restore {self.restore_s:.2f} + re-check {self.check_s:.2f}")
        return f"{self.kind} {self.old_mesh} -> {self.new_mesh}: {what}; {detected}done in {self.total_s:.2f}s = {steps}"

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        """The :meth:`format` text (seconds to 2 decimals), as ``wg.remeshes`` prints; the fields stay exact."""
        return f"RemeshReport({self.format()})"


def _move_hosts(hosts: HostSet, plan: Remesh, new_actors: dict[int, Any], new_info: dict[int, dict], new_slots: dict[int, Slot]) -> None:
    """Put the processes in their new rank order, with setups for the new mesh (MASTER set by :func:`reform`)."""
    world = plan.new.world_size
    old = (list(hosts.actors), list(hosts.info), list(hosts.slots), list(hosts.setups), list(hosts.names))
    actors, info, slots, setups, names = ([None] * world for _ in range(5))
    template = old[3][0]
    for src, dst in plan.moves.items():
        actors[dst], info[dst], slots[dst], setups[dst], names[dst] = (old[0][src], old[1][src], old[2][src], old[3][src],
                                                                       old[4][src])
    for dst in plan.added:
        actors[dst], info[dst], slots[dst] = new_actors[dst], new_info[dst], new_slots[dst]
        setups[dst], names[dst] = template, actor_name(hosts.name_prefix, dst)
    for rank in range(world):
        env = {**setups[rank].env, "RANK": str(rank), "WORLD_SIZE": str(world)}
        setups[rank] = dataclasses.replace(setups[rank], rank=rank, world_size=world, mesh=plan.new, meshes={}, env=env)
        info[rank] = {**info[rank], "rank": rank}
    hosts.rearrange(actors, info, slots, setups, names)


def _run_checks(recovery: Recovery, executor: RayExecutor, ranks: Sequence[int]) -> None:
    for check in recovery.checks:
        try:
            check()
        except BaseException as exc:
            executor.abandon(RecoveryError(f"the re-meshed group failed its check: {exc}", list(ranks)))
            raise


def shrink_dead_replicas(
    hosts: HostSet, executor: RayExecutor, mesh: RankMesh, recovery: Recovery, dead: set[int], timeout: float,
    versions: Sequence[int], drained: bool = False,
) -> RemeshReport:
    """Drop the dp replicas of the ``dead`` ranks and go on with the others (module docstring, "Shrink").

    ``drained``: the survivors already left torch.distributed (the replacement path drained them
    before finding that no process could be had).  On a failure the group is failed for good.
    """
    t0 = time.monotonic()
    plan = shrink_plan(mesh, sorted(dead))
    report = RemeshReport("shrink", mesh, plan.new, list(plan.lost_replicas), sorted(dead))
    try:
        survivors = [r for r in range(mesh.world_size) if r not in dead]
        if not drained:
            more, _ = drain(executor, survivors, mesh, timeout, lost_addresses(hosts, dead))
            if more - set(plan.dropped):
                # Died while the others drained, in a kept replica: that replica goes too.
                dead |= more
                plan = shrink_plan(mesh, sorted(dead))
                report = RemeshReport("shrink", mesh, plan.new, list(plan.lost_replicas), sorted(dead))
        t1 = time.monotonic()
        report.drain_s = t1 - t0
        for rank in plan.dropped:  # the dead and the lost replicas' live ranks
            kill_host(hosts.actors[rank])
            hosts.free_slot(hosts.slots[rank])
        _move_hosts(hosts, plan, {}, {}, {})
        executor.reshape([plan.new.rank_coords(r) for r in range(plan.new.world_size)],
                         f"shrank {mesh} -> {plan.new} (dp replicas {list(plan.lost_replicas)} dropped)")
        reform(executor, [], list(range(plan.new.world_size)), timeout, moved=True)
        t2 = time.monotonic()
        report.reform_s = t2 - t1
        kept_versions = [v for d, v in enumerate(versions) if d not in plan.lost_replicas]
        for group in recovery.live_groups():
            group._reshape(plan.new, kept_versions)
    except Exception as exc:
        err = exc if isinstance(exc, RecoveryError) else RecoveryError(f"shrinking the group after the death of ranks "
                                                                        f"{sorted(dead)} failed: {exc}", sorted(dead))
        executor.abandon(err)
        if err is exc:
            raise
        raise err from exc
    _run_checks(recovery, executor, list(range(plan.new.world_size)))
    report.check_s = time.monotonic() - t2
    report.total_s = time.monotonic() - t0
    recovery.remeshes.append(report)
    return report


def new_groups(need: int, per_replica: int) -> list[int]:
    """The sizes of the placement groups a grow makes for ``need`` processes that neither a warm
    spare nor a free bundle of the group took: one per whole replica (``per_replica`` bundles on
    one node, as the pool placed the others), then one of the rest, on one node too.  The rest
    is what spares and free bundles left of a replica they began; its ranks then span that node
    and theirs, as a replacement from a spare does.  Nothing for ``need <= 0``."""
    if need <= 0:
        return []
    whole, rest = divmod(need, per_replica)
    return [per_replica] * whole + ([rest] if rest else [])


def _processes_for(hosts: HostSet, plan: Remesh, timeout: float) -> tuple[dict[int, Any], dict[int, dict], dict[int, Slot], list[int]]:
    """A process for every added rank: warm spares, then the group's free bundles, then new placement groups.

    Returns (actors, node infos, bundles, ranks that got a spare).  Nothing of the group is
    touched; on failure what was started here is stopped, spares and free bundles go back, and the
    placement groups made here are removed.
    """
    added = list(plan.added)
    actors: dict[int, Any] = {}
    slots: dict[int, Slot] = {}
    taken: dict[int, Any] = {}  # added rank -> the spare that takes it
    free: list[Slot] = []  # the group's free bundles taken for new processes
    made: list[Any] = []  # placement groups made here, and their bundles
    try:
        for rank, spare in zip(added, spare_order(hosts.spares, None, warm_refs(hosts.spares))):
            hosts.take_spare(spare)
            taken[rank] = spare
            actors[rank], slots[rank] = spare.actor, spare.slot
        left = [r for r in added if r not in actors]
        free += hosts.take_free_slots(len(left))
        new_slots: list[Slot] = []
        per_replica = plan.new.world_size // plan.new.size("dp")
        pool = hosts.pool
        deadline = time.monotonic() + timeout
        for size in new_groups(len(left) - len(free), per_replica):
            pg = placement_group([dict(pool.bundle) for _ in range(size)], strategy="STRICT_PACK",
                                 name=f"{hosts.name_prefix}_grow{len(hosts.pg_ids)}")
            hosts.add_placement_group(pg.id.hex())  # removed with the group, or below if the grow fails
            made.append(pg)
            if not pg.wait(timeout_seconds=max(0.1, deadline - time.monotonic())):
                raise RecoveryError(
                    f"grow: no node has room for {size} x {pool.bundle} (a replica has {per_replica}) within "
                    f"{timeout:g} s; free resources (or add a node), or keep spares (RayResourcePool(..., spares=N))")
            node = ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
            new_slots += [Slot(pg=pg, entry=-1, bundle_index=b, node_id=node, node_ip="") for b in range(size)]
        for rank, slot in zip(left, [*free, *new_slots]):
            actors[rank] = start_host(hosts.pool, slot, None, hosts.name_prefix, False, hosts.options, hosts.forking)
            slots[rank] = slot
        pend = [dataclasses.replace(taken[r].warm, rank=r) if r in taken else start_step(actors[r], r, "node_info", what="start")
                for r in added]
        info = dict(zip(added, fetch_outputs(pend, timeout=timeout, inspect=hang_inspector(actors))))
    except BaseException:
        for rank, actor in actors.items():
            if rank not in taken:
                kill_host(actor)
        hosts.add_spares(list(taken.values()))
        for slot in free:  # the group's bundles go back, whether a process started in one or not
            hosts.free_slot(slot)
        for pg in made:  # and the placement groups made for this grow go
            hosts.drop_placement_group(pg.id.hex())
        raise
    return actors, info, slots, list(taken)


def grow(
    hosts: HostSet, executor: RayExecutor, mesh: RankMesh, recovery: Recovery, replicas: int, timeout: float,
    versions: Sequence[int],
) -> RemeshReport:
    """Add ``replicas`` dp replicas (module docstring, "Grow"); state comes from the live replicas."""
    if hosts.pool is None:
        raise RecoveryError("cannot grow a group attached with from_detached (it has no pool)")
    if executor.failed is not None:
        raise RecoveryError(f"cannot grow the group: it has failed ({executor.failed}); replace or shrink first")
    t0 = time.monotonic()
    plan = grow_plan(mesh, replicas)
    report = RemeshReport("grow", mesh, plan.new, added=list(plan.added))
    actors, info, slots, spared = _processes_for(hosts, plan, timeout)
    report.from_spares = sorted(spared)
    t1 = time.monotonic()
    report.start_s = t1 - t0
    try:
        executor.retire_session()  # calls the ranks were sent and had not started go with the session
        # The new ranks' nodes get node agents while the group drains, re-forms and restores.
        report.agents_started = executor.ready_agents([i.get("node_id") for i in info.values()])
        drain(executor, list(range(mesh.world_size)), mesh, timeout)
        t2 = time.monotonic()
        report.drain_s = t2 - t1
        old_actors = {old: hosts.actors[old] for old in plan.moves}
        _move_hosts(hosts, plan, actors, info, slots)
        moved = [plan.moves[old] for old in old_actors]
        executor.reshape([plan.new.rank_coords(r) for r in range(plan.new.world_size)],
                         f"grew {mesh} -> {plan.new} (ranks {list(plan.added)} added)")
        reform(executor, list(plan.added), moved, timeout, moved=True)
        t3 = time.monotonic()
        report.reform_s = t3 - t2
        # Each new rank restores from the live rank holding its shard (the lowest; old ranks only).
        report.peers = {r: min(p for p in moved if shard_of(plan.new, p) == shard_of(plan.new, r)) for r in plan.added}
        restore(executor, report.peers, timeout)
        t4 = time.monotonic()
        report.restore_s = t4 - t3
        # A new replica's weights are its peers': so is its version.
        copied = {plan.new.rank_coords(r).dp: versions[plan.new.rank_coords(p).dp] for r, p in report.peers.items()}
        new_versions = [versions[d] if d < len(versions) else copied[d] for d in range(plan.new.size("dp"))]
        for group in recovery.live_groups():
            group._reshape(plan.new, new_versions)
    except Exception as exc:
        err = exc if isinstance(exc, RecoveryError) else RecoveryError(f"growing the group by {replicas} replica(s) failed: {exc}")
        executor.abandon(err)
        if err is exc:
            raise
        raise err from exc
    _run_checks(recovery, executor, list(plan.added))
    report.check_s = time.monotonic() - t4
    report.total_s = time.monotonic() - t0
    recovery.remeshes.append(report)
    refill_spares(hosts)
    return report
