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


class ResourcePoolError(RankMeshError, RuntimeError):
    """A resource pool cannot be placed on the cluster (the message lists requested vs available)."""


class BackendError(RankMeshError, RuntimeError):
    """A backend cannot do what was asked: group shut down, worker not found, bad backend options."""


class WorkerError(RankMeshError):
    """A worker method raised.  Names the rank, its mesh coordinates and the method.

    The worker's own exception is the ``__cause__`` (and its text is part of the message, so it
    survives pickling across processes).
    """

    def __init__(self, rank: int, coords: dict[str, int], method: str, message: str = "") -> None:
        self.rank = rank
        self.coords = dict(coords)
        self.method = method
        where = ", ".join(f"{axis}={value}" for axis, value in self.coords.items())
        super().__init__(f"rank {rank} ({where}) failed in {method}" + (f": {message}" if message else ""))
        self.detail = message

    def __reduce__(self):
        return (type(self), (self.rank, self.coords, self.method, self.detail))


class MeshMismatchError(RankMeshError, RuntimeError):
    """The process groups the workers built differ from the controller's RankMesh.

    ``mismatches`` lists every disagreement (rank, what differs, expected, actual).
    """

    def __init__(self, message: str, mismatches: list | None = None) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches or [])

    def __reduce__(self):
        return (type(self), (str(self), self.mismatches))


class WorkerDiedError(BackendError):
    """A worker process died (or could not be reached) during a call; names rank and method."""

    def __init__(self, rank: int, method: str, detail: str = "", node: str | None = None) -> None:
        self.rank, self.method, self.detail, self.node = rank, method, detail, node
        where = f" on node {node}" if node else ""
        super().__init__(f"rank {rank}{where} died during {method}" + (f": {detail}" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.rank, self.method, self.detail, self.node))


class FetchTimeoutError(BackendError, TimeoutError):
    """``fetch`` ran past its timeout; names the ranks still running."""

    def __init__(self, method: str, ranks: list[int], timeout: float) -> None:
        self.method, self.ranks, self.timeout = method, list(ranks), timeout
        super().__init__(f"{method}: ranks {self.ranks} did not finish within {timeout:g} s")

    def __reduce__(self):
        return (type(self), (self.method, self.ranks, self.timeout))


class WorkerEnvError(BackendError, ValueError):
    """``worker_env`` tried to set a variable the backend owns (RANK, MASTER_PORT, ...)."""
