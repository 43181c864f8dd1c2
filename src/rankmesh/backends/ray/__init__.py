"""The Ray backend: one Ray actor per rank, placed by resource pools (verl's ``single_controller.ray``).

* :class:`RayResourcePool`, :func:`split_resource_pool`, :func:`merge_resource_pool`: placement
  groups, one per node entry; views that carve a pool up or join two.
* :class:`RayClassWithInitArgs`, :class:`RayWorkerGroup`: start a group, call it like one object.
* :func:`create_colocated_worker_cls`: several roles in the same processes (``wg.spawn``).
* :func:`init_torch_distributed`: join torch.distributed from inside a worker.
* :func:`ensure_ray`: join a cluster or start a local one bound to 127.0.0.1.

The modules, along the process boundary: :mod:`.host` runs in every worker process (the host
actor of one rank); :mod:`.wire` is the format of one call between the two sides; the
controller has :mod:`.hosts` (starting and stopping a group's processes), :mod:`.waiting`
(waiting for calls, translating failures), :mod:`.executor` (the backend contract),
:mod:`.classes` (what to build in each process), :mod:`.group` (the worker group) and
:mod:`.pool` (placement).

Names are imported on first use: every worker process imports this package (the host actor
lives in it), and most workers never need the controller-side modules (and their imports).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from rankmesh.lazy import lazy_exports

_EXPORTS = MappingProxyType({
    "ColocatedClassWithInitArgs": "rankmesh.backends.ray.classes",
    "create_colocated_worker_cls": "rankmesh.backends.ray.classes",
    "RayClassWithInitArgs": "rankmesh.backends.ray.classes",
    "RayWorkerGroup": "rankmesh.backends.ray.group",
    "PoolPerGroup": "rankmesh.backends.ray.group",
    "RayResourcePool": "rankmesh.backends.ray.pool",
    "split_resource_pool": "rankmesh.backends.ray.pool",
    "merge_resource_pool": "rankmesh.backends.ray.pool",
    "init_torch_distributed": "rankmesh.rendezvous",
    "ensure_ray": "rankmesh.backends.ray.runtime",
    "RayExecutor": "rankmesh.backends.ray.executor",
    "fetch_refs": "rankmesh.backends.ray.waiting",
    # Reshard's names as they were exported here before reshard left the Ray backend (it runs
    # on any backend now: rankmesh.reshard; megatron's parameter conventions: rankmesh.megatron).
    "ReshardWorker": "rankmesh.reshard.worker",
    "reshard": "rankmesh.reshard.run",
    "plan_between": "rankmesh.reshard.run",
    "layouts_from_module": "rankmesh.megatron.layouts",
    "RendezvousError": "rankmesh.errors",
})

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # pragma: no cover
    from rankmesh.backends.ray.classes import (
        ColocatedClassWithInitArgs,
        RayClassWithInitArgs,
        create_colocated_worker_cls,
    )
    from rankmesh.backends.ray.executor import RayExecutor
    from rankmesh.backends.ray.group import PoolPerGroup, RayWorkerGroup
    from rankmesh.backends.ray.pool import RayResourcePool, merge_resource_pool, split_resource_pool
    from rankmesh.rendezvous import init_torch_distributed
    from rankmesh.backends.ray.runtime import ensure_ray
    from rankmesh.backends.ray.waiting import fetch_refs
    from rankmesh.errors import RendezvousError
