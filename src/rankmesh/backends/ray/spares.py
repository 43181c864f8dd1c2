"""Warm spares: standby processes of a group that take a dead rank's place without starting a new one.

Why: on this project's 2-core test machine, replacing a dead rank of an 8-rank megatron group
took 5-7 s, of which ~1.5 s was starting the process and ~2.2 s importing the worker classes
(torch, megatron-core).  A spare pays both before anyone dies.

* **Where they run.** ``RayResourcePool(..., spares=N)`` reserves N standby bundles, spread over
  the nodes (:meth:`.pool.RayResourcePool.spare_slots`).  Each group on the pool whose policy
  replaces dead ranks (``on_rank_death`` ``"keep"`` or ``"replace"``) starts one
  :class:`~.host.WorkerHost` per standby bundle once the group is up, with the group's Ray options,
  and has it import what a rank of the group imports (:meth:`~.host.WorkerHost.warm`).  A spare
  has no rank, no environment and no worker object until it takes a rank's place.
* **Taking one** (:func:`take_spares`, step 3 of :mod:`.recovery`): a dead rank takes a live spare
  on a node that holds no live copy of its shard when there is one (else one node's loss could
  take every copy of the shard), on its own node first, else any live spare (warm ones first).  The spare's bundle
  becomes the rank's (``HostSet.slots``) and the dead rank's bundle, free once its process is
  gone, becomes a standby bundle.  A rank with no spare left gets a new process in its own
  bundle, as without spares.  The re-forming, restoring and checking steps are the same.
* **Refilling** (:func:`refill_spares`): after a replacement, every standby bundle without a
  spare gets a new one, started in the background; the next replacement takes it once warm (or
  waits for it, which is still faster than a cold start).

Not kept for detached groups (their actors are found by name, ``{name_prefix}_{rank}``, and a
spare would change which process holds a name) nor for groups built on running hosts
(:meth:`~.group.RayWorkerGroup.on_hosts`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

import ray
import ray.exceptions as rex
from ray.util import placement_group_table

from .forked import kill_host
from .hosts import HostSet, start_host
from .pool import Slot
from .runtime import alive_nodes
from .tasks import ready_refs, start_step
from .calls import Pending

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpareStatus:
    """One spare as ``wg.spares`` lists it: its node, whether warm yet and its pid once warm.

    ``error`` says why a spare that failed to start or import cannot be used.  Printed with the
    node's address and the first 8 hex digits of its Ray node id; the fields keep the full id.
    """

    node_id: str | None
    node_ip: str | None
    warm: bool = False
    pid: int | None = None
    error: str | None = None

    def __repr__(self) -> str:
        node = " ".join(part for part in (self.node_ip, (self.node_id or "")[:8]) if part) or "not placed yet"
        state = f"failed: {self.error}" if self.error else f"warm, pid {self.pid}" if self.warm else "starting"
        return f"SpareStatus(node {node}: {state})"


@dataclass
class Spare:
    """One standby process: its bundle, its actor and the reference its warm-up answers on."""

    slot: Slot
    actor: Any
    warm: Pending  # the host step ``warm(roles)``: the process's node info once imported
    started: float  # controller clock (time.monotonic) when it was asked to start
    asked_ns: int = 0  # the same moment on the wall clock, to time its start and imports (same machine)

    def describe(self) -> SpareStatus:
        """Node and pid once warm (``warm=False`` and no pid before), asking without waiting."""
        status = SpareStatus(self.slot.node_id, self.slot.node_ip)
        if ready_refs([self.warm.handle]):
            try:
                got = ray.get(self.warm.handle)
            except rex.RayError as exc:
                return dataclasses.replace(status, error=str(exc).strip().splitlines()[-1])
            status = SpareStatus(got["node_id"], got["node_ip"], warm=True, pid=got["pid"])
        return status


def start_spare(hosts: HostSet, slot: Slot) -> Spare:
    """Start a standby process in ``slot`` and ask it to import the group's worker classes (not waited for)."""
    actor = start_host(hosts.pool, slot, None, hosts.name_prefix, False, hosts.options, hosts.forking)
    warm = start_step(actor, -1, "warm", (hosts.setups[0].roles,), "warm (a spare)", slot.node_ip)
    return Spare(slot, actor, warm, time.monotonic(), time.time_ns())


def refill_spares(hosts: HostSet) -> list[Spare]:
    """Spares up to the pool's ``spares`` count, in bundles the group holds without a rank (after the
    group starts, after a replacement or a grow); the other free bundles (a shrink's) stay free."""
    if hosts.closed or not hosts.setups or hosts.pool is None:
        return []
    room = max(0, hosts.pool.spares - len(hosts.spares))
    new = [start_spare(hosts, slot) for slot in hosts.take_free_slots(room)]
    hosts.add_spares(new)
    if new:
        logger.info("worker group %s: %d spare process(es) starting", hosts.name_prefix, len(new))
    return new


def prune_dead_spares(hosts: HostSet, timeout: float = 1.0) -> list[Spare]:
    """Drop the spares whose process is gone (their node died with the rank, say); returns them.

    One ping to each spare at once (on its control thread: a spare still importing answers too).
    Their bundles become free again (a bundle on a dead node is re-placed by Ray when it can be).
    """
    if not hosts.spares:
        return []
    refs = {spare.actor.ping.remote(): spare for spare in hosts.spares}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout, fetch_local=False)
    gone = []
    for ref in ready:
        try:
            ray.get(ref)
        except rex.RayError:
            gone.append(refs[ref])
    for spare in gone:
        hosts.take_spare(spare)
        hosts.free_slot(spare.slot)
    if gone:
        logger.warning("worker group %s: %d spare process(es) died (on %s)", hosts.name_prefix, len(gone),
                       sorted({s.slot.node_ip for s in gone}))
    return gone


def warm_refs(spares: Sequence[Spare]) -> set[Any]:
    """The warm-up references of ``spares`` that have answered (those spares are warm), asking without waiting."""
    return ready_refs([s.warm.handle for s in spares], 0.0)


def usable_spares(spares: Sequence[Spare]) -> list[Spare]:
    """Of ``spares``, those a dead rank can take now: warm already, or in a bundle placed on a live
    node (the process is still starting there).

    Why: a spare started in a bundle whose node died (the standby bundle a replaced rank left on a
    node that was lost) waits for Ray to place that bundle again, which may never happen: no other
    node has room, or the node never comes back.  Counted as a spare, it would hold the next
    replacement for the recovery's whole bound, and keep ``"replace_or_shrink"`` from shrinking."""
    if not spares:
        return []
    warm = warm_refs(spares)
    alive = alive_nodes()
    tables: dict[int, dict[str, Any]] = {}
    usable = []
    for spare in spares:
        if spare.warm.handle in warm:
            usable.append(spare)
            continue
        pg = spare.slot.pg
        table = tables.get(id(pg))
        if table is None:
            table = tables[id(pg)] = placement_group_table(pg)
        if table.get("bundles_to_node_id", {}).get(spare.slot.bundle_index) in alive:
            usable.append(spare)
    return usable


def spare_order(spares: Sequence[Spare], node_id: str | None, warm: Collection[Any],
                avoid: Collection[str] = ()) -> list[Spare]:
    """Spares in the order a rank on ``node_id`` tries them: those on nodes outside ``avoid`` (the
    nodes of its shard's live copies) first, then its node, then warm (``warm``: the warm-up
    references that have answered) before cold, then oldest first."""
    return sorted(spares, key=lambda s: (s.slot.node_id in avoid, s.slot.node_id != node_id, s.warm.handle not in warm,
                                         s.started))


def take_spares(hosts: HostSet, ranks: Sequence[int], timeout: float,
                avoid: Mapping[int, Collection[str]] | None = None) -> dict[int, dict[str, Any]]:
    """Dead rank -> node info of the spare that took its place, for as many ranks as usable spares
    allow (:func:`usable_spares`); ``avoid[rank]``: the nodes a spare of ``rank`` is taken from
    last (those of its shard's live copies, :func:`spare_order`).

    Each taken spare is waited for until warm (bounded by ``timeout``); one that died meanwhile,
    or failed to import the group's classes, is dropped (and logged) and the next is tried.  The
    dead ranks' processes are killed, and their bundles become standby bundles
    (``hosts.free_slots``), refilled by :func:`refill_spares`.  Ranks absent from the answer need a
    new process (:func:`.recovery.start_replacements`).
    """
    taken: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    usable = usable_spares(hosts.spares)  # not those waiting for a dead node's bundle to be placed again
    for rank in sorted(ranks):
        usable = [spare for spare in usable if spare in hosts.spares]
        if not usable:
            break
        for spare in spare_order(usable, hosts.slots[rank].node_id, warm_refs(usable), (avoid or {}).get(rank, ())):
            hosts.take_spare(spare)
            try:
                info = ray.get(spare.warm.handle, timeout=max(0.1, deadline - time.monotonic()))
            except (rex.RayError, TimeoutError) as exc:
                logger.warning("worker group %s: spare in bundle %d of %s is unusable (%s); trying the next",
                               hosts.name_prefix, spare.slot.bundle_index, spare.slot.node_ip,
                               str(exc).strip().splitlines()[-1])
                kill_host(spare.actor)
                hosts.free_slot(spare.slot)
                continue
            kill_host(hosts.actors[rank])  # make sure: a half-dead process holds its bundle
            hosts.free_slot(hosts.slots[rank])
            hosts.put_rank(rank, spare.actor, info, spare.slot)
            # What the spare saved, paid before the death: process start, then the imports.
            taken[rank] = {**hosts.info[rank], "spare_start_s": (info["started_ns"] - spare.asked_ns) / 1e9,
                           "spare_import_s": (info["warm_ns"] - info["started_ns"]) / 1e9}
            break
    return taken
