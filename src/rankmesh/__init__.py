"""rankmesh: one controller driving groups of Megatron-parallel workers on Ray.

``import rankmesh`` stays light: it never imports megatron-core (only ``rankmesh.megatron`` does).
"""

from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.data import DataProto, DataProtoConfig, DataProtoFuture
from rankmesh.dispatch import (
    Dispatch,
    DispatchPlan,
    DispatchRegistry,
    Execute,
    MeshSpec,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rankmesh.errors import (
    BackendError,
    DataProtoError,
    DispatchError,
    LayoutError,
    MeshError,
    MeshMismatchError,
    PaddingError,
    PlacementError,
    RankMeshError,
    ResourcePoolError,
    WorkerEnvError,
    FetchTimeoutError,
    WorkerDiedError,
    WorkerError,
)
from rankmesh.group import GroupFuture, WorkerGroup
from rankmesh.mesh import DistGlobalInfo, DistRankInfo, RankGrid, RankMesh
from rankmesh.layout import Layout, list_layouts, load_layout, validate_layout
from rankmesh.placement import Placement
from rankmesh.worker import Worker, WorkerContext

__version__ = "0.1.0"

#: Names of the Ray backend, loaded on first use so that ``import rankmesh`` does not import Ray.
_RAY_NAMES = {
    "RayResourcePool": "rankmesh.backends.ray",
    "RayClassWithInitArgs": "rankmesh.backends.ray",
    "RayWorkerGroup": "rankmesh.backends.ray",
    "create_colocated_worker_cls": "rankmesh.backends.ray",
    "split_resource_pool": "rankmesh.backends.ray",
    "init_torch_distributed": "rankmesh.backends.ray",
    "ensure_ray": "rankmesh.backends.ray",
}


def __getattr__(name: str):
    module = _RAY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'rankmesh' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

__all__ = [
    "BackendError",
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "Dispatch",
    "DispatchError",
    "DispatchPlan",
    "DispatchRegistry",
    "DistGlobalInfo",
    "DistRankInfo",
    "Execute",
    "FetchTimeoutError",
    "GroupFuture",
    "Layout",
    "LayoutError",
    "LocalWorkerGroup",
    "MeshError",
    "MeshMismatchError",
    "MeshSpec",
    "PaddingError",
    "Placement",
    "PlacementError",
    "RankGrid",
    "RankMesh",
    "RankMeshError",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "ResourcePoolError",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerEnvError",
    "WorkerError",
    "WorkerGroup",
    "create_colocated_worker_cls",
    "ensure_ray",
    "init_torch_distributed",
    "list_layouts",
    "load_layout",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "split_resource_pool",
    "update_dispatch_mode",
    "validate_layout",
]
