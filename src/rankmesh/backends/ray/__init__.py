"""The Ray backend: one Ray actor per rank, placed by resource pools (verl's ``single_controller.ray``).

* :class:`RayResourcePool`, :func:`split_resource_pool`: placement groups, one per node entry.
* :class:`RayClassWithInitArgs`, :class:`RayWorkerGroup`: start a group, call it like one object.
* :func:`create_colocated_worker_cls`: several roles in the same processes (``wg.spawn``).
* :func:`init_torch_distributed`: join torch.distributed from inside a worker.
* :func:`ensure_ray`: join a cluster or start a local one bound to 127.0.0.1.

Names are imported on first use: every worker process imports this package (the host actor
lives in it), and most workers never need the controller-side modules (and their imports).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ColocatedClassWithInitArgs": "colocate",
    "create_colocated_worker_cls": "colocate",
    "RayClassWithInitArgs": "group",
    "RayWorkerGroup": "group",
    "RayResourcePool": "pool",
    "split_resource_pool": "pool",
    "RendezvousError": "rendezvous",
    "init_torch_distributed": "rendezvous",
    "ensure_ray": "runtime",
    "RayExecutor": "transport",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from rankmesh.backends.ray.colocate import ColocatedClassWithInitArgs, create_colocated_worker_cls
    from rankmesh.backends.ray.group import RayClassWithInitArgs, RayWorkerGroup
    from rankmesh.backends.ray.pool import RayResourcePool, split_resource_pool
    from rankmesh.backends.ray.rendezvous import RendezvousError, init_torch_distributed
    from rankmesh.backends.ray.runtime import ensure_ray
    from rankmesh.backends.ray.transport import RayExecutor


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
