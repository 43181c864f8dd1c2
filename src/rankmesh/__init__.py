"""rankmesh: one controller driving groups of Megatron-parallel workers on Ray.

The front door holds what a user of rankmesh writes every day: the mesh, the batch, the
``@register`` decorator and its modes, the worker and group classes, layouts, and the errors worth
catching.  Everything else is reachable from its own module (``rankmesh.mesh.RankGrid``,
``rankmesh.dispatch.DispatchPlan`` ...), and verl's names for porting worker code live in
:mod:`rankmesh.compat.verl`.  ``docs/architecture.md`` maps the modules.

``import rankmesh`` stays light: it never imports megatron-core (only ``rankmesh.megatron``
does), and the Ray backend's names (:data:`RAY_NAMES`) are loaded on first use, so Ray is imported
only when one of them is touched.  They show in ``dir(rankmesh)`` but not in ``__all__``, so
``from rankmesh import *`` does not import Ray either; import them by name.
"""

from types import MappingProxyType
from typing import Mapping

from rankmesh import lazy
from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.data import DataProto, DataProtoFuture
from rankmesh.data.buffer import RowBuffer
from rankmesh.dispatch import Dispatch, Execute, MeshSpec, register, register_dispatch_mode
from rankmesh.errors import (
    DispatchError,
    FetchTimeoutError,
    LayoutError,
    MeshError,
    RankMeshError,
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

RAY_NAMES: Mapping[str, str] = MappingProxyType({
    "RayResourcePool": "rankmesh.backends.ray",
    "RayClassWithInitArgs": "rankmesh.backends.ray",
    "RayWorkerGroup": "rankmesh.backends.ray",
    "create_colocated_worker_cls": "rankmesh.backends.ray",
})
"""The Ray backend's front-door names, each loaded (with Ray) on first attribute access."""

__getattr__, __dir__ = lazy.lazy_exports(__name__, RAY_NAMES, globals())

__all__ = [
    # the mesh and where its ranks run
    "DistGlobalInfo",
    "DistRankInfo",
    "Placement",
    "RankMesh",
    # batches
    "DataProto",
    "DataProtoFuture",
    "RowBuffer",
    # declaring worker methods
    "Dispatch",
    "Execute",
    "MeshSpec",
    "register",
    "register_dispatch_mode",
    # workers and groups (the Ray group: see RAY_NAMES)
    "LocalWorkerGroup",
    "Worker",
    "WorkerGroup",
    # asynchronous pipelines: futures as they finish (replica views: WorkerGroup.replicas)
    "wait",
    # seeing every call (rankmesh.tracing)
    "trace",
    # layouts
    "Layout",
    "load_layout",
    # errors worth catching (all of them: rankmesh.errors)
    "DispatchError",
    "FetchTimeoutError",
    "LayoutError",
    "MeshError",
    "RankMeshError",
    "WorkerDiedError",
    "WorkerError",
]
