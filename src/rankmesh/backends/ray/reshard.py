"""Reshard's transport on Ray: the process's objects are Ray's object store (``ray.put`` / ``ray.get`` / ``ray.wait``).

Why through the object store and not through the controller: the naive refit gathers every full
tensor on the controller and sends each destination its slice, so every byte crosses the driver
twice and the driver's memory must hold the model.  Here each source rank ``ray.put``s each of its
outgoing regions once (:class:`rankmesh.reshard.worker.ReshardWorker`), the controller moves only
the plan and object references (:mod:`rankmesh.reshard.run`), and each destination waits for the
send calls it reads from and, as each source finishes, ``ray.get``s that source's objects while
the other sources are still putting.  Objects are owned by the source rank and freed when the
last reference goes.  Pairs of ranks on one node skip the store: the destination reads the
regions straight from the source process (:mod:`rankmesh.peermem`); the controller picks those
pairs from the groups' ``node_info``.

What this relies on from Ray: a task's output reference may travel, unresolved, inside another
object (the controller ships the send calls' pending handles to the receives as one stored
list), and an actor may wait on references of other actors' tasks.

One :class:`RayObjects` lives in every worker process (:class:`.host.WorkerHost` makes it), so the
colocated roles of a process share its ``outbox``.  A forked rank has no Ray worker: it reaches
the store through its holder (:class:`.warm.HolderObjects`), for reshard and for the parts of a
future passed to it (:func:`use_holder_objects`).
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

from .runtime import worker_raylet_pid


def _ref(handle: Any) -> Any:
    """The ObjectRef of a put object (itself) or of a pending group call (``.calls.Pending.handle``)."""
    return handle if isinstance(handle, ray.ObjectRef) else handle.handle


#: How this process reaches Ray's objects when it has no Ray worker of its own: a forked rank asks
#: its holder (:class:`.warm.HolderObjects`, set once by :func:`use_holder_objects`).  Empty in a
#: Ray process.
_HOLDER_OBJECTS: list[Any] = []


def use_holder_objects(objects: Any) -> None:
    """Wait for and fetch Ray's objects through ``objects`` (a forked rank's holder) from now on.

    Why process-wide: a future passed to a forked rank is rebuilt by the unpickler with its fetch
    function's pickled arguments alone (``GroupFetcher``), so nothing can hand it the rank's
    transport; its parts' references arrive as the holder's tokens, which only the holder reads."""
    _HOLDER_OBJECTS[:] = [objects]


def holder_objects() -> Any:
    """The transport :func:`use_holder_objects` set (a forked rank's), else ``None`` (a Ray process)."""
    return _HOLDER_OBJECTS[0] if _HOLDER_OBJECTS else None


class RayObjects:
    """:class:`~rankmesh.backend.ObjectTransport` over Ray's object store, for one worker process."""

    def __init__(self) -> None:
        #: What a colocated role of this process left for another role of it, by key (reshard: (token, rank)).
        self.outbox: dict[Any, Any] = {}
        self._raylet: int | None = None

    def peer_tracer(self) -> int | None:
        """The node's raylet: every Ray worker process of the node descends from it, so declaring it
        (:func:`rankmesh.peermem.allow_peer_reads`) admits exactly them as readers."""
        if self._raylet is None:
            self._raylet = worker_raylet_pid()
        return self._raylet

    def put(self, value: Any) -> ray.ObjectRef:
        return ray.put(value)

    def get(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        try:
            return ray.get([_ref(h) for h in handles], timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise TimeoutError(f"{len(handles)} objects not all in within {timeout:g} s") from exc

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[int]:
        refs = [_ref(h) for h in handles]
        first, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if not first:
            return []
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0] or first)
        return [i for i, ref in enumerate(refs) if ref in ready]
