"""verl's ``Worker``, ``RayWorkerGroup`` and ``RayResourcePool`` names over rankmesh's: function shipping, fused roles, ObjectRef futures.

A verl worker class calls a few ``Worker`` methods rankmesh's own API spells differently or
leaves out (``get_master_addr_port``, ``execute_with_func_generator``, verl's
``set_dispatch_collect(mesh_name, ...)``), and a verl driver reads ``wg.master_address``,
``ray.get``s the ObjectRefs of ``wg.execute_all_async(...)``, passes verl's arguments to
``pool.get_placement_groups(...)`` or fuses roles into one process with
:func:`create_colocated_worker_raw_cls`.  The classes here add exactly those names on top of
:class:`rankmesh.worker.Worker` and rankmesh's Ray classes; rank, mesh, dispatch and failures
stay rankmesh's.

Fused workers, as verl builds them: the raw class is one :class:`Worker` whose ``__init__``
builds every role object in the same process and keeps them as attributes (``self.actor``) and
in ``fused_worker_dict``; ``wg.fuse(names)`` gives the group one sub-group per role, and the
worker host routes a role's call to the role object the fused worker holds
(:data:`rankmesh.worker.FUSED_ROLES_ATTR`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from rankmesh.backends.ray import RayClassWithInitArgs
from rankmesh.backends.ray import RayResourcePool as CoreRayResourcePool
from rankmesh.backends.ray import RayWorkerGroup as CoreRayWorkerGroup
from rankmesh.backends.ray.classes import unwrap_actor_class
from rankmesh.backends.ray.tasks import output_refs
from rankmesh.dispatch import Dispatch, Execute, register
from rankmesh.errors import BackendError, DispatchAssertionError
from rankmesh.binding import ROLES_ATTR
from rankmesh.worker import FUSED_ROLES_ATTR
from rankmesh.worker import Worker as CoreWorker

#: The variables a verl worker reads; the backend sets them (CUDA_VISIBLE_DEVICES: Ray or the user).
ENV_KEYS = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")


def _last(values: Mapping[str, Any], what: str) -> Any:
    if not values:
        raise DispatchAssertionError(f"set_dispatch_collect: {what} is empty")
    return list(values.values())[-1]


class Worker(CoreWorker):
    """rankmesh's Worker with verl 0.9.1's extra methods (every rank, mesh and context is rankmesh's)."""

    fused_worker_attr_name = FUSED_ROLES_ATTR

    def __init__(self, cuda_visible_devices: str | None = None) -> None:
        super().__init__()

    @classmethod
    def env_keys(cls) -> list[str]:
        """The environment variables that configure a worker (verl's list)."""
        return list(ENV_KEYS)

    def get_master_addr_port(self) -> tuple[str | None, str | None]:
        """The group's torch.distributed rendezvous (``MASTER_ADDR``, ``MASTER_PORT``) as strings."""
        return os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")

    def get_available_master_addr_port(self) -> tuple[str, str]:
        """A loopback address and a port free right now, for a rendezvous of the worker's own."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", str(s.getsockname()[1])

    get_availale_master_addr_port = get_available_master_addr_port  # verl's misspelt alias

    def get_cuda_visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` as this process sees it, or ``"not set"``."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "not set")

    def get_fused_worker_by_name(self, worker_name: str) -> Any:
        """The role object ``worker_name`` of this process's fused worker, or None."""
        return getattr(self, FUSED_ROLES_ATTR, {}).get(worker_name)

    # --- verl's dispatch info signatures ---------------------------------------------------------

    def query_collect_info(self, mesh_name: str) -> bool:
        """Whether this rank's output is kept for ``mesh_name``; unknown meshes fail as verl's assert."""
        found = self._query_collect_info(mesh_name)
        if found is None:
            raise DispatchAssertionError(f"{mesh_name} is not registered in {type(self).__name__}")
        return found

    def get_dispatch_collect(self) -> dict[str, dict[str, Any]]:  # type: ignore[override]
        """``{"dispatch_dp_rank": {...}, "collect_dp_rank": {...}}``, ready for ``set_dispatch_collect(name, **it)``."""
        dispatch, collect = super().get_dispatch_collect()
        return {"dispatch_dp_rank": dispatch, "collect_dp_rank": collect}

    def set_dispatch_collect(  # type: ignore[override]
        self, mesh_name: str, dispatch_dp_rank: Mapping[str, int], collect_dp_rank: Mapping[str, bool]
    ) -> None:
        """Register ``mesh_name`` with another worker's dispatch info (verl's signature and rule:
        the last value of each mapping); a name already registered fails as verl's assert."""
        dispatch, collect = CoreWorker.get_dispatch_collect(self)
        if mesh_name in dispatch or mesh_name in collect:
            raise DispatchAssertionError(f"{mesh_name} is already registered, {sorted(dispatch)}")
        dispatch[mesh_name] = int(_last(dispatch_dp_rank, "dispatch_dp_rank"))
        collect[mesh_name] = bool(_last(collect_dp_rank, "collect_dp_rank"))
        CoreWorker.set_dispatch_collect(self, dispatch, collect)

    # --- shipping functions to ranks ----------------------------------------------------------

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO_WITH_FUNC)
    def execute_with_func_generator(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(self, *pieces)`` on every rank with its dp piece of each batch argument."""
        return func(self, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def execute_func_rank_zero(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``func(*args, **kwargs)`` on rank 0 only and return its result."""
        return func(*args, **kwargs)


def create_colocated_worker_raw_cls(class_dict: Mapping[str, Any]) -> type:
    """verl's fused worker base class: every role built in one process, reachable as ``self.<role>``.

    ``class_dict`` maps role names to :class:`RayClassWithInitArgs` (or plain classes).
    Subclass the result to write a hybrid worker whose methods call ``self.actor.add(...)``;
    start it with ``RayWorkerGroup`` and call ``wg.fuse(class_dict)`` to reach each role as
    ``wg.actor.add(...)``.
    """
    raw, args, kwargs = {}, {}, {}
    for role, item in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise DispatchAssertionError(f"role names must be identifiers, got {role!r}")
        spec = item if isinstance(item, RayClassWithInitArgs) else RayClassWithInitArgs(item)
        raw[role], args[role], kwargs[role] = unwrap_actor_class(spec.cls), tuple(spec.args), dict(spec.kwargs)

    def __init__(self: Worker, *a: Any, **kw: Any) -> None:
        Worker.__init__(self)
        fused: dict[str, Any] = {}
        for role, cls in raw.items():  # built in this rank's context: each role sees rank and mesh
            fused[role] = cls(*args[role], **kwargs[role])
            setattr(self, role, fused[role])
        setattr(self, FUSED_ROLES_ATTR, fused)
        for obj in fused.values():  # roles can reach each other, as in verl
            setattr(obj, FUSED_ROLES_ATTR, fused)

    name = "FusedWorker_" + "_".join(raw)
    attrs = {"__init__": __init__, "__module__": __name__, "raw_cls_dict": dict(raw), "is_fused_worker": True, ROLES_ATTR: dict(raw)}
    return type(name, (Worker,), attrs)


def create_colocated_worker_cls_fused(class_dict: Mapping[str, Any]) -> RayClassWithInitArgs:
    """verl's fused-worker class: :func:`create_colocated_worker_raw_cls`'s class, ready for ``RayWorkerGroup``.

    The group it starts is marked ``fused_worker_used``; ``wg.spawn(roles)`` and ``wg.fuse(roles)``
    reach each role as in verl.
    """
    spec = RayClassWithInitArgs(create_colocated_worker_raw_cls(class_dict))
    spec.fused_worker_used = True  # type: ignore[attr-defined] - verl's marker, read by RayWorkerGroup
    return spec


def get_device_name() -> str:
    """verl's ``verl.utils.device.get_device_name``: ``"cuda"`` where torch sees a GPU, else ``"cpu"``.

    Pass it as ``device_name=`` as verl code does: a ``use_gpu=True`` pool reserves Ray's GPU
    resource either way; the name says where the workers' tensors live.
    """
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


#: The ``device_name`` values verl code passes that rankmesh honours (verl also knows ``"npu"``).
DEVICE_NAMES = ("cuda", "cpu")


def check_device_name(device: Any) -> None:
    """verl's ``device_name``, as its groups and pools take it: ``"cuda"`` or ``"cpu"``, else refused.

    In verl the name says where the workers' tensors live; the bundles' accelerator resource is
    the platform's, so a ``use_gpu=True`` pool reserves Ray's GPU resource whatever the name
    (verl only warns), and verl's GPU-placed code passes ``get_device_name()``, ``"cpu"`` on a
    machine without CUDA.  Other devices (verl's NPUs) are refused with a
    :class:`~rankmesh.errors.BackendError`: rankmesh runs on CUDA GPUs and CPUs.
    """
    if device not in DEVICE_NAMES:
        raise BackendError(
            f"device_name={device!r} is not supported: pools reserve Ray's GPU resource (device_name='cuda'), "
            "or the workers keep their tensors on the CPU (device_name='cpu')"
        )


#: verl's default ``ray_wait_register_center_timeout`` (seconds).
VERL_REGISTER_TIMEOUT = 300


def verl_group_options(
    resource_pool: Any,
    worker_names: Sequence[str] | None,
    worker_handles: Any,
    register_timeout: float,
    kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """rankmesh's ``RayWorkerGroup`` keywords for verl 0.9.1's constructor arguments.

    Each verl argument is honoured with verl's meaning where rankmesh can, else refused with a
    :class:`~rankmesh.errors.BackendError` (a value rankmesh cannot honour) or ``TypeError``
    (two arguments that say different things), naming the argument and what to use instead:

    * ``ray_wait_register_center_timeout``: how long verl waits for the workers to come up;
      rankmesh's ``start_timeout`` (one of the two, or both equal);
    * ``use_gpu`` (verl: the pool's by default; ``True`` on a CPU pool is an error): must match
      the pool's, since each process gets its bundle's resources;
    * ``device_name``: ``"cuda"`` or ``"cpu"``, where the workers' tensors live (verl's meaning:
      a ``use_gpu=True`` pool reserves Ray's GPU resource whatever the name, so on a CPU machine
      whose Ray declares GPUs verl's GPU-placed code runs with ``"cpu"``); other devices are refused;
    * ``profile_steps``, ``worker_nsight_options`` (nsight profiling), ``master_port_range``,
      ``master_addr``/``master_port``: refused unless unset, the error naming rankmesh's way;
    * ``worker_names``/``worker_handles`` (verl attaches to running workers with them):
      :class:`~rankmesh.errors.DispatchAssertionError`, use :meth:`RayWorkerGroup.from_detached`.
    """
    out = dict(kwargs)
    if worker_names is not None or worker_handles is not None:
        given = "worker_names" if worker_names is not None else "worker_handles"
        raise DispatchAssertionError(  # verl asserts too (its constructor attaches only without a pool)
            f"{given} attaches to running workers, which this constructor does not do: "
            "use RayWorkerGroup.from_detached(name_prefix) for a detached group, or wg.spawn(roles) for role groups"
        )
    if isinstance(register_timeout, bool) or not isinstance(register_timeout, (int, float)) or register_timeout <= 0:
        raise BackendError(f"ray_wait_register_center_timeout must be a positive number of seconds, got {register_timeout!r}")
    if register_timeout != VERL_REGISTER_TIMEOUT:
        if "start_timeout" in out and out["start_timeout"] != register_timeout:
            raise TypeError(
                f"ray_wait_register_center_timeout={register_timeout!r} and start_timeout={out['start_timeout']!r} "
                "both set how long the workers may take to start: give one"
            )
        out["start_timeout"] = float(register_timeout)
    pool_gpu = resource_pool.use_gpu if isinstance(resource_pool, CoreRayResourcePool) else None
    use_gpu = out.pop("use_gpu", pool_gpu)
    if pool_gpu is not None and bool(use_gpu) != pool_gpu:
        if use_gpu:
            raise BackendError("use_gpu is True but resource_pool.use_gpu is False: use RayResourcePool(..., use_gpu=True)")
        raise BackendError(
            "use_gpu=False on a use_gpu=True pool is not supported: each rank gets its bundle's GPU; "
            "for CPU workers use RayResourcePool(..., use_gpu=False)"
        )
    check_device_name(out.pop("device_name", "cuda"))
    profile_steps, nsight = out.pop("profile_steps", None), out.pop("worker_nsight_options", None)
    if profile_steps or nsight is not None:
        given = f"profile_steps={profile_steps!r}" if profile_steps else "worker_nsight_options"
        raise BackendError(
            f"{given}: nsight profiling of the workers is not supported; record the group's calls with "
            "`with wg.trace('trace.json'):` (a Chrome trace of every rank's phases; see the README)"
        )
    for name in ("master_port_range", "master_addr", "master_port"):
        if out.pop(name, None) is not None:
            raise BackendError(
                f"{name} is not supported: rankmesh reserves a free MASTER_PORT on rank 0's node and gives every "
                "rank MASTER_ADDR and MASTER_PORT; read them as wg.master_address and wg.master_port"
            )
    return out


class RayWorkerGroup(CoreRayWorkerGroup):
    """rankmesh's RayWorkerGroup with verl 0.9.1's extra names (``master_address``, ``spawn_fused`` ...).

    Its ranks are Ray actors (``process_model="ray"``) unless ``process_model`` is passed: verl's
    workers call Ray from inside a rank."""

    fused_worker_execute_fn_name = "_fuw_execute"
    fused_worker_used = False  # class defaults: role groups from spawn() skip __init__
    sub_cls_name = ""
    ray_cls_with_init: Any = None

    def __init__(
        self,
        resource_pool: Any = None,
        ray_cls_with_init: Any = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: Sequence[str] | None = None,
        worker_handles: Any = None,
        ray_wait_register_center_timeout: float = VERL_REGISTER_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        """verl's argument order; rankmesh's ``mesh``, ``meshes``, ``worker_env``, ``call_timeout_s``
        ... as keywords.  Every verl argument is honoured with verl's meaning or refused
        (:func:`verl_group_options`); none is dropped."""
        self.fused_worker_used = bool(getattr(ray_cls_with_init, "fused_worker_used", False))
        self.sub_cls_name = ""
        kwargs = verl_group_options(resource_pool, worker_names, worker_handles, ray_wait_register_center_timeout, kwargs)
        # verl's workers may call Ray from inside a rank (ray.get, ray.put, its runtime context),
        # which a forked rank cannot: a Ray actor per rank unless the caller names a process model
        # (RANKMESH_PROCESS_MODEL does not reach verl's groups).
        kwargs.setdefault("process_model", "ray")
        super().__init__(resource_pool, ray_cls_with_init, name_prefix=name_prefix, detached=detached, bin_pack=bin_pack, **kwargs)
        self.ray_cls_with_init = ray_cls_with_init

    @property
    def master_address(self) -> str | None:
        """The rendezvous address every rank got as ``MASTER_ADDR``."""
        master = self._hosts.master
        return None if master is None else master[0]

    @property
    def master_port(self) -> str | None:
        """The rendezvous port every rank got as ``MASTER_PORT`` (a string, as in verl)."""
        master = self._hosts.master
        return None if master is None else str(master[1])

    def spawn_fused(self, prefix_set: Sequence[str]) -> dict[str, CoreRayWorkerGroup]:
        """Role name -> a group over the same processes calling that role (verl's name for :meth:`spawn`)."""
        groups = self.spawn(prefix_set)
        for role, group in groups.items():
            group.sub_cls_name = role  # type: ignore[attr-defined]
        return groups

    def fuse(self, prefix_set: Sequence[str]) -> None:  # type: ignore[override]
        """Set each role's group as an attribute (``wg.actor``), as verl does; returns None like verl."""
        super().fuse(list(prefix_set))

    # --- verl's futures: ObjectRefs ---------------------------------------------------------------

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:  # type: ignore[override]
        """verl's alias of :meth:`execute_all_async`: one ObjectRef per rank (``execute_all_sync`` waits)."""
        return self.execute_all_async(method_name, *args, **kwargs)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """verl's alias of :meth:`execute_rank_zero_async`: rank 0's ObjectRef (``execute_rank_zero_sync`` waits)."""
        return self.execute_rank_zero_async(method_name, *args, **kwargs)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:  # type: ignore[override]
        """Run ``method_name`` on every rank without waiting; verl's result: one ObjectRef per rank, for ``ray.get``.

        Arguments that are all world-size lists go rank by rank, as in verl.  The call takes the
        group's one path (order, tracing, liveness); rankmesh's own group returns a
        :class:`~rankmesh.GroupFuture` instead, whose ``get()`` has a deadline and a hang report.
        """
        return output_refs(super().execute_all_async(method_name, *args, **kwargs).handles)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run ``method_name`` on rank 0 without waiting; verl's result: its ObjectRef, for ``ray.get``."""
        return output_refs(super().execute_rank_zero_async(method_name, *args, **kwargs).handles)[0]


#: verl's default ``max_colocate_count``: worker groups that may share one bundle.
VERL_MAX_COLOCATE_COUNT = 10


class RayResourcePool(CoreRayResourcePool):
    """rankmesh's RayResourcePool in verl's argument order, with verl's per-process lists."""

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool = True,
        name_prefix: str | None = None,
        max_colocate_count: int = VERL_MAX_COLOCATE_COUNT,
        detached: bool = False,
        accelerator_type: str | None = None,
        **kwargs: Any,
    ) -> None:
        """verl's positional order and defaults; rankmesh's ``ready_timeout`` as a keyword.

        ``max_colocate_count`` defaults to verl's 10: up to 10 separate worker groups share each
        bundle, verl's hybrid-engine pattern (actor, critic and reference as separate groups on
        one pool, each actor taking 1 CPU and 1/10 of its bundle's GPU).  As in verl, each bundle
        then reserves 10 logical CPUs: size a Ray you start yourself for that
        (``ray.init(num_cpus=...)``), or pass ``max_colocate_count=1`` for one group per bundle
        (rankmesh's own default).  A group more than the bundles hold is refused at once, naming
        this argument."""
        super().__init__(
            list(process_on_nodes or []),
            use_gpu=use_gpu,
            max_colocate_count=max_colocate_count,
            name_prefix=name_prefix,
            detached=detached,
            accelerator_type=accelerator_type,
            **kwargs,
        )

    def local_world_size_list(self) -> list[int]:
        """For every process, in rank order, how many processes share its node."""
        return [count for count in self.process_on_nodes for _ in range(count)]

    def local_rank_list(self) -> list[int]:
        """For every process, in rank order, its index among the processes of its node."""
        return [i for count in self.process_on_nodes for i in range(count)]

    def get_placement_groups(self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str = "cuda") -> list[Any]:
        """The pool's placement groups in rank order, placed on first use (verl's signature).

        Each argument keeps verl's meaning or is refused before anything is placed:
        ``device_name`` as in :func:`check_device_name`; ``strategy`` must be ``"STRICT_PACK"``
        (verl's default: each node entry's bundles on one node, which rank order and local ranks
        rely on); ``name`` (verl's placement-group name prefix) must be left unset: the groups are
        named after the pool's ``name_prefix``.
        """
        check_device_name(device_name)
        if strategy != "STRICT_PACK":
            raise BackendError(
                f"strategy={strategy!r} is not supported: a RayResourcePool places each process_on_nodes entry on "
                "ONE node (STRICT_PACK), which its rank order and local ranks rely on. Leave strategy='STRICT_PACK'; "
                "to spread processes over nodes, give one entry per node, e.g. RayResourcePool([4, 4]) instead of "
                "RayResourcePool([8])."
            )
        if name is not None:
            raise BackendError(
                f"name={name!r} is not supported: a pool names its placement groups after its name_prefix "
                f"('{self.name_prefix}_pg0', ...); build the pool as RayResourcePool(..., name_prefix={name!r})"
            )
        return super().get_placement_groups()


__all__ = [
    "DEVICE_NAMES",
    "ENV_KEYS",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "check_device_name",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "get_device_name",
]
