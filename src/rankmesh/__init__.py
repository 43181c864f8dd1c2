"""rankmesh: one controller driving groups of Megatron-parallel workers on Ray.

``import rankmesh`` stays light: it never imports megatron-core (only ``rankmesh.megatron`` does).
"""

from rankmesh.errors import (
    DataProtoError,
    DispatchError,
    LayoutError,
    MeshError,
    PaddingError,
    PlacementError,
    RankMeshError,
)
from rankmesh.mesh import DistGlobalInfo, DistRankInfo, RankGrid, RankMesh
from rankmesh.layout import Layout, list_layouts, load_layout, validate_layout
from rankmesh.placement import Placement

__version__ = "0.1.0"

__all__ = [
    "DataProtoError",
    "DispatchError",
    "DistGlobalInfo",
    "DistRankInfo",
    "Layout",
    "LayoutError",
    "MeshError",
    "PaddingError",
    "Placement",
    "PlacementError",
    "RankGrid",
    "RankMesh",
    "RankMeshError",
    "list_layouts",
    "load_layout",
    "validate_layout",
]
