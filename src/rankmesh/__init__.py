"""rankmesh: one controller driving groups of Megatron-parallel workers on Ray.

The front door holds what a user of rankmesh writes every day: the mesh, the batch, the
``@register`` decorator and its modes, the worker and group classes, layouts, and the errors worth
catching.  Everything else is reachable from its own module (``rankmesh.mesh.RankGrid``,
``rankmesh.dispatch.DispatchPlan`` ...), and verl's names for porting worker code live in
:mod:`rankmesh.compat.verl`.  ``docs/architecture.md`` maps the modules.

``import rankmesh`` is instant: every front-door name (:data:`NAMES`) loads with its module on
first use, so a process that only needs a corner of rankmesh (the ``rankmesh layout`` command)
never pays for torch, and megatron-core loads only under ``rankmesh.megatron``.
The Ray backend's names (:data:`RAY_NAMES`) load Ray: they show in ``dir(rankmesh)`` but not in
``__all__``, so ``from rankmesh import *`` does not import Ray; import them by name.
"""

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from rankmesh import lazy

if TYPE_CHECKING:  # the names as type checkers and editors see them; at run time NAMES loads them
    from rankmesh.backends.local import LocalWorkerGroup
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls
    from rankmesh.data import DataProto, DataProtoFuture
    from rankmesh.data.buffer import RowBuffer
    from rankmesh.dispatch import Dispatch, Execute, MeshSpec, register, register_dispatch_mode
    from rankmesh.errors import (
        DispatchError,
        FetchTimeoutError,
        HangError,
        LayoutError,
        MeshError,
        PaddingError,
        RankMeshError,
        ResourcePoolError,
        WorkerDiedError,
        WorkerError,
    )
    from rankmesh.futures import wait
    from rankmesh.group import WorkerGroup
    from rankmesh.layout import Layout, load_layout
    from rankmesh.mesh import DistGlobalInfo, DistRankInfo, RankMesh
    from rankmesh.placement import Placement
    from rankmesh.tracing import trace
    from rankmesh.worker import Worker

__version__ = "0.1.0"

NAMES: Mapping[str, str] = MappingProxyType({
    # the mesh and where its ranks run
    "DistGlobalInfo": "rankmesh.mesh",
    "DistRankInfo": "rankmesh.mesh",
    "Placement": "rankmesh.placement",
    "RankMesh": "rankmesh.mesh",
    # batches
    "DataProto": "rankmesh.data",
    "DataProtoFuture": "rankmesh.data",
    "RowBuffer": "rankmesh.data.buffer",
    # declaring worker methods
    "Dispatch": "rankmesh.dispatch",
    "Execute": "rankmesh.dispatch",
    "MeshSpec": "rankmesh.dispatch",
    "register": "rankmesh.dispatch",
    "register_dispatch_mode": "rankmesh.dispatch",
    # workers and groups (the Ray group: see RAY_NAMES)
    "LocalWorkerGroup": "rankmesh.backends.local",
    "Worker": "rankmesh.worker",
    "WorkerGroup": "rankmesh.group",
    # asynchronous pipelines: futures as they finish (replica views: WorkerGroup.replicas)
    "wait": "rankmesh.futures",
    # seeing every call (rankmesh.tracing)
    "trace": "rankmesh.tracing",
    # layouts
    "Layout": "rankmesh.layout",
    "load_layout": "rankmesh.layout",
    # errors worth catching: every one the README names (all of them: rankmesh.errors)
    "DispatchError": "rankmesh.errors",
    "FetchTimeoutError": "rankmesh.errors",
    "HangError": "rankmesh.errors",
    "LayoutError": "rankmesh.errors",
    "MeshError": "rankmesh.errors",
    "PaddingError": "rankmesh.errors",
    "RankMeshError": "rankmesh.errors",
    "ResourcePoolError": "rankmesh.errors",
    "WorkerDiedError": "rankmesh.errors",
    "WorkerError": "rankmesh.errors",
})
"""The front door: each name -> the module it is loaded from on first use."""

RAY_NAMES: Mapping[str, str] = MappingProxyType({
    "RayResourcePool": "rankmesh.backends.ray",
    "RayClassWithInitArgs": "rankmesh.backends.ray",
    "RayWorkerGroup": "rankmesh.backends.ray",
    "create_colocated_worker_cls": "rankmesh.backends.ray",
})
"""The Ray backend's front-door names, loaded (with Ray) on first attribute access."""

__getattr__, __dir__ = lazy.lazy_exports(__name__, {**NAMES, **RAY_NAMES}, globals())

__all__ = list(NAMES)
