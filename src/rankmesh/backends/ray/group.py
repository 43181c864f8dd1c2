"""RayWorkerGroup: a worker group whose ranks are Ray actors placed by a resource pool.

Method binding and dispatch are :class:`rankmesh.group.WorkerGroup`'s, exactly as for the
in-process backend; this module only starts the processes (:mod:`.hosts`), wires a
:class:`.executor.RayExecutor` to them and adds what only Ray has: placement, detached groups,
colocated roles (:meth:`RayWorkerGroup.spawn`) and shutdown.

Every way to get a group ends in one core, :meth:`RayWorkerGroup._attach`, the one place a
group's attributes are set (hosts, resolved methods, executor, recovery state, start-up record),
each passed explicitly: ``RayWorkerGroup(pool, cls)`` (verl's signature) starts hosts first,
:meth:`~RayWorkerGroup.from_detached` finds them, :meth:`~RayWorkerGroup.on_hosts` builds new
workers in running ones (these three drive them with a new executor, :meth:`~RayWorkerGroup._drive`),
and :meth:`~RayWorkerGroup.spawn` passes a group's hosts, executor, recovery and start-up on.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Mapping, Sequence

from rankmesh.dispatch.modes import DispatchRegistry
from rankmesh.errors import (AgentLostError, BackendError, ControllerCutOffError, FetchTimeoutError, PaddingError,
                             RecoveryError, WorkerDiedError, WorkerError)
from rankmesh.binding import MethodTable, PerRank
from rankmesh.group import WorkerGroup
from rankmesh.mesh import RankMesh
from rankmesh.placement import Placement, RankPlace
from rankmesh.validate import optional_seconds, positive_seconds

from .classes import RayClassWithInitArgs, fused_worker_class, unwrap_actor_class
from .executor import ABANDONED_WAIT_S, RETRYING, SHRINKING, RayExecutor, check_policies, control_mode
from .forked import ProcessChoice, choose_process_model
from .hostapi import role_class
from .hosts import HostSet, attach_hosts, build_workers, check_worker_env, start_hosts
from .pool import RayResourcePool
from .recovery import PROBE_TIMEOUT, Recovery, ReplacementReport, check_recoverable, probe_dead, replace_dead_ranks
from .remesh import RemeshReport, grow, shrink_dead_replicas
from .spares import SpareStatus, refill_spares
from .runtime import ensure_ray, node_death_window_s
from .startup import StartupProgress, StartupReport

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT = 300.0
"""Seconds to wait for every rank's process to start and its worker to be built."""


def check_bin_pack(bin_pack: Any) -> None:
    """verl's ``bin_pack``: true (the default) is what every pool does; false is refused.

    In verl ``bin_pack`` picks the strategy of the pool's placement groups: true ``STRICT_PACK``
    (each node entry's bundles on one node), false ``PACK`` (best effort: an entry may spread
    over several nodes).  A :class:`.pool.RayResourcePool` always uses ``STRICT_PACK``: its rank
    order, LOCAL_RANK and LOCAL_WORLD_SIZE count one node per entry.
    """
    if not bin_pack:
        raise BackendError(
            f"bin_pack={bin_pack!r} is not supported: verl's bin_pack=False asks for PACK placement groups "
            "(a node entry's processes may spread over several nodes), but a RayResourcePool places each "
            "process_on_nodes entry on ONE node (STRICT_PACK), which its rank order and local ranks rely on. "
            "Leave bin_pack=True; to spread processes over nodes, give one entry per node, "
            "e.g. RayResourcePool([4, 4]) instead of RayResourcePool([8])."
        )


def default_group_name(cls_with_init: RayClassWithInitArgs, detached: bool) -> str:
    """A group's name when none is given: what its processes run, as traces, start-up reports, logs and errors show it.

    The worker class (``ActorWorker``), or the colocated roles joined (``actor+ref``).  A detached
    group's name is also how its actors are found in Ray's namespace, so it gets a unique suffix.
    """
    roles = cls_with_init.role_names
    name = "+".join(roles) if roles else cls_with_init.cls.__name__
    return f"{name}-{uuid.uuid4().hex[:8]}" if detached else name


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per bundle of ``resource_pool``, each hosting ``ray_cls_with_init``'s class.

    ``mesh`` (default ``RankMesh(dp=world_size)``) must cover the pool's processes.  Every rank
    gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, plus
    ``worker_env``.  ``detached=True`` (needs a detached pool) names the actors
    ``{name_prefix}_{rank}`` and lets them outlive this driver (see :meth:`from_detached`).
    ``call_timeout_s`` bounds every call (``FetchTimeoutError`` naming the unfinished ranks);
    ``wg.with_timeout(s).method(...)`` overrides it for one call.  Past its timeout a call raises
    ``HangError`` saying where each unfinished rank is stuck; ``stall_warn_s`` (per call:
    ``wg.with_timeout(stall_warn_s=s)``) logs that report once as a warning and keeps waiting
    (docs/ray_backend.md, "When a call hangs").  ``progress`` shows the
    start-up stages as a bar (``None``: only when stderr is a terminal); ``wg.startup_report()``
    gives each stage's time per rank (:mod:`.startup`).

    ``on_rank_death`` says what a dead rank process does to the group: ``"fail"`` (default) stops
    the other ranks and refuses later calls; ``"keep"`` keeps the survivors until
    :meth:`replace_dead_ranks`; ``"replace"`` replaces the dead ranks and retries the failed
    blocking call once (see :mod:`.recovery` and the recovery model in docs/ray_backend.md);
    ``"shrink"`` drops the dead ranks' dp replicas and retries once on the others, and
    ``"replace_or_shrink"`` replaces, or shrinks when no process can be had (:mod:`.remesh`;
    ``wg.grow(k)`` adds replicas back).  ``on_hang="kill"`` treats ranks still running a call past
    its timeout as dead: the ``HangError`` is raised as before (a blocking call under a retrying
    policy is instead retried once), their processes are killed, and ``on_rank_death`` recovers
    them (a rank stopped or wedged for good comes back without a hand-written ``kill_ranks``).
    On a pool with ``spares=N`` such a group keeps N warm standby processes that take a dead
    rank's place without starting one (:mod:`.spares`; ``wg.spares`` lists them).
    ``bin_pack`` is verl's; only ``True`` is supported (:func:`check_bin_pack`).
    ``process_model="fork"`` forks each rank from its node's warm process (imports paid once per
    node) behind a light holder actor, instead of a Ray actor per rank (:mod:`.forked`; ``None``:
    the ``RANKMESH_PROCESS_MODEL`` setting, and when unset ``"fork"`` for rankmesh's own worker
    classes, Ray actors should forking their modules be refused, and ``"ray"`` for any other;
    docs/ray_backend.md, "Process models", says when to choose which).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        mesh: RankMesh | None = None,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_env: Mapping[str, Any] | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
        *,
        start_timeout: float = DEFAULT_START_TIMEOUT,
        registry: DispatchRegistry | None = None,
        bin_pack: bool = True,
        call_timeout_s: float | None = None,
        progress: bool | None = None,
        stall_warn_s: float | None = None,
        on_rank_death: str = "fail",
        abandoned_wait_s: float = ABANDONED_WAIT_S,
        on_hang: str = "raise",
        process_model: str | None = None,
    ) -> None:
        if detached and process_model == "fork":
            raise BackendError("a detached group outlives its driver, and forked ranks live no longer than the driver's "
                               "warm processes: use process_model='ray' with detached=True")
        call_timeout_s = optional_seconds(call_timeout_s, "call_timeout_s", BackendError)
        abandoned_wait_s = positive_seconds(abandoned_wait_s, "abandoned_wait_s", BackendError)
        stall_warn_s = optional_seconds(stall_warn_s, "stall_warn_s", BackendError)
        start_timeout = positive_seconds(start_timeout, "start_timeout", BackendError)
        if not isinstance(resource_pool, RayResourcePool):
            raise BackendError(f"resource_pool must be a RayResourcePool, got {type(resource_pool).__name__}")
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            ray_cls_with_init = RayClassWithInitArgs(ray_cls_with_init)
        check_bin_pack(bin_pack)
        check_policies(on_rank_death, on_hang)
        if not detached:
            control_mode()  # RANKMESH_CONTROL: a bad value fails here, not once Ray and the processes have started
        env = check_worker_env(worker_env)
        world = resource_pool.world_size
        # Resolve every method's plan before any process starts: bad meshes and modes fail here.
        table = MethodTable.build(ray_cls_with_init.cls, world, mesh, meshes, None, registry, type(self))
        if detached and not resource_pool.detached:
            raise BackendError("a detached group needs a detached pool: RayResourcePool(..., detached=True)")
        if on_rank_death in SHRINKING and table.extra_meshes:  # before any process starts
            raise BackendError(
                f"on_rank_death={on_rank_death!r} changes the group's dp size, which its named meshes "
                f"{sorted(table.extra_meshes)} cannot follow; use 'replace' (or 'keep'), or give the group one mesh"
            )
        if detached and resource_pool.spares:
            raise BackendError(
                f"a detached group keeps no spares (its actors are found by name, and a spare taking a rank's place "
                f"would not hold it): create the pool without spares=, not spares={resource_pool.spares}"
            )
        resource_pool.connect()  # not ensure_ray(): the pool sizes an embedded Ray for itself
        prefix = name_prefix or default_group_name(ray_cls_with_init, detached)
        roles = ray_cls_with_init.roles  # pickles every class: once
        # A detached group keeps Ray actors whatever RANKMESH_PROCESS_MODEL says (it outlives the warm processes).
        process = ProcessChoice("ray") if detached else choose_process_model(
            process_model, [role_class(role) for role in roles.values()])
        startup = StartupProgress(prefix, world, progress)
        try:
            hosts = start_hosts(
                resource_pool,
                roles,
                table.mesh,
                table.extra_meshes,
                prefix,
                detached,
                env,
                ray_cls_with_init.options,
                start_timeout,
                startup,
                table.preload,
                process,
            )
        finally:
            startup.close()
        try:
            executor, recovery = self._drive(hosts, table, call_timeout_s, stall_warn_s, on_rank_death, abandoned_wait_s,
                                             on_hang)
            self._attach(hosts, table, executor, recovery, startup)
        except BaseException:
            hosts.shutdown()
            raise
        if resource_pool.spares and on_rank_death != "fail":
            for slot in resource_pool.spare_slots():
                hosts.free_slot(slot)
            refill_spares(hosts)  # in the background: the group is usable now
        elif resource_pool.spares:
            logger.info("worker group %s keeps no spares: on_rank_death='fail' never replaces a rank", prefix)
        logger.info("started worker group %s: %d ranks, %s, nodes %s", prefix, world, table.mesh, self.placement)
        spans = self.spanning_groups()
        if spans:
            logger.warning(
                "worker group %s: %d tp/cp/ep group(s) cross nodes (their collectives go over the network), e.g. %s",
                prefix,
                len(spans),
                spans[0].describe(),
            )

    def _attach(
        self,
        hosts: HostSet,
        table: MethodTable,
        executor: RayExecutor,
        recovery: Recovery,
        startup: StartupProgress | None,
    ) -> None:
        """The core of every constructor, and the one place a group's attributes are set.

        Drives ``hosts`` with ``table``'s methods through ``executor``.  A group of its own gets a
        new executor and recovery state (:meth:`_drive`); a spawned role group gets its parent's,
        so that all roles share one closed flag, one failure, one set of stats, one recovery
        policy and one set of checks.  ``startup``: the record of how the processes started
        (shared by the role groups; ``None`` for a group over processes started elsewhere).
        """
        self._hosts = hosts
        self._recovery = recovery
        self._startup = startup
        self._install(executor, table)
        recovery.add_group(self)  # re-planned when a shrink or a grow changes the mesh

    @staticmethod
    def _drive(
        hosts: HostSet,
        table: MethodTable,
        call_timeout_s: float | None = None,
        stall_warn_s: float | None = None,
        on_rank_death: str = "fail",
        abandoned_wait_s: float = ABANDONED_WAIT_S,
        on_hang: str = "raise",
    ) -> tuple[RayExecutor, Recovery]:
        """A new executor over ``hosts`` and the recovery state of its ``on_rank_death`` policy."""
        coords = [table.mesh.rank_coords(r) for r in range(len(hosts.actors))]
        executor = RayExecutor(hosts, coords, call_timeout_s, stall_warn_s, on_rank_death, abandoned_wait_s, on_hang)
        return executor, Recovery(on_rank_death)

    @classmethod
    def _over(
        cls,
        hosts: HostSet,
        table: MethodTable,
        executor: RayExecutor,
        recovery: Recovery,
        startup: StartupProgress | None = None,
    ) -> "RayWorkerGroup":
        """A group over already running ``hosts`` (:meth:`_attach` without starting anything)."""
        group = cls.__new__(cls)
        group._attach(hosts, table, executor, recovery, startup)
        return group

    @classmethod
    def on_hosts(
        cls,
        hosts: HostSet,
        ray_cls_with_init: RayClassWithInitArgs,
        mesh: RankMesh | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
        worker_env: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_START_TIMEOUT,
    ) -> "RayWorkerGroup":
        """Build new workers in already running, torn-down hosts (process reuse for tests).

        ``hosts`` comes from :func:`.hosts.launch_hosts` or a previous group's
        :meth:`release_hosts`; that group must not be used any more.
        """
        table = MethodTable.build(ray_cls_with_init.cls, len(hosts.actors), mesh, meshes, group_type=cls)
        build_workers(hosts, ray_cls_with_init.roles, table.mesh, table.extra_meshes, check_worker_env(worker_env), timeout,
                      preload=table.preload)
        return cls._over(hosts, table, *cls._drive(hosts, table))

    def release_hosts(self, timeout: float = 60.0) -> HostSet:
        """Drop this group's workers but keep its processes running, for :meth:`on_hosts` (process reuse for tests).

        Ends the group's call session (the session threads in the processes stop), then tears the
        workers down once every rank has finished what it was sent (within ``timeout`` seconds).
        Process-wide state the workers left (an initialized torch.distributed, megatron's
        parallel_state, module globals) stays; the caller resets what the next group needs.
        """
        self._executor.release()
        self._hosts.teardown_workers(timeout)
        return self._hosts

    @classmethod
    def from_detached(
        cls,
        name_prefix: str,
        worker_cls: Any = None,
        mesh: RankMesh | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
        *,
        ray_cls_with_init: RayClassWithInitArgs | None = None,
        timeout: float = 60.0,
    ) -> "RayWorkerGroup":
        """Attach to the detached group named ``name_prefix`` (started by any driver).

        The workers report their class, mesh and placement; ``worker_cls`` overrides the class
        the controller binds (e.g. a subclass with more methods), ``mesh`` is checked against
        the one the workers were built with.  ``shutdown()`` on the attached group kills the actors
        and removes the placement groups they run in.
        """
        timeout = positive_seconds(timeout, "timeout", BackendError)
        ensure_ray()
        hosts = attach_hosts(name_prefix, timeout)
        built = hosts.info[0]
        if ray_cls_with_init is not None:
            worker_cls = ray_cls_with_init.cls
        classes = built["role_classes"]
        if worker_cls is None:
            worker_cls = classes[None] if list(classes) == [None] else fused_worker_class(classes)
        if mesh is not None and mesh != built["mesh"]:
            raise BackendError(f"detached group {name_prefix!r} was built with {built['mesh']}, not {mesh}")
        if meshes is None:
            meshes = {k: v for k, v in built["meshes"].items() if k != "default"}
        table = MethodTable.build(unwrap_actor_class(worker_cls), len(hosts.actors), built["mesh"], meshes, group_type=cls)
        return cls._over(hosts, table, *cls._drive(hosts, table))

    # ----- verl's accessors and placement -------------------------------------------------------

    @property
    def workers(self) -> list[Any]:
        """Actor handles, by rank."""
        return list(self._hosts.actors)

    @property
    def worker_names(self) -> list[str]:
        """``{name_prefix}_{rank}``; registered with Ray only for detached groups."""
        return list(self._hosts.names)

    @property
    def name_prefix(self) -> str:
        return self._hosts.name_prefix

    @property
    def detached(self) -> bool:
        return self._hosts.detached

    @property
    def resource_pool(self) -> RayResourcePool | None:
        """The pool the processes run in (``None`` for a group attached with :meth:`from_detached`)."""
        return self._hosts.pool

    @property
    def node_info(self) -> list[dict[str, Any]]:
        """Per rank, as the process itself reported: node id and ip, pid, placement group, GPUs."""
        return [dict(i) for i in self._hosts.info]

    @property
    def placement(self) -> Placement:
        """Processes per node, in rank order (nodes as the pool ordered them)."""
        counts: list[int] = []
        last = None
        for info in self._hosts.info:
            if info["node_id"] != last:
                counts.append(0)
                last = info["node_id"]
            counts[-1] += 1
        return Placement(counts)

    @property
    def placements(self) -> list[RankPlace]:
        """Node index, local rank and local world size of every rank."""
        return self.placement.places()

    def startup_report(self) -> StartupReport | None:
        """Seconds each start-up stage took to end, per rank (``None`` for an attached group)."""
        return None if self._startup is None else self._startup.report

    def record_startup(self, stage: str) -> None:
        """Mark a controller-side start-up stage as ended now (``cross-checked``, by megatron's start)."""
        if self._startup is not None:
            self._startup.controller_stage(stage)

    @property
    def node_labels(self) -> list[str]:
        """``node <i>`` per rank, nodes numbered as the pool ordered them (what traces show)."""
        return [f"node {p.node}" for p in self.placements]

    @property
    def ranks_run_at_once(self) -> bool:
        """Each rank is a process of its own: a call's ranks run at the same time."""
        return True

    @property
    def trace_name(self) -> str:
        """The group's name in traces: its role, else its name prefix."""
        return self.role or self.name_prefix

    @property
    def outlives_driver(self) -> bool:
        return self._hosts.detached

    @property
    def trace_startup(self) -> dict[str, Any] | None:
        """The start-up report a trace keeps (stage times per rank; ``None`` for an attached group).

        A recorder asks for it on the group's first traced call (roles spawned from one group
        share one report, kept once).
        """
        report = self.startup_report()
        return None if report is None else report.to_json()

    def node_of(self, rank: int) -> str:
        """Ray node id of ``rank``."""
        return self._hosts.info[rank]["node_id"]

    def spanning_groups(self, tokens: Sequence[str] = ("tp", "cp", "ep")) -> list:
        """Communication groups of the mesh that cross a node boundary in this placement."""
        return self.placement.spanning_groups(self.mesh, tokens)

    # ----- colocated roles ------------------------------------------------------------------------

    def spawn(self, prefix_set: Sequence[str]) -> dict[str, "RayWorkerGroup"]:
        """Role name -> a group over the same processes whose methods are that role's."""
        roles = self._table.roles
        if isinstance(prefix_set, str):
            prefix_set = [prefix_set]
        unknown = [p for p in prefix_set if p not in roles]
        if unknown:
            raise BackendError(f"no colocated role {unknown} in this group (roles: {sorted(roles)})")
        extra = {k: v for k, v in self.meshes.items() if k != "default"}
        groups = {}
        for role in prefix_set:
            table = MethodTable.build(
                unwrap_actor_class(roles[role]), self.world_size, self.mesh, extra, role, self.registry, type(self)
            )
            groups[role] = type(self)._over(self._hosts, table, self.executor, self._recovery, self._startup)
        return groups

    def fuse(self, prefix_set: Sequence[str]) -> dict[str, "RayWorkerGroup"]:
        """:meth:`spawn`, and also set each role group as an attribute (``wg.actor``)."""
        groups = self.spawn(prefix_set)
        for role, group in groups.items():
            if hasattr(type(self), role) or role in self.method_names:
                raise BackendError(f"cannot fuse role {role!r}: it clashes with an attribute of the group")
            setattr(self, role, group)
        return groups

    # ----- recovery ---------------------------------------------------------------------------------

    def replace_dead_ranks(self, timeout_s: float = DEFAULT_START_TIMEOUT) -> ReplacementReport | None:
        """Replace the group's dead ranks in place; ``None`` when no rank is dead.

        Survivors keep their processes and state; each dead rank gets a warm spare (if the group
        keeps any) or a new process in its own bundle, with the same rank, coordinates, environment and workers, every rank re-forms
        torch.distributed, and the new ranks restore their state from a live dp peer
        (:mod:`.recovery`).  Needs ``on_rank_death="keep"`` or ``"replace"``.  Raises
        ``ShardLostError`` when a dead rank's shard has no live copy (restart from a checkpoint)
        and ``RecoveryError`` when a survivor stays busy past ``timeout_s``; both stop the group.
        """
        timeout_s = positive_seconds(timeout_s, "replace_dead_ranks(timeout_s)", BackendError)
        report = replace_dead_ranks(self._hosts, self.executor, self.mesh, self._recovery, timeout_s)
        if report is not None:
            logger.warning("%s", report.format())
        return report

    def kill_ranks(self, ranks: Sequence[int]) -> None:
        """Kill the processes of ``ranks`` now, as a way out for ranks stuck for good (a ``HangError``'s advice).

        The group then treats them as dead ranks, by its ``on_rank_death`` policy: ``"fail"``
        stops the others too; ``"keep"`` waits for :meth:`replace_dead_ranks` (or
        :meth:`shrink_dead_replicas`); the retrying policies recover on the next call.
        """
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
            raise BackendError(f"kill_ranks(ranks) takes a list of ranks of this group, got {ranks!r}")
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad:
            raise BackendError(f"kill_ranks(ranks): {bad} are not ranks of this group (0..{self.world_size - 1})")
        self.executor.kill_ranks(sorted(set(ranks)), "killed on purpose (kill_ranks)")

    def shrink_dead_replicas(self, timeout_s: float = DEFAULT_START_TIMEOUT) -> RemeshReport | None:
        """Drop the dp replicas of the dead ranks and go on with the others; ``None`` when no rank is dead.

        The kept processes keep their state and move to their rank in the mesh with ``dp`` minus
        the lost replicas; torch.distributed and megatron's parallel_state are re-formed for it,
        every method is planned for it (a batch is split over the remaining replicas) and the
        recovery checks run (:mod:`.remesh`).  Raises ``ShardLostError`` when no replica would be
        left.  Needs a policy other than ``"fail"``; the group's policy ``"shrink"`` does this by
        itself on a death.
        """
        timeout_s = positive_seconds(timeout_s, "shrink_dead_replicas(timeout_s)", BackendError)
        return self._shrink(timeout_s)

    def _shrink(self, timeout_s: float, log: bool = True) -> RemeshReport | None:
        executor = self.executor
        check_recoverable(self._hosts, executor, "shrink the group")
        self._check_remeshable("shrink")
        dead = set(executor.dead) or probe_dead(self._hosts)
        if not dead:
            return None
        rec = self._recovery
        replacing, rec.replacing = rec.replacing, True
        try:
            report = shrink_dead_replicas(self._hosts, executor, self.mesh, rec, dead, timeout_s, self.weight_versions)
        finally:
            rec.replacing = replacing
        if log:
            logger.warning("%s", report.format())
        return report

    def grow(self, replicas: int = 1, timeout_s: float = DEFAULT_START_TIMEOUT) -> RemeshReport:
        """Add ``replicas`` dp replicas, copying their state from the live ones; the next call uses them.

        Processes come from the group's warm spares, then from bundles it holds without a rank
        (left by a shrink), then from new placement groups on nodes with room; when they cannot
        all be had within ``timeout_s`` nothing changes and ``RecoveryError`` says so.  Then every
        rank re-forms torch.distributed (and parallel_state) for the mesh with ``dp + replicas``,
        each new rank restores its state from the live rank holding its shard, and the recovery
        checks run (:mod:`.remesh`).
        """
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise BackendError(f"grow(replicas=...) must be a positive integer, got {replicas!r}")
        timeout_s = positive_seconds(timeout_s, "grow(timeout_s)", BackendError)
        self._check_remeshable("grow")
        rec = self._recovery
        replacing, rec.replacing = rec.replacing, True
        try:
            report = grow(self._hosts, self.executor, self.mesh, rec, replicas, timeout_s, self.weight_versions)
        finally:
            rec.replacing = replacing
        logger.warning("%s", report.format())
        return report

    def _check_remeshable(self, what: str) -> None:
        """Named meshes cannot follow a change of the dp size (the policies are refused at creation too)."""
        if self._table.extra_meshes:
            raise RecoveryError(f"cannot {what} the group: its named meshes {sorted(self._table.extra_meshes)} cannot "
                                "change their dp size with it; replace dead ranks instead (replace_dead_ranks)")

    @property
    def remeshes(self) -> list[RemeshReport]:
        """Every shrink and grow done so far, with its timings (shared by the role groups)."""
        return list(self._recovery.remeshes)

    def add_recovery_check(self, check: Any) -> None:
        """Run ``check()`` after every replacement (e.g. megatron's cross-check); it raises on a mismatch."""
        self._recovery.checks.append(check)

    def set_control(self, mode: str, agent_fanout: int | None = None) -> None:
        """How this group's calls reach its ranks from now on: ``"auto"`` (a call session or node
        agents where they can be used: :mod:`.session`) or ``"ray"`` (one Ray task per rank).

        The environment's ``RANKMESH_CONTROL`` gives the starting mode.  Switching to ``"ray"``
        keeps an open session for switching back (benchmarks alternate paths this way); calls stay
        in the order they were sent across the switch.  Shared by the role groups of its processes.

        ``agent_fanout``: how many agents the controller, and each agent, send a call on to, for a
        group across nodes (:mod:`.agent`; default :data:`.agent.AGENT_FANOUT`).  Changing it
        restarts the group's node agents in the new tree on the next call.
        """
        self._executor.set_control(mode, agent_fanout)

    @property
    def on_rank_death(self) -> str:
        return self._recovery.policy

    @property
    def on_hang(self) -> str:
        """What a call past its timeout does to its stuck ranks: ``"raise"`` (they run on) or ``"kill"``."""
        return self.executor.on_hang

    @property
    def spares(self) -> list[SpareStatus]:
        """The group's warm spares (``RayResourcePool(..., spares=N)``): node, pid and whether warm yet.

        Spares are started after the group and after every replacement, in the background.
        """
        return [spare.describe() for spare in self._hosts.spares]

    @property
    def replacements(self) -> list[ReplacementReport]:
        """Every replacement done so far, with its timings (shared by the role groups)."""
        return list(self._recovery.reports)

    def _call(
        self, binding: Any, args: Any, kwargs: Any, timeout: float | None = None, stall_warn_s: float | None = None
    ) -> Any:
        def rerun() -> Any:  # after a shrink: the same call, planned for the new mesh
            return super(RayWorkerGroup, self)._call(self._rebound(binding), args, kwargs, timeout, stall_warn_s)

        return self._guarded(binding, lambda: super(RayWorkerGroup, self)._call(binding, args, kwargs, timeout, stall_warn_s),
                             rerun)

    def _rebound(self, binding: Any) -> Any:
        """``binding`` resolved again on the group's current method table (its mesh changed)."""
        bound = self._table.methods.get(binding.name)
        if bound is not None and (bound.binding.role, bound.binding.target) == (binding.role, binding.target):
            return bound.binding
        if isinstance(binding.entry, PerRank):
            raise RecoveryError(f"{binding.name}: the group's mesh changed (a shrink) and this call names its ranks "
                                "in the old numbering; call it again for the new mesh", [])
        return self._table.resolve(binding.name, binding.method, binding.site.params)

    def _guarded(self, binding: Any, run: Any, rerun: Any = None) -> Any:
        """Run one call (``run``) under the ``on_rank_death="replace"`` policy: replace, then retry once.

        Only a blocking call is retried (a non-blocking one raises from its future; the next
        call replaces first).  The retry re-sends the caller's unchanged arguments.  A
        ``WorkerError`` is retried only if a rank is found dead (:func:`.recovery.probe_dead`):
        survivors may see the death as a gloo error before Ray reports it.  Replica views of the
        group (``wg.replicas``) run their calls through here too.
        """
        rec = self._recovery
        if rec.policy not in RETRYING or rec.replacing:
            return run()
        if self.executor.failed is not None and not isinstance(self.executor.failed, ControllerCutOffError):
            # an earlier (non-blocking) call's death: recover first
            if isinstance(self._recover(None), RemeshReport):
                run = self._replanned(binding, rerun, self._recovery.remeshes[-1])
        start = time.monotonic()
        try:
            return run()
        except (WorkerDiedError, WorkerError, FetchTimeoutError, AgentLostError) as err:
            if not binding.method.blocking:
                raise
            if isinstance(err, FetchTimeoutError):  # on_hang="kill" killed the ranks it was stuck on: recover them
                if self.executor.on_hang != "kill" or not self.executor.dead:
                    raise
            elif not isinstance(err, WorkerDiedError):
                # A peer's death can reach the survivors as a gloo error before Ray reports the
                # process dead (a removed node takes its health checks to be declared dead); an
                # agent lost with its node says nothing of its ranks until the GCS declares the node dead.
                wait_s = node_death_window_s() + 1.0 if isinstance(err, AgentLostError) else PROBE_TIMEOUT
                dead = probe_dead(self._hosts, wait_s)
                if not dead:
                    raise
                failure = self.executor.fail(WorkerDiedError(min(dead), binding.name, f"found dead after: {err.detail}",
                                                             ranks=sorted(dead)))
                if not isinstance(failure, WorkerDiedError):  # the controller's node was cut off: nothing to recover
                    raise failure from err
            detected = time.monotonic() - start
            logger.info("%s: %s; recovering (%s) and retrying once", binding.name, err, rec.policy)
            report = self._recover(detected)
            if report is not None:  # a handled failure is one line: what died, what was done, how long
                logger.warning("%s: %s; retrying the call once", binding.name, report.format())
            if isinstance(report, RemeshReport):
                run = self._replanned(binding, rerun, report)
        return run()

    def _replanned(self, binding: Any, rerun: Any, report: RemeshReport) -> Any:
        """The call to run after a shrink: ``rerun`` (planned for the new mesh), with its errors explained."""
        if rerun is None:  # a replica view's call: its replicas were numbered for the old mesh
            raise RecoveryError(
                f"{binding.name}: the group shrank to {report.new_mesh} (dp replicas {report.lost_replicas} "
                "dropped), so the replica view this call was made on no longer exists; take a new view "
                "(wg.replica(i)) and call again", report.dead)

        def run() -> Any:
            try:
                return rerun()
            except PaddingError as exc:
                raise RecoveryError(
                    f"{binding.name}: the group shrank to {report.new_mesh} after losing dp replicas "
                    f"{report.lost_replicas} (dead ranks {report.dead}), and the call's batch does not divide over "
                    f"the {report.new_mesh.size('dp')} replicas left ({exc}); pass a global batch divisible by every "
                    "dp size the group may shrink to, or use on_rank_death='replace'",
                    report.dead,
                ) from exc

        return run

    def _recover(self, detected: float | None) -> Any:
        """Bring a group with dead ranks back to work by its policy: replace them, or shrink, or replace else shrink."""
        rec = self._recovery
        if rec.policy == "shrink":
            report = self._shrink(DEFAULT_START_TIMEOUT, log=detected is None)
        else:
            def shrink_instead(dead: set[int]) -> RemeshReport:
                return shrink_dead_replicas(self._hosts, self.executor, self.mesh, rec, dead, DEFAULT_START_TIMEOUT,
                                            self.weight_versions, drained=True)

            fallback = shrink_instead if rec.policy == "replace_or_shrink" else None
            report = replace_dead_ranks(self._hosts, self.executor, self.mesh, rec, DEFAULT_START_TIMEOUT, fallback)
            if report is not None and detected is None:  # no failed call to log it with
                logger.warning("%s", report.format())
        if report is not None:
            report.detected_s = detected
        return report

    # ----- lifetime --------------------------------------------------------------------------------

    def __enter__(self) -> "RayWorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class PoolPerGroup:
    """Start each group on a new :class:`RayResourcePool` of its own; stopping it stops its processes.

    The default of code that starts one group per role (``rankmesh demo``,
    ``scripts/validate_rank_mapping.py``, ``scripts/bench_dispatch.py``).  That code takes any
    object with these two methods, so a caller may run the groups elsewhere: the tests lend
    processes that outlive a group (``tests/hosts.py``), since starting one costs seconds of CPU.
    ``group_kwargs`` (e.g. ``start_timeout``) go to every group.
    """

    def __init__(self, use_gpu: bool = False, **group_kwargs: Any) -> None:
        self.use_gpu = use_gpu
        self.group_kwargs = group_kwargs

    def start(
        self,
        process_on_nodes: Sequence[int],
        ray_cls_with_init: RayClassWithInitArgs,
        mesh: RankMesh,
        *,
        pool_name: str | None = None,
        spares: int = 0,
        **group_kwargs: Any,
    ) -> RayWorkerGroup:
        """A new group over ``mesh`` on a new pool of ``process_on_nodes`` (with ``spares`` standby bundles)."""
        pool = RayResourcePool(list(process_on_nodes), use_gpu=self.use_gpu, name_prefix=pool_name, spares=spares)
        return RayWorkerGroup(pool, ray_cls_with_init, mesh=mesh, **{**self.group_kwargs, **group_kwargs})

    def stop(self, group: RayWorkerGroup) -> None:
        """Kill the group's processes and release its pool."""
        group.shutdown()
