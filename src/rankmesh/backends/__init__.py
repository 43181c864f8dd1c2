"""Backends: where the ranks of a worker group live.

* :mod:`rankmesh.backends.local`: every rank in the controller's own process (debugging, tests).
* :mod:`rankmesh.backends.ray`: one Ray actor per rank (imported on demand: it needs Ray).

Both implement :class:`rankmesh.backend.Backend` and reuse :class:`rankmesh.group.WorkerGroup`
for method binding and dispatch, so a call behaves the same on either.  The local backend's
names load on first use: importing a Ray backend module does not build the local one (and torch).
"""

from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from rankmesh.lazy import lazy_exports

if TYPE_CHECKING:
    from rankmesh.backends.local import LocalExecutor, LocalWorkerGroup

_EXPORTS: Mapping[str, str] = MappingProxyType({
    "LocalExecutor": "rankmesh.backends.local",
    "LocalWorkerGroup": "rankmesh.backends.local",
})

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = list(_EXPORTS)
