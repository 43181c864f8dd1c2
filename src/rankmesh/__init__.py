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
    WorkerError,
)
from rankmesh.group import GroupFuture, WorkerGroup
from rankmesh.mesh import DistGlobalInfo, DistRankInfo, RankGrid, RankMesh
from rankmesh.layout import Layout, list_layouts, load_layout, validate_layout
from rankmesh.placement import Placement
from rankmesh.worker import Worker, WorkerContext

__version__ = "0.1.0"

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
    "ResourcePoolError",
    "Worker",
    "WorkerContext",
    "WorkerError",
    "WorkerGroup",
    "list_layouts",
    "load_layout",
    "make_nd_compute_dataproto_dispatch_fn",
    "register",
    "register_dispatch_mode",
    "update_dispatch_mode",
    "validate_layout",
]
