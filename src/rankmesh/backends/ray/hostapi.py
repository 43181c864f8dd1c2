"""What the controller sends a rank's process, whatever runs it: the host's remote methods, their threads, and a rank's setup.

Why a module of its own: a rank runs either in its own Ray actor (:class:`.host.WorkerHost`) or
forked from its node's warm process behind a light holder actor (:mod:`.forked`).  The holder
forwards every host method and must not import torch or the user's modules (that would cost what
forking saves), so the names it forwards, the thread each runs on and the setup it passes along
live here, importing nothing heavy.  :mod:`.host` defines the methods; a test checks the two agree.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import ray

from rankmesh.mesh import RankMesh

from .runtime import node_ip_address, worker_raylet_pid

#: The concurrency group of control calls (:meth:`.host.WorkerHost.stacks`): its own thread, so it
#: answers while a call blocks the default one.  Calls keep the default group, one at a time and
#: in order (Ray runs an actor's tasks in order unless told otherwise, whatever its groups).
CONTROL_GROUP = "control"

#: Host methods ``call_0`` ... ``call_{CALL_SLOTS - 1}``: a slot-only header installed on a host
#: as slot ``k`` is run by ``call_k(*shared)``, a task with no header argument at all.
CALL_SLOTS = 128
SLOT_METHODS: tuple[str, ...] = tuple(f"call_{k}" for k in range(CALL_SLOTS))
#: The same slots for calls with no shared value (``bare_<k>()``, no parameters): Ray binds the
#: arguments of a method that declares parameters against its signature on every submit
#: (``inspect.Signature.bind``, ~15 us per rank here) even when none are passed, and skips that
#: only for a method without parameters.
BARE_SLOT_METHODS: tuple[str, ...] = tuple(f"bare_{k}" for k in range(CALL_SLOTS))

#: Every remote method of a rank's host, by name -> its concurrency group (``None``: the default
#: thread, calls one at a time in order).  The slot methods come on top (:data:`SLOT_METHODS`,
#: :data:`BARE_SLOT_METHODS`, default thread).
HOST_METHODS: Mapping[str, str | None] = MappingProxyType({
    "node_info": None, "reserve_master_port": None, "setup": None, "warm": None, "teardown": None,
    "execute": None, "execute_after": None, "execute_for": None, "fence": None, "execute_install": None,
    "execute_traced": None, "execute_kept": None, "clock": None, "leave_distributed": None,
    "rejoin_distributed": None, "restore_from_peer": None, "recovery_state": None,
    "load_recovery_state": None, "exit_on_next_call": None,
    "open_session": CONTROL_GROUP, "close_session": CONTROL_GROUP, "take_parked": CONTROL_GROUP,
    "parked_outputs": CONTROL_GROUP, "stacks": CONTROL_GROUP, "drain_timings": CONTROL_GROUP, "describe": CONTROL_GROUP,
    "sever": CONTROL_GROUP, "ping": CONTROL_GROUP,
})

#: Host methods whose answer Ray splits into several objects (called with ``num_returns``), by
#: name -> how many: a forked rank's holder passes each part on as an object of its own.
ANSWER_PARTS: Mapping[str, int] = MappingProxyType({"execute_for": 2})


class PickledClass:
    """A worker class as it travels: pickled once by the controller, loaded by the rank that builds it.

    It stays bytes through anything in between (a forked rank's holder passes it on without
    importing the user's module, megatron-core's or torch): :func:`role_class` loads it.
    """

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def load(self) -> type:
        return pickle.loads(self.payload)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return PickledClass, (self.payload,)


@dataclass(frozen=True)
class RoleInit:
    """One worker class to build in each process, with its constructor arguments.

    ``cls`` is the class, or a :class:`PickledClass` on its way (read it with :func:`role_class`)."""

    cls: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def role_class(role: RoleInit) -> type:
    """The class ``role`` builds, loaded here if it travelled pickled (imports its module)."""
    return role.cls.load() if isinstance(role.cls, PickledClass) else role.cls


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
    roles: Mapping[str | None, RoleInit]
    env: Mapping[str, str]
    group_name: str
    preload: tuple[str, ...] = ()  # modules imported before the workers are built (MethodTable.preload)


@dataclass(frozen=True)
class HostPlace:
    """Where a rank's process runs, as Ray sees it: what the host would otherwise ask Ray.

    A rank in its own Ray actor reads it from Ray (:meth:`HostPlace.of_ray_worker`); a forked rank
    has no Ray worker of its own and gets the place its node's holder reads for its bundle (:mod:`.forked`).
    """

    node_id: str
    node_ip: str
    placement_group_id: Any
    gpu_ids: tuple[str, ...]
    accelerator_ids: Mapping[str, Any]
    raylet_pid: int | None
    #: The process Ray knows as this rank's worker: its own, or the holder of the group's forked ranks on the node.
    ray_pid: int

    @classmethod
    def of_ray_worker(cls) -> "HostPlace":
        ctx = ray.get_runtime_context()
        try:
            gpu_ids = tuple(str(g) for g in ray.get_gpu_ids())
        except Exception:  # pragma: no cover - no GPU support in this Ray
            gpu_ids = ()
        return cls(
            node_id=ctx.get_node_id(),
            node_ip=node_ip_address(),
            placement_group_id=ctx.get_placement_group_id(),
            gpu_ids=gpu_ids,
            accelerator_ids=dict(ctx.get_accelerator_ids()),
            raylet_pid=worker_raylet_pid(),
            ray_pid=os.getpid(),
        )
