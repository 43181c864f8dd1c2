"""The controller's lifecycle of one group's host processes: launch, build, tear down, shut down.

A :class:`HostSet` is the processes of one group (shared by every role group spawned from it).
Starting takes two steps so that tests can reuse processes: :func:`launch_hosts` starts one empty
:class:`~.host.WorkerHost` per bundle of a pool and reserves MASTER_PORT on rank 0;
:func:`build_workers` sets every rank's environment and builds its worker objects.
:func:`start_hosts` does both and kills everything on failure.  :func:`attach_hosts` finds the
hosts of a detached group started by another driver.  :meth:`HostSet.shutdown` kills the
processes and releases (or removes) their placement groups.

**One owner.**  A :class:`HostSet`'s fields are read by the modules that drive the processes
(the executor, recovery, remesh, spares) and written only by its own methods: a rank's process
replaced (:meth:`HostSet.put_rank`), the ranks renumbered (:meth:`HostSet.rearrange`), bundles
freed and taken (:meth:`HostSet.free_slot`, :meth:`HostSet.take_free_slots`), spares added and
taken (:meth:`HostSet.add_spares`, :meth:`HostSet.take_spare`), a new rendezvous
(:meth:`HostSet.set_rendezvous`).  Every call to the processes made here is a host step
(:func:`.tasks.start_step`), waited for with a deadline and a hang report.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rankmesh.errors import BackendError, ForkRefused, WorkerEnvError, WorkerError
from rankmesh.mesh import RankMesh
from rankmesh.placement import RankPlace

from .hangs import hang_inspector
from .notices import NOTICES
from .forked import Forking, ProcessChoice, kill_host
from .host import WorkerHost, host_actor_options
from .hostapi import HostSetup, RoleInit
from rankmesh.rendezvous import RESERVED_ENV
from .runtime import DETACHED_NAMESPACE
from .startup import StartupProgress
from .tasks import start_step
from .calls import Pending
from .waiting import fetch_outputs
from .wire import CALL_SLOTS, HeaderCache

logger = logging.getLogger(__name__)

#: Every variable the group sets for each rank (worker_env may not override them).
OWNED_ENV: tuple[str, ...] = (*RESERVED_ENV, "RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE")


@dataclass
class HostSet:
    """The processes of one group (shared by the role groups spawned from it).

    ``pool``: released on shutdown (its placement groups go with its last user).  ``pg_ids``:
    placement groups to remove on shutdown when there is no pool object (a group attached with
    :func:`attach_hosts`).  ``places``/``master``: rank placement and rendezvous address.
    """

    actors: list[Any]
    names: list[str]
    info: list[dict[str, Any]]
    name_prefix: str
    detached: bool
    pool: Any = None
    pg_ids: list[str] = field(default_factory=list)
    closed: bool = False
    places: list[RankPlace] = field(default_factory=list)
    master: tuple[str, int] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the actors' Ray options, to start replacements
    setups: list[HostSetup] = field(default_factory=list)  # what each rank was built with, to rebuild it
    #: Call headers and call slots of every executor over these processes (:class:`.wire.HeaderCache`).
    headers: HeaderCache = field(default_factory=HeaderCache)
    #: The bundle each rank runs in (a rank that took a spare runs in the spare's bundle).
    slots: list[Any] = field(default_factory=list)
    #: Warm standby processes (:class:`.spares.Spare`) and the standby bundles that have none yet.
    spares: list[Any] = field(default_factory=list)
    free_slots: list[Any] = field(default_factory=list)
    #: Processes that were ranks of the group before a replacement or a renumbering dropped them.
    former_pids: set[int] = field(default_factory=set)
    #: How ranks are forked from warm processes (``process_model="fork"``); ``None``: a Ray actor per rank.
    forking: Forking | None = None

    def __post_init__(self) -> None:
        NOTICES.watch(self)  # Ray's notices of these processes' deaths: the group reports them itself

    @property
    def nodes(self) -> list[str | None]:
        """Node address of every rank (for error messages)."""
        return [i.get("node_ip") for i in self.info] if self.info else [None] * len(self.actors)

    # ----- the one writer of the fields (see the module docstring) ----------------------------------

    def put_rank(self, rank: int, actor: Any, info: Mapping[str, Any], slot: Any = None) -> None:
        """Rank ``rank`` runs in ``actor`` now (a replacement, or a spare that took its place; ``slot``: its bundle)."""
        self._forget(self.info[rank:rank + 1])
        self.actors[rank] = actor
        self.info[rank] = {**info, "rank": rank}
        if slot is not None:
            self.slots[rank] = slot

    def rearrange(self, actors: list[Any], info: list[dict[str, Any]], slots: list[Any], setups: list[HostSetup],
                  names: list[str]) -> None:
        """The group's ranks are renumbered (a shrink or a grow): every per-rank field at once."""
        lengths = {len(actors), len(info), len(slots), len(setups), len(names)}
        if len(lengths) != 1:
            raise BackendError(f"rearranging hosts: per-rank fields of different lengths {sorted(lengths)}")
        self._forget(self.info)
        self.actors, self.info, self.slots, self.setups, self.names = actors, info, slots, setups, names

    def _forget(self, info: list[dict[str, Any]]) -> None:
        """The processes of ``info`` may stop being ranks: remembered in :attr:`former_pids`."""
        self.former_pids.update(i[key] for i in info for key in ("pid", "ray_pid") if key in i)

    def set_rendezvous(self, master: tuple[str, int]) -> None:
        """A fresh MASTER_ADDR/MASTER_PORT: every rank's setup carries it from now on."""
        self.master = tuple(master)
        env = {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
        self.setups = [dataclasses.replace(setup, env={**setup.env, **env}) for setup in self.setups]

    def free_slot(self, slot: Any) -> None:
        """``slot`` holds no rank any more (a dead rank's, a dropped replica's): a spare or a grow may take it."""
        self.free_slots.append(slot)

    def take_free_slots(self, count: int) -> list[Any]:
        """Up to ``count`` free bundles, oldest first (given back with :meth:`free_slot` if unused)."""
        taken, self.free_slots = self.free_slots[:count], self.free_slots[count:]
        return taken

    def add_spares(self, spares: Sequence[Any]) -> None:
        self.spares.extend(spares)

    def take_spare(self, spare: Any) -> None:
        """``spare`` leaves the standby list (it takes a rank, or it is found dead)."""
        self.spares.remove(spare)

    def add_placement_group(self, pg_id: str) -> None:
        """A placement group the group made for itself (a grow): removed on shutdown, or by :meth:`drop_placement_group`."""
        self.pg_ids.append(pg_id)

    def drop_placement_group(self, pg_id: str) -> None:
        """Remove a placement group the group made and no rank uses (a grow that failed)."""
        if pg_id in self.pg_ids:
            self.pg_ids.remove(pg_id)
        remove_placement_group_by_id(pg_id)

    def step(self, step: str, ranks: Sequence[int], args: Sequence[tuple[Any, ...]] | None = None,
             timeout: float | None = None, what: str | None = None) -> list[Any]:
        """Run host step ``step`` on ``ranks``' processes and wait for them (bounded, with a hang report).

        For a group's start and end, before or after any executor drives the processes; a driven
        group's steps go through its executor (:meth:`.executor.RayExecutor.step`)."""
        nodes = self.nodes
        pending = [start_step(self.actors[r], r, step, () if args is None else args[i], what, nodes[r])
                   for i, r in enumerate(ranks)]
        return fetch_outputs(pending, timeout, inspect=hang_inspector(self.actors))

    def kill(self) -> None:
        """Kill every process now, spares too (no restart); the placement groups stay reserved."""
        for actor in [*self.actors, *(s.actor for s in self.spares)]:
            try:
                kill_host(actor)
            except Exception as exc:  # noqa: BLE001 - already dead
                logger.debug("killing %s: %s", actor, exc)
        if self.forking is not None:
            self.forking.close()  # the holders of its forked ranks

    def teardown_workers(self, timeout: float = 60.0) -> None:
        """Drop the role objects in every host, keeping the processes (see ``WorkerHost.teardown``).

        Each host tears down once the call it runs has ended (the host's lock)."""
        self.step("teardown", range(len(self.actors)), timeout=timeout)

    def shutdown(self) -> None:
        """Kill every host (all roles in them), then release or remove the placement groups."""
        if self.closed:
            return
        self.closed = True
        self.kill()
        if self.pool is not None:
            self.pool.release()
        for pg_id in dict.fromkeys(self.pg_ids):
            remove_placement_group_by_id(pg_id)
        logger.info("worker group %s shut down (%d processes)", self.name_prefix, len(self.actors))


def remove_placement_group_by_id(pg_id: str) -> None:
    """Remove the placement group with hex id ``pg_id`` (no-op if it is gone already)."""
    try:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception as exc:  # noqa: BLE001 - already removed
        logger.debug("removing placement group %s: %s", pg_id, exc)


def actor_name(name_prefix: str, rank: int) -> str:
    """Name of a detached group's actor: ``{name_prefix}_{rank}`` (prefix + rank)."""
    return f"{name_prefix}_{rank}"


def rank_of_name(name: str, name_prefix: str) -> int | None:
    """Inverse of :func:`actor_name`; ``None`` for names of other groups (even ``{prefix}_x_1``)."""
    head = f"{name_prefix}_"
    rest = name[len(head) :] if name.startswith(head) else ""
    return int(rest) if rest.isdigit() else None


def check_worker_env(worker_env: Mapping[str, Any] | None) -> dict[str, str]:
    """``worker_env`` as strings; refuses the variables the group sets itself."""
    env = dict(worker_env or {})
    clash = sorted(set(env) & set(OWNED_ENV))
    if clash:
        raise WorkerEnvError(
            f"worker_env may not set {', '.join(clash)}: the group sets {', '.join(OWNED_ENV)} for every rank"
        )
    bad = [k for k, v in env.items() if not isinstance(k, str) or not k or v is None]
    if bad:
        raise WorkerEnvError(f"worker_env has invalid entries: {bad!r}")
    return {k: str(v) for k, v in env.items()}


def start_host(pool: Any, slot: Any, rank: int, name_prefix: str, detached: bool, options: Mapping[str, Any],
               forking: Forking | None = None) -> Any:
    """Start the (empty) host process of ``rank`` in its bundle ``slot`` of ``pool`` (also a replacement's):
    a Ray actor of its own, or with ``forking`` a fork of the node's warm process (its route: :class:`.forked.RankRoute`)."""
    opts: dict[str, Any] = {
        **pool.actor_resources,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=slot.pg, placement_group_bundle_index=slot.bundle_index
        ),
        **dict(options),
    }
    if detached:
        opts.update(name=actor_name(name_prefix, rank), namespace=DETACHED_NAMESPACE, lifetime="detached")
    if forking is not None:
        return forking.start(slot, rank, name_prefix, pool.actor_resources, options)
    return remote_host_class().options(**opts).remote(rank, name_prefix)


def ordered_calls(options: Mapping[str, Any]) -> bool:
    """Whether hosts started with Ray ``options`` run this driver's calls one at a time, in order,
    in one process life: what installing call slots needs (:class:`.wire.HeaderCache`)."""
    return not options.get("max_restarts") and (options.get("max_concurrency") or 1) <= 1


@functools.lru_cache(maxsize=None)
def remote_host_class() -> Any:
    """``ray.remote(WorkerHost)`` with its control thread (:func:`.host.host_actor_options`), made once
    per process: every group's options differ per actor, and concurrency groups cannot be set
    through ``.options()``."""
    return ray.remote(**host_actor_options())(WorkerHost)


def launch_hosts(
    pool: Any, name_prefix: str, detached: bool, options: Mapping[str, Any], timeout: float, progress: StartupProgress | None = None,
    forking: Forking | None = None,
) -> HostSet:
    """Start one (empty) host per bundle of ``pool`` (forked from warm processes with ``forking``) and
    reserve MASTER_PORT on rank 0."""
    slots = pool.slots()  # waits until every placement group is placed
    if progress is not None:
        progress.controller_stage("placed")
    actors = [start_host(pool, slot, rank, name_prefix, detached, options, forking) for rank, slot in enumerate(slots)]
    names = [actor_name(name_prefix, rank) for rank in range(len(slots))]
    hosts = HostSet(
        actors=actors,
        names=names,
        info=[],
        name_prefix=name_prefix,
        detached=detached,
        options=dict(options),
        headers=HeaderCache(slots=CALL_SLOTS if ordered_calls(options) else 0),
        forking=forking,
    )
    hosts.places = pool.places()
    hosts.slots = list(slots)
    try:
        pend = [start_step(a, r, "node_info", what="start") for r, a in enumerate(actors)]
        pend.append(start_step(actors[0], 0, "reserve_master_port"))
        *info, master = fetch_outputs(pend, timeout=timeout, inspect=hang_inspector(actors))
        if progress is not None:
            # A round trip to processes already up (the first one included their boot).
            sent = time.time_ns()
            now = hosts.step("clock", range(len(actors)), timeout=timeout)
            progress.clocks(sent, time.time_ns(), now)
            progress.rank_stage("started", [i["started_ns"] for i in info])
        for rank, (slot, got) in enumerate(zip(slots, info)):
            if got["node_id"] != slot.node_id:  # Ray broke the bundle's node: refuse to guess
                raise BackendError(f"rank {rank} runs on node {got['node_id']} but its bundle is on {slot.node_id}")
    except BaseException:
        hosts.shutdown()
        raise
    hosts.info, hosts.master = info, tuple(master)
    return hosts


def build_workers(
    hosts: HostSet,
    roles: Mapping[str | None, RoleInit],
    mesh: RankMesh,
    meshes: Mapping[str, RankMesh],
    worker_env: Mapping[str, str],
    timeout: float,
    progress: StartupProgress | None = None,
    preload: tuple[str, ...] = (),
) -> None:
    """Set every rank's environment and build its role objects (all ranks in parallel), each rank
    importing ``preload`` first (:attr:`rankmesh.binding.MethodTable.preload`)."""
    world = len(hosts.actors)
    addr, port = hosts.master
    sent = []
    for rank, place in enumerate(hosts.places):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(place.local_rank),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
            "RAY_LOCAL_RANK": str(place.local_rank),  # verl's names for the same two values
            "RAY_LOCAL_WORLD_SIZE": str(place.local_world_size),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
            **dict(worker_env),
        }
        setup = HostSetup(
            rank=rank,
            world_size=world,
            local_rank=place.local_rank,
            local_world_size=place.local_world_size,
            node_index=place.node,
            mesh=mesh,
            meshes=dict(meshes),
            roles=dict(roles),
            env=env,
            group_name=hosts.name_prefix,
            preload=preload,
        )
        sent.append(setup)
    done = hosts.step("setup", range(world), [(setup,) for setup in sent], timeout=timeout)
    hosts.setups = sent
    if progress is not None:
        progress.rank_stage("imported", [d[0] for d in done])
        progress.rank_stage("initialized", [d[1] for d in done])


def start_hosts(
    pool: Any,
    roles: Mapping[str | None, RoleInit],
    mesh: RankMesh,
    meshes: Mapping[str, RankMesh],
    name_prefix: str,
    detached: bool,
    worker_env: Mapping[str, str],
    options: Mapping[str, Any],
    timeout: float,
    progress: StartupProgress | None = None,
    preload: tuple[str, ...] = (),
    process: ProcessChoice = ProcessChoice("ray"),
) -> HostSet:
    """:func:`launch_hosts` then :func:`build_workers`; on failure every host is killed.

    ``process.model``: ``"ray"`` starts a Ray actor per rank, ``"fork"`` forks each rank from its
    node's warm process behind a holder actor (:mod:`.forked`); with ``process.fall_back`` a node
    that refuses to fork the group's modules (:class:`~rankmesh.errors.ForkRefused`) makes every
    rank a Ray actor instead, with a warning that says why.

    The pool is acquired here and released by :meth:`HostSet.shutdown` (or at once on failure).
    """
    pool.admit()
    pool.acquire()
    try:
        forking = Forking.of_roles(roles, preload) if process.model == "fork" else None
        try:
            hosts = launch_hosts(pool, name_prefix, detached, options, timeout, progress, forking)
        except WorkerError as exc:
            if forking is None or not process.fall_back or not exc.raised(ForkRefused):
                raise
            logger.warning("worker group %s: its ranks start as Ray actors, one each: %s", name_prefix, exc.detail)
            hosts = launch_hosts(pool, name_prefix, detached, options, timeout, progress, None)
    except BaseException:
        pool.release()
        raise
    hosts.pool = pool
    try:
        build_workers(hosts, roles, mesh, meshes, worker_env, timeout, progress, preload)
    except BaseException:
        hosts.shutdown()
        raise
    return hosts


def attach_hosts(name_prefix: str, timeout: float) -> HostSet:
    """The hosts of the detached group ``name_prefix``, as their processes describe themselves.

    ``info[r]`` is rank ``r``'s :meth:`~.host.WorkerHost.describe` (class, mesh, placement); the
    placement groups the hosts run in are removed on shutdown.
    """
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != DETACHED_NAMESPACE:
            continue
        rank = rank_of_name(entry["name"], name_prefix)
        if rank is not None:
            found[rank] = entry["name"]
    if not found:
        raise BackendError(f"no detached worker group named {name_prefix!r} (namespace {DETACHED_NAMESPACE!r})")
    world = max(found) + 1
    missing = sorted(set(range(world)) - set(found))
    if missing:
        raise BackendError(f"detached group {name_prefix!r} lacks ranks {missing} (dead or still starting)")
    actors = [ray.get_actor(found[r], namespace=DETACHED_NAMESPACE) for r in range(world)]
    # describe runs on the control threads: the processes answer while they run another driver's call.
    info = fetch_outputs([Pending(a.describe.remote(), r, "describe") for r, a in enumerate(actors)], timeout)
    if any("world_size" not in i for i in info):
        raise BackendError(f"detached group {name_prefix!r} is not set up yet")
    if info[0]["world_size"] != world:
        raise BackendError(f"detached group {name_prefix!r} reports world size {info[0]['world_size']}, found {world} actors")
    return HostSet(
        actors=actors,
        names=[found[r] for r in range(world)],
        info=info,
        name_prefix=name_prefix,
        detached=True,
        pg_ids=[i["placement_group_id"] for i in info if i.get("placement_group_id")],
        headers=HeaderCache(slots=0),  # the driver that started them installs call slots in them
    )
