"""Exception types of rankmesh.

Every error rankmesh raises on purpose derives from :class:`RankMeshError`, so callers can catch
the project's failures in one place while still telling them apart.  This module imports nothing
from the package.
"""

from __future__ import annotations


class RankMeshError(Exception):
    """Base class of every error raised by rankmesh on purpose."""


class MeshError(RankMeshError, ValueError):
    """A parallel mesh was described wrongly: bad sizes, a bad order string, a rank out of range."""


class LayoutError(RankMeshError, ValueError):
    """A parallel layout file or its contents are invalid (the message names file, role and field)."""


class PlacementError(RankMeshError, ValueError):
    """Ranks cannot be placed onto the given nodes and devices."""


class DataProtoError(RankMeshError, ValueError):
    """A DataProto operation got inconsistent input (lengths, keys, types)."""


class DispatchError(RankMeshError, ValueError):
    """Arguments of a worker-group call do not fit the method's dispatch mode."""


class PaddingError(DispatchError):
    """A batch does not divide into the requested number of pieces and padding is disabled."""
