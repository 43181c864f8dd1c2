"""The generic worker-host actor: one Ray actor per rank, hosting the user's worker object(s).

Why one generic actor instead of ``ray.remote(UserClass)``: the host sets the rank's environment
and builds the user's class inside :func:`rankmesh.worker.construct`, so ``self.rank``/``self.mesh``
work in ``__init__``; it can host several colocated roles in one process; and every call goes
through :func:`rankmesh.worker.invoke`, the same worker-side path as the in-process backend, so
errors and output dropping behave identically.

Creation takes three steps so that MASTER_PORT is known before any user code runs:
``WorkerHost(rank)`` (cheap), rank 0's :meth:`WorkerHost.reserve_master_port`, then
:meth:`WorkerHost.setup` on every rank with the full environment.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from rankmesh.errors import BackendError
from rankmesh.mesh import RankMesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleSpec:
    """One worker class to build in each process, with its constructor arguments."""

    cls: type
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HostSetup:
    """Everything one rank's host needs to build its workers (sent once, at setup)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_index: int
    mesh: RankMesh
    meshes: Mapping[str, RankMesh]
    roles: Mapping[str | None, RoleSpec]
    env: Mapping[str, str]
    group_name: str


class _SharedSlot:
    """Placeholder for the i-th resolved :class:`Shared` reference of one call (see transport)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self):
        return (_SharedSlot, (self.index,))


class WorkerHost:
    """Ray actor body; wrapped with ``ray.remote`` by the group (options differ per group)."""

    def __init__(self, rank: int, group_name: str) -> None:
        self._rank = rank
        self._group_name = group_name
        self._setup: HostSetup | None = None
        self._workers: dict[str | None, Any] = {}
        self._master: tuple[str, int] | None = None
        self._env_before: dict[str, str | None] = {}

    # ----- creation ----------------------------------------------------------------------------

    def node_info(self) -> dict[str, Any]:
        """Where this process runs, as Ray sees it (checked against the pool by the group)."""
        import ray

        ctx = ray.get_runtime_context()
        pg = ctx.get_placement_group_id()
        try:
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        except Exception:  # pragma: no cover - no GPU support in this Ray
            gpu_ids = []
        return {
            "rank": self._rank,
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "placement_group_id": pg,
            "gpu_ids": gpu_ids,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def reserve_master_port(self) -> tuple[str, int]:
        """Rank 0 only: keep a socket bound on this node and publish (MASTER_ADDR, MASTER_PORT)."""
        from .rendezvous import reserve_port
        from .runtime import node_ip_address

        if self._master is None:
            addr = node_ip_address()
            self._master = (addr, reserve_port(addr))
        return self._master

    def setup(self, setup: HostSetup) -> None:
        """Set the environment, then build every role inside the rank's worker context."""
        from rankmesh.worker import WorkerContext, construct

        if self._setup is not None:
            raise BackendError(f"rank {self._rank} of {self._group_name} is already set up")
        self._env_before = {k: os.environ.get(k) for k in setup.env}
        os.environ.update({k: str(v) for k, v in setup.env.items()})
        import ray

        node = ray.util.get_node_ip_address()
        for role, spec in setup.roles.items():
            ctx = WorkerContext(
                rank=setup.rank,
                world_size=setup.world_size,
                mesh=setup.mesh,
                meshes=dict(setup.meshes),
                local_rank=setup.local_rank,
                local_world_size=setup.local_world_size,
                node=node,
                role=role,
            )
            self._workers[role] = construct(spec.cls, ctx, tuple(spec.args), dict(spec.kwargs))
        self._setup = setup

    def teardown(self) -> None:
        """Drop the role objects and restore the environment, so :meth:`setup` may run again.

        Process-wide state the workers created (an initialized torch.distributed, module
        globals) stays: this exists to reuse processes in tests, not to isolate workloads.
        """
        self._workers.clear()
        for key, value in self._env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._setup = None

    # ----- calls -------------------------------------------------------------------------------

    def _worker(self, role: str | None, method: str) -> tuple[Any, str]:
        """The worker object a call goes to, and the method name on it.

        ``role=None`` in a process hosting several roles is a call on the fused group, whose
        methods are named ``{role}_{method}`` (verl's colocated naming).
        """
        if role in self._workers:
            return self._workers[role], method
        if role is None and len(self._workers) == 1:
            return next(iter(self._workers.values())), method
        if role is None:
            for name in sorted((r for r in self._workers if r), key=len, reverse=True):
                if method.startswith(f"{name}_"):
                    return self._workers[name], method[len(name) + 1 :]
        raise BackendError(
            f"rank {self._rank} of {self._group_name} hosts roles {sorted(map(str, self._workers))}; "
            f"cannot route {method!r} for role {role!r}"
        )

    def execute(self, header: bytes, *resolved: Any) -> Any:
        """Run one method through :func:`rankmesh.worker.invoke`.

        ``header`` is ``(role, method, args, kwargs, return_output)`` pickled by the controller
        (see ``RayExecutor.submit``): one small bytes argument instead of five, because Ray
        serializes and checks every task argument separately (~1 ms more per fan-out to 8 ranks
        on 2 cores).  ``resolved`` are the values of the call's shared objects, fetched by Ray
        before the call starts (and rebuilt as this rank's private copies by the data layer);
        the arguments refer to them through :class:`_SharedSlot` placeholders.
        """
        import pickle

        from rankmesh.executor import Shared
        from rankmesh.worker import invoke

        role, method, args, kwargs, return_output = pickle.loads(header)
        worker, method = self._worker(role, method)

        def swap(value: Any) -> Any:
            if isinstance(value, _SharedSlot):
                return Shared(value.index)
            return value

        if resolved:
            args = tuple(swap(a) for a in args)
            kwargs = {k: swap(v) for k, v in kwargs.items()}
        return invoke(
            worker,
            method,
            args,
            kwargs,
            return_output=return_output,
            resolve=lambda shared: resolved[shared.ref],
        )

    # ----- introspection (attaching to detached groups, tests) ---------------------------------

    def describe(self) -> dict[str, Any]:
        """What another driver needs to attach: rank, world size, mesh, roles, placement."""
        info = self.node_info()
        s = self._setup
        if s is not None:
            info.update(
                world_size=s.world_size,
                local_rank=s.local_rank,
                local_world_size=s.local_world_size,
                node_index=s.node_index,
                mesh=s.mesh,
                meshes=dict(s.meshes),
                roles={role: f"{spec.cls.__module__}.{spec.cls.__qualname__}" for role, spec in s.roles.items()},
                role_classes={role: spec.cls for role, spec in s.roles.items()},
                group_name=s.group_name,
            )
        return info

    def ping(self) -> int:
        return self._rank


# ----- controller side: starting and stopping the hosts of one group ----------------------------


@dataclass
class HostSet:
    """The processes of one group (shared by the role groups spawned from it).

    ``pool``: released on shutdown (its placement groups go with its last user).  ``pg_ids``:
    placement groups to remove on shutdown when there is no pool object (a group attached with
    ``from_detached``).  ``places``/``master``: rank placement and rendezvous address.
    """

    actors: list[Any]
    names: list[str]
    info: list[dict[str, Any]]
    name_prefix: str
    detached: bool
    pool: Any = None
    pg_ids: list[str] = field(default_factory=list)
    closed: bool = False
    places: list[Any] = field(default_factory=list)
    master: tuple[str, int] | None = None

    def teardown_workers(self, timeout: float = 60.0) -> None:
        """Drop the role objects in every host, keeping the processes (see ``WorkerHost.teardown``)."""
        from .transport import Pending, fetch_outputs

        fetch_outputs([Pending(a.teardown.remote(), r, "teardown") for r, a in enumerate(self.actors)], timeout)

    def shutdown(self) -> None:
        """Kill every host (all roles in them), then release or remove the placement groups."""
        if self.closed:
            return
        self.closed = True
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead
                logger.debug("killing %s: %s", actor, exc)
        if self.pool is not None:
            self.pool.release()
        for pg_id in dict.fromkeys(self.pg_ids):
            remove_pg_by_id(pg_id)
        logger.info("worker group %s shut down (%d processes)", self.name_prefix, len(self.actors))


def remove_pg_by_id(pg_id: str) -> None:
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
    except Exception as exc:  # already removed
        logger.debug("removing placement group %s: %s", pg_id, exc)


def actor_name(name_prefix: str, rank: int) -> str:
    """Name of a detached group's actor: ``{name_prefix}_{rank}`` (prefix + rank)."""
    return f"{name_prefix}_{rank}"


def rank_of_name(name: str, name_prefix: str) -> int | None:
    """Inverse of :func:`actor_name`; ``None`` for names of other groups (even ``{prefix}_x_1``)."""
    head = f"{name_prefix}_"
    rest = name[len(head) :] if name.startswith(head) else ""
    return int(rest) if rest.isdigit() else None


def launch_hosts(pool: Any, name_prefix: str, detached: bool, options: Mapping[str, Any], timeout: float) -> HostSet:
    """Start one (empty) host per bundle of ``pool`` and reserve MASTER_PORT on rank 0."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from .runtime import DETACHED_NAMESPACE
    from .transport import Pending, fetch_outputs

    slots = pool.slots()
    remote = ray.remote(WorkerHost)
    actors, names = [], []
    for rank, slot in enumerate(slots):
        opts: dict[str, Any] = {
            **pool.actor_resources,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=slot.pg, placement_group_bundle_index=slot.bundle_index
            ),
            **dict(options),
        }
        names.append(actor_name(name_prefix, rank))
        if detached:
            opts.update(name=names[-1], namespace=DETACHED_NAMESPACE, lifetime="detached")
        actors.append(remote.options(**opts).remote(rank, name_prefix))
    hosts = HostSet(actors=actors, names=names, info=[], name_prefix=name_prefix, detached=detached)
    hosts.places = pool.places()
    try:
        pend = [Pending(a.node_info.remote(), r, "start") for r, a in enumerate(actors)]
        pend.append(Pending(actors[0].reserve_master_port.remote(), 0, "reserve_master_port"))
        *info, master = fetch_outputs(pend, timeout=timeout)
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
    roles: Mapping[str | None, RoleSpec],
    mesh: RankMesh,
    meshes: Mapping[str, RankMesh],
    worker_env: Mapping[str, str],
    timeout: float,
) -> None:
    """Set every rank's environment and build its role objects (all ranks in parallel)."""
    from .transport import Pending, fetch_outputs

    world = len(hosts.actors)
    addr, port = hosts.master
    setups = []
    for rank, place in enumerate(hosts.places):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(place.local_rank),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
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
        )
        node = hosts.info[rank].get("node_ip") if hosts.info else None
        setups.append(Pending(hosts.actors[rank].setup.remote(setup), rank, "setup", node))
    fetch_outputs(setups, timeout=timeout)


def start_hosts(
    pool: Any,
    roles: Mapping[str | None, RoleSpec],
    mesh: RankMesh,
    meshes: Mapping[str, RankMesh],
    name_prefix: str,
    detached: bool,
    worker_env: Mapping[str, str],
    options: Mapping[str, Any],
    timeout: float,
) -> HostSet:
    """:func:`launch_hosts` then :func:`build_workers`; on failure every host is killed."""
    hosts = launch_hosts(pool, name_prefix, detached, options, timeout)
    try:
        build_workers(hosts, roles, mesh, meshes, worker_env, timeout)
    except BaseException:
        hosts.shutdown()
        raise
    return hosts
