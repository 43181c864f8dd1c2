"""RayWorkerGroup: a worker group whose ranks are Ray actors placed by a resource pool.

Method binding and dispatch are :class:`rankmesh.group.WorkerGroup`'s, exactly as for the
in-process backend; this module only starts the processes (:func:`.actor.start_hosts`), wires a
:class:`.transport.RayExecutor` to them and adds what only Ray has: placement, detached groups,
colocated roles (:meth:`RayWorkerGroup.spawn`) and shutdown.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Mapping, Sequence

from rankmesh.dispatch.modes import DispatchRegistry
from rankmesh.errors import BackendError, WorkerEnvError
from rankmesh.group import WorkerGroup
from rankmesh.mesh import RankMesh
from rankmesh.placement import Placement, RankPlace

from .actor import HostSet, RoleSpec, build_workers, rank_of_name, start_hosts
from .pool import RayResourcePool
from .rendezvous import RESERVED_ENV
from .runtime import DETACHED_NAMESPACE, ensure_ray
from .transport import RayExecutor

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT = 300.0
"""Seconds to wait for every rank's process to start and its worker to be built."""


def unwrap_actor_class(cls: Any) -> type:
    """The plain class behind a ``@ray.remote`` class (or ``cls`` itself)."""
    inner = getattr(cls, "__ray_actor_class__", None)
    if inner is not None:
        return inner
    if not isinstance(cls, type):
        raise BackendError(f"expected a worker class, got {type(cls).__name__}: {cls!r}")
    return cls


class _DryExecutor:
    """Stands in for the executor while a group binds its methods before starting processes."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def share(self, obj: Any) -> Any:  # pragma: no cover - never called
        raise BackendError("the dry-run executor cannot ship data")

    submit = fetch = fetcher = share


class RayClassWithInitArgs:
    """A worker class and its constructor arguments, as verl's ``RayClassWithInitArgs``.

    ``cls`` may be a plain class or a ``@ray.remote`` class (its options are not used; pass Ray
    actor options, e.g. ``runtime_env``, with :meth:`update_options`).
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.cls = unwrap_actor_class(cls)
        self.args = args
        self.kwargs = kwargs
        self._options: dict[str, Any] = {}

    def update_options(self, options: Mapping[str, Any]) -> None:
        """Extra Ray actor options for every rank (``runtime_env``, ``max_concurrency`` ...)."""
        reserved = {"scheduling_strategy", "name", "namespace", "lifetime", "num_cpus", "num_gpus"} & set(options)
        if reserved:
            raise BackendError(f"options {sorted(reserved)} are set by the resource pool and the group")
        self._options.update(options)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self._options)

    @property
    def roles(self) -> dict[str | None, RoleSpec]:
        """Role name -> what to build in each process (one unnamed role here)."""
        return {None: RoleSpec(self.cls, tuple(self.args), dict(self.kwargs))}

    def __repr__(self) -> str:
        return f"RayClassWithInitArgs({self.cls.__qualname__}, args={self.args!r}, kwargs={self.kwargs!r})"


def check_timeout(seconds: float | None) -> None:
    """A call timeout is ``None`` or a positive number of seconds."""
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0):
        raise BackendError(f"call_timeout_s must be None or a positive number of seconds, got {seconds!r}")


def _coords(mesh: RankMesh, rank: int) -> dict[str, int]:
    info = mesh.coords(rank)
    return {"tp": info.tp_rank, "cp": info.cp_rank, "dp": info.dp_rank, "pp": info.pp_rank}


def check_worker_env(worker_env: Mapping[str, Any] | None) -> dict[str, str]:
    """``worker_env`` as strings; refuses the variables the group sets itself."""
    env = dict(worker_env or {})
    clash = sorted(set(env) & set(RESERVED_ENV))
    if clash:
        raise WorkerEnvError(
            f"worker_env may not set {', '.join(clash)}: the group sets {', '.join(RESERVED_ENV)} for every rank"
        )
    bad = [k for k, v in env.items() if not isinstance(k, str) or not k or v is None]
    if bad:
        raise WorkerEnvError(f"worker_env has invalid entries: {bad!r}")
    return {k: str(v) for k, v in env.items()}


class RayWorkerGroup(WorkerGroup):
    """One Ray actor per bundle of ``resource_pool``, each hosting ``ray_cls_with_init``'s class.

    ``mesh`` (default ``RankMesh(dp=world_size)``) must cover the pool's processes.  Every rank
    gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, plus
    ``worker_env``.  ``detached=True`` (needs a detached pool) names the actors
    ``{name_prefix}_{rank}`` and lets them outlive this driver (see :meth:`from_detached`).
    ``call_timeout_s`` bounds every call (``FetchTimeoutError`` naming the unfinished ranks);
    ``wg.with_timeout(s).method(...)`` overrides it for one call.
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
    ) -> None:
        check_timeout(call_timeout_s)
        if not isinstance(resource_pool, RayResourcePool):
            raise BackendError(f"resource_pool must be a RayResourcePool, got {type(resource_pool).__name__}")
        if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
            ray_cls_with_init = RayClassWithInitArgs(ray_cls_with_init)
        if not bin_pack:
            logger.warning("bin_pack=False is not supported: ranks always fill nodes in order")
        env = check_worker_env(worker_env)
        world = resource_pool.world_size
        mesh = mesh if mesh is not None else RankMesh(dp=world)
        # Bind once without processes: bad meshes and modes fail before anything starts.
        WorkerGroup(_DryExecutor(world), ray_cls_with_init.cls, mesh=mesh, meshes=meshes, registry=registry)
        if detached and not resource_pool.detached:
            raise BackendError("a detached group needs a detached pool: RayResourcePool(..., detached=True)")
        ensure_ray()
        prefix = name_prefix or f"rankmesh-{uuid.uuid4().hex[:8]}"
        resource_pool.acquire()
        try:
            hosts = start_hosts(
                resource_pool,
                ray_cls_with_init.roles,
                mesh,
                dict(meshes or {}),
                prefix,
                detached,
                env,
                ray_cls_with_init.options,
                start_timeout,
            )
        except BaseException:
            resource_pool.release()
            raise
        hosts.pool = resource_pool
        try:
            self._adopt(hosts, ray_cls_with_init.cls, mesh, meshes, None, registry, call_timeout_s=call_timeout_s)
        except BaseException:
            hosts.shutdown()
            raise
        self._resource_pool = resource_pool
        self._ray_cls_with_init = ray_cls_with_init
        logger.info("started worker group %s: %d ranks, %s, nodes %s", prefix, world, mesh, self.placement)
        spans = self.spanning_groups()
        if spans:
            logger.warning(
                "worker group %s: %d tp/cp/ep group(s) cross nodes (their collectives go over the network), e.g. %s",
                prefix,
                len(spans),
                spans[0].describe(),
            )

    @classmethod
    def _on_hosts(
        cls,
        hosts: HostSet,
        ray_cls_with_init: RayClassWithInitArgs,
        mesh: RankMesh | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
        worker_env: Mapping[str, Any] | None = None,
        timeout: float = DEFAULT_START_TIMEOUT,
    ) -> "RayWorkerGroup":
        """Build new workers in already running, torn-down hosts (process reuse for tests).

        ``hosts`` comes from :func:`.actor.launch_hosts`; a previous group on them must have
        been torn down (``hosts.teardown_workers()``) and must not be used any more.
        """
        mesh = mesh if mesh is not None else RankMesh(dp=len(hosts.actors))
        WorkerGroup._check_meshes(len(hosts.actors), mesh, meshes or {})
        build_workers(hosts, ray_cls_with_init.roles, mesh, dict(meshes or {}), check_worker_env(worker_env), timeout)
        group = cls.__new__(cls)
        group._adopt(hosts, ray_cls_with_init.cls, mesh, meshes, None, None)
        group._ray_cls_with_init = ray_cls_with_init
        return group

    def _adopt(
        self,
        hosts: HostSet,
        worker_cls: type,
        mesh: RankMesh,
        meshes: Mapping[str, RankMesh] | None,
        role: str | None,
        registry: DispatchRegistry | None,
        executor: RayExecutor | None = None,
        call_timeout_s: float | None = None,
    ) -> None:
        """Bind ``worker_cls``'s methods over already started ``hosts`` (sharing ``executor``)."""
        self._hosts = hosts
        self._resource_pool = hosts.pool
        if executor is None:
            nodes = [i.get("node_ip") for i in hosts.info] if hosts.info else None
            coords = [_coords(mesh, r) for r in range(len(hosts.actors))]
            executor = RayExecutor(hosts.actors, nodes, coords, call_timeout_s)
        WorkerGroup.__init__(self, executor, worker_cls, mesh=mesh, meshes=meshes, role=role, registry=registry)

    def _view(self, worker_cls: type, role: str | None) -> "RayWorkerGroup":
        """Another group over the same processes (a colocated role)."""
        view = RayWorkerGroup.__new__(type(self))
        # One executor for all views: one closed flag, one set of transport stats.
        view._adopt(self._hosts, worker_cls, self.mesh, self._extra_meshes(), role, self._registry, self._executor)
        view._ray_cls_with_init = None
        return view

    def _extra_meshes(self) -> dict[str, RankMesh]:
        return {k: v for k, v in self.meshes.items() if k != "default"}

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
        return self._resource_pool

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

    def node_of(self, rank: int) -> str:
        """Ray node id of ``rank``."""
        return self._hosts.info[rank]["node_id"]

    def spanning_groups(self, tokens: Sequence[str] = ("tp", "cp", "ep")) -> list:
        """Communication groups of the mesh that cross a node boundary in this placement."""
        return self.placement.spanning_groups(self.mesh, tokens)

    # ----- colocated roles ------------------------------------------------------------------------

    def spawn(self, prefix_set: Sequence[str]) -> dict[str, "RayWorkerGroup"]:
        """Role name -> a group over the same processes whose methods are that role's."""
        from .colocate import spawn

        return spawn(self, prefix_set)

    def fuse(self, prefix_set: Sequence[str]) -> dict[str, "RayWorkerGroup"]:
        """:meth:`spawn`, and also set each role group as an attribute (``wg.actor``)."""
        groups = self.spawn(prefix_set)
        for role, group in groups.items():
            if hasattr(type(self), role) or role in self.method_names:
                raise BackendError(f"cannot fuse role {role!r}: it clashes with an attribute of the group")
            setattr(self, role, group)
        return groups

    # ----- lifetime --------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._hosts.closed

    @property
    def failed(self) -> BaseException | None:
        """The WorkerDiedError that failed this group (its processes are stopped), else None."""
        return self._executor.failed  # type: ignore[attr-defined]

    @property
    def call_timeout_s(self) -> float | None:
        return self._executor.call_timeout_s  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        """Kill the processes (every role spawned from them too) and release the placement groups."""
        self._hosts.shutdown()
        self._executor.closed = True  # type: ignore[attr-defined]

    def __enter__(self) -> "RayWorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

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
        import ray

        from .colocate import fused_worker_class
        from .transport import Pending, fetch_outputs

        ensure_ray()
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
        info = fetch_outputs([Pending(a.describe.remote(), r, "describe") for r, a in enumerate(actors)], timeout)
        if any("world_size" not in i for i in info):
            raise BackendError(f"detached group {name_prefix!r} is not set up yet")
        if info[0]["world_size"] != world:
            raise BackendError(f"detached group {name_prefix!r} reports world size {info[0]['world_size']}, found {world} actors")
        hosts = HostSet(
            actors=actors,
            names=[found[r] for r in range(world)],
            info=info,
            name_prefix=name_prefix,
            detached=True,
            pg_ids=[i["placement_group_id"] for i in info if i.get("placement_group_id")],
        )
        if ray_cls_with_init is not None:
            worker_cls = ray_cls_with_init.cls
        classes = info[0]["role_classes"]
        if worker_cls is None:
            worker_cls = classes[None] if list(classes) == [None] else fused_worker_class(classes)
        group = cls.__new__(cls)
        built = info[0]["mesh"]
        if mesh is not None and mesh != built:
            raise BackendError(f"detached group {name_prefix!r} was built with {built}, not {mesh}")
        mesh = built
        meshes = meshes if meshes is not None else {k: v for k, v in info[0]["meshes"].items() if k != "default"}
        group._adopt(hosts, unwrap_actor_class(worker_cls), mesh, meshes, None, None)
        group._ray_cls_with_init = ray_cls_with_init
        return group
