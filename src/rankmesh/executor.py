"""The contract between a worker group and a backend (in-process or Ray).

A worker group decides *what* each rank receives and whose output is kept (dispatch, using the
group's mesh); a backend only knows *how* to ship one object to the workers, run a method on some
ranks, and fetch the outputs it is told to fetch.  Keeping the contract this small is what lets the
in-process backend and the Ray backend pass the same dispatch tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class RankCall:
    """One rank's share of a group call.

    ``args``/``kwargs`` may contain :class:`Shared` handles returned by :meth:`Executor.share`;
    the backend resolves them on the worker side.  ``return_output=False`` tells the worker to
    run the method but send nothing back (ranks outside the collect set), so a large output costs
    one transfer per replica instead of one per rank.
    """

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    return_output: bool = True


@dataclass(frozen=True)
class Shared:
    """A handle to one object shipped once and read by any number of ranks.

    ``ref`` is backend-specific (a Ray ObjectRef, or the object itself in-process).  Every rank
    that receives it gets its own private, writable copy of the tensors inside: a worker that
    changes its input in place changes neither the caller's batch nor another rank's.
    """

    ref: Any


@runtime_checkable
class Executor(Protocol):
    """What a backend provides to :class:`rankmesh.group.WorkerGroup`."""

    world_size: int

    def share(self, obj: Any) -> Shared:
        """Ship ``obj`` once (e.g. one ``ray.put``) so that several ranks can receive it."""

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall]) -> list[Any]:
        """Start ``method`` on the ranks named in ``calls``; return one pending handle per call.

        ``role`` selects the worker instance inside a process that hosts several colocated roles
        (``None`` for a group with a single role).
        """

    def fetch(self, pending: Sequence[Any], timeout: float | None = None) -> list[Any]:
        """Wait for the pending handles and return their outputs, in the same order."""

    def fetcher(self) -> Callable[[Sequence[Any]], list[Any]]:
        """A picklable function that turns pending handles into outputs from any process.

        Futures (``DataProtoFuture``) carry it so that a worker of another group can fetch just
        the parts it needs (``ray.get`` for the Ray backend).
        """
