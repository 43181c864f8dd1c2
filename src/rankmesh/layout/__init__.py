"""Named parallel layouts: which roles run where, with which megatron mesh, read from YAML.

A layout file describes one deployment (a cluster, its resource pools, and each role's mesh), so
a setup that works can be named, reviewed and checked before anything is launched.  Loading only
checks structure (fields, types) and raises :class:`LayoutError`; :func:`validate_layout` checks
the arithmetic (world sizes, divisibility, fit, colocation, node boundaries) and *returns* every
problem, so ``rankmesh layout validate`` can list them all at once; :func:`check_layout` raises
on the first error.

The model: a :class:`Layout` has a :class:`ClusterSpec` (devices per node), :class:`PoolSpec`
pools, and :class:`LayoutRole` roles, each with the :class:`MeshSizes` written in the file.

The schema is documented in ``parallel_layouts/cpu_demo.yaml`` and ``docs/layouts.md``.
"""

from rankmesh.errors import LayoutError, LayoutFileError, LayoutNotFoundError
from rankmesh.layout.checks import check_layout, validate_layout
from rankmesh.layout.files import find_layout, layout_dirs, list_layouts, load_layout
from rankmesh.layout.parse import parse_layout
from rankmesh.layout.spec import (
    DEFAULT_INTRA_NODE,
    DEFAULT_POOL,
    LAYOUTS_ENV,
    ClusterSpec,
    Layout,
    LabelConflict,
    LayoutRole,
    MeshSizes,
    PoolSpec,
    Problem,
)

__all__ = [
    "DEFAULT_INTRA_NODE",
    "DEFAULT_POOL",
    "LAYOUTS_ENV",
    "ClusterSpec",
    "Layout",
    "LabelConflict",
    "LayoutError",
    "LayoutFileError",
    "LayoutNotFoundError",
    "LayoutRole",
    "MeshSizes",
    "PoolSpec",
    "Problem",
    "check_layout",
    "find_layout",
    "layout_dirs",
    "list_layouts",
    "load_layout",
    "parse_layout",
    "validate_layout",
]
