"""Backends: where the ranks of a worker group live.

* :mod:`rankmesh.backends.local`: every rank in the controller's own process (debugging, tests).
* :mod:`rankmesh.backends.ray`: one Ray actor per rank (imported on demand: it needs Ray).

Both implement :class:`rankmesh.backend.Backend` and reuse :class:`rankmesh.group.WorkerGroup`
for method binding and dispatch, so a call behaves the same on either.
"""

from rankmesh.backends.local import LocalExecutor, LocalWorkerGroup

__all__ = ["LocalExecutor", "LocalWorkerGroup"]
