"""Every exception class of rankmesh, in one module that imports nothing from the package.

Every error rankmesh raises on purpose derives from :class:`RankMeshError`, so callers can catch
the project's failures in one place while still telling them apart.  Keeping every class here
(not beside the code that raises it) lets any layer raise or catch any of them without importing
another layer.
"""

from __future__ import annotations

import errno
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - annotations only: this module imports nothing from the package
    from rankmesh.mesh import RankCoords


def _rank_text(rank: int, coords: "RankCoords | None") -> str:
    """``rank 5 (tp1 dp0 pp1)``: the one way messages name a rank (:meth:`RankCoords.rank_text`)."""
    return f"rank {rank}" if coords is None else coords.rank_text(rank)


class RankMeshError(Exception):
    """Base class of every error raised by rankmesh on purpose."""


class MeshError(RankMeshError, ValueError):
    """A parallel mesh was described wrongly: bad sizes, a bad order string, a rank out of range."""


class LayoutError(RankMeshError, ValueError):
    """A parallel layout file or its contents are invalid (the message names file, role and field)."""


class LayoutNotFoundError(LayoutError):
    """No layout of that name, or no such file: a usage error rather than a broken layout."""


class LayoutFileError(LayoutError):
    """A layout file was found but is not a valid layout: unreadable, malformed YAML, a bad field, a failed check.

    ``rankmesh layout show``, ``draw`` and ``validate`` all exit 1 on it (``LayoutNotFoundError``: 2).
    """


class UsageError(RankMeshError):
    """Bad command-line input (argparse's complaints included): ``rankmesh`` exits with code 2."""


class PlacementError(RankMeshError, ValueError):
    """Ranks cannot be placed onto the given nodes and devices."""


class DataProtoError(RankMeshError, ValueError):
    """A DataProto operation got inconsistent input (lengths, keys, types)."""


class DispatchError(RankMeshError, ValueError):
    """Arguments of a worker-group call do not fit the method's dispatch mode."""


class GroupAttributeError(RankMeshError, AttributeError):
    """A worker group has no attribute of that name: no group attribute and no registered method.

    An ``AttributeError``, so ``hasattr`` and ``getattr(wg, name, default)`` work as on any object.
    The message says whether the worker class defines the name without ``@register`` and lists
    the group's registered methods.
    """


class TraceError(RankMeshError, ValueError):
    """A trace cannot be written where asked (a directory, a path under a file, a folder not writable).

    Raised when ``rankmesh.trace(path)`` or ``wg.trace(path)`` is entered, before the block runs.
    """


class RowBufferError(RankMeshError, RuntimeError):
    """A RowBuffer put or take that cannot be served: full, not enough rows in time, or rows of unknown count."""


class PaddingError(DispatchError):
    """A batch does not divide into the requested number of pieces and padding is disabled."""


class DataProtoAssertionError(DataProtoError, AssertionError):
    """A DataProto check verl makes with ``assert`` (raised only by ``rankmesh.compat.verl``).

    Ported code and tests catch ``AssertionError``; rankmesh's own API raises the plain
    :class:`DataProtoError`.  Being both, this keeps the clear message and verl's type.
    """


class PaddingAssertionError(PaddingError, AssertionError):
    """verl's ``chunk`` assert (uneven split without auto padding), raised by ``rankmesh.compat.verl``."""


class DispatchAssertionError(DispatchError, AssertionError):
    """A dispatch-info check verl makes with ``assert`` (e.g. a mesh name set twice), in compat only."""


class ResourcePoolError(RankMeshError, RuntimeError):
    """A resource pool cannot be placed on the cluster (the message lists requested vs available)."""


class BackendError(RankMeshError, RuntimeError):
    """A backend cannot do what was asked: group shut down, worker not found, bad backend options."""


class RendezvousError(RankMeshError, RuntimeError):
    """The torch.distributed environment of a worker is missing or inconsistent (RANK, MASTER_PORT ...)."""


class RemoteTraceback(Exception):
    """A worker's traceback text, set as the ``__cause__`` of the error re-raised in the controller.

    Not a :class:`RankMeshError`: it is never raised on its own, only chained so that Python prints
    the worker's traceback under the controller's.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class WorkerError(RankMeshError):
    """A worker method raised.  Names the rank, its mesh coordinates, its node and the method.

    ``coords`` is the rank's :class:`~rankmesh.mesh.RankCoords` (``None`` for a worker built
    outside any group); ``remote_traceback`` is the worker's traceback text (also the ``__cause__`` on Ray) and
    ``others`` the failures of further ranks in the same call, lowest rank first (this error is
    the lowest failing rank); ``cause`` the dotted name of the exception's class on the rank
    (e.g. ``ray.exceptions.OwnerDiedError``: the rank's input was lost with the process that held
    it), kept as text for the same reason as the traceback.  Every field survives pickling.
    """

    def __init__(
        self,
        rank: int,
        coords: "RankCoords | None",
        method: str,
        message: str = "",
        node: str | None = None,
        remote_traceback: str | None = None,
        others: list["WorkerError"] | None = None,
        cause: str | None = None,
    ) -> None:
        self.rank = rank
        self.cause = cause
        self.coords = coords
        self.method = method
        self.node = node
        self.remote_traceback = remote_traceback
        self.others: list[WorkerError] = list(others or [])
        self.detail = message
        super().__init__(self._text())

    def _text(self) -> str:
        """``rank 0 (tp0 dp0) on node n0 and 3 other ranks [1, 2, 3] failed in m: detail``: each rank said once."""
        on = f" on node {self.node}" if self.node else ""
        n = len(self.others)
        also = f" and {n} other rank{'s' if n > 1 else ''} {[o.rank for o in self.others]}" if n else ""
        return f"{_rank_text(self.rank, self.coords)}{on}{also} failed in {self.method}" + (f": {self.detail}" if self.detail else "")

    @classmethod
    def from_exception(
        cls, exc: BaseException, rank: int, coords: "RankCoords | None", method: str, node: str | None = None
    ) -> "WorkerError":
        """The one way to wrap an exception raised on a rank: message and traceback text kept.

        The traceback is kept as text because the exception object itself may not unpickle in
        the controller (a class only the worker imports).
        """
        text = "".join(traceback.format_exception(exc))
        cause = f"{type(exc).__module__}.{type(exc).__qualname__}"
        return cls(rank, coords, method, f"{type(exc).__name__}: {exc}", node, text, cause=cause)

    def attach(self, others: list["WorkerError"]) -> "WorkerError":
        """Record further failing ranks of the same call (refreshes the message)."""
        self.others = sorted(others, key=lambda e: e.rank)
        self.args = (self._text(),)
        return self

    def __str__(self) -> str:
        return self._text()

    def raised(self, cls: type[BaseException]) -> bool:
        """Whether the rank raised a ``cls`` (its exact class: what :meth:`from_exception` kept of it)."""
        return self.cause == f"{cls.__module__}.{cls.__qualname__}"

    def __reduce__(self):
        return (type(self), (self.rank, self.coords, self.method, self.detail, self.node, self.remote_traceback, self.others,
                             self.cause))


class MeshMismatchError(RankMeshError, RuntimeError):
    """The process groups the workers built differ from the controller's RankMesh.

    ``mismatches`` lists every disagreement (rank, what differs, expected, actual).
    """

    def __init__(self, message: str, mismatches: list | None = None) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches or [])

    def __reduce__(self):
        return (type(self), (str(self), self.mismatches))


class ForkedRankGone(BackendError):
    """A forked rank's process is gone (``process_model="fork"``): what its node's holder raises for its calls.

    The group reads it as a process death, as it reads Ray's dead-actor error for a rank in its own
    actor, and raises :class:`WorkerDiedError` naming the rank."""


class ForkRefused(BackendError):
    """A node's warm process may not fork ranks for a group's modules: importing them started a
    Python thread or a CUDA context, which a forked rank would lack or could not use.

    The node's keeper raises it, naming the modules and what they started.  A group whose process
    model was its worker classes' default (rankmesh's own) starts Ray actors instead."""


class WorkerDiedError(BackendError):
    """A worker process died (or its node went away) during a call; names ranks, coordinates, method.

    ``rank`` is the lowest dead rank, ``ranks`` all dead ranks seen, ``coords`` each one's
    :class:`~rankmesh.mesh.RankCoords` (by rank, where known).  The group is failed afterwards: its other processes are stopped and later
    calls raise this error again at once.
    """

    def __init__(
        self,
        rank: int,
        method: str,
        detail: str = "",
        node: str | None = None,
        ranks: list[int] | None = None,
        coords: "dict[int, RankCoords] | None" = None,
    ) -> None:
        self.rank, self.method, self.detail, self.node = rank, method, detail, node
        self.ranks = sorted(set(ranks or []) | {rank})
        self.coords = {int(r): c for r, c in (coords or {}).items()}
        where = f" on node {node}" if node else ""
        who = ", ".join(_rank_text(r, self.coords.get(r)) for r in self.ranks)
        super().__init__(f"{who}{where} died during {method}" + (f": {detail}" if detail else ""))

    def __reduce__(self):
        return (type(self), (self.rank, self.method, self.detail, self.node, self.ranks, self.coords))


class ControllerCutOffError(BackendError):
    """The controller's own node lost every other node of the group at once: a partition of its
    link, not the death of each node.

    ``node`` is the controller's node address, ``lost_nodes`` the addresses the cluster's GCS
    declared dead, ``ranks`` the group's ranks there (their processes may well live on).  No
    policy replaces or shrinks around it (no node is left to do it with), so the group fails;
    once the link is back, Ray ends the cut-off nodes' processes, and a new group can start.
    """

    def __init__(self, method: str, node: str | None, lost_nodes: list[str], ranks: list[int]) -> None:
        self.method, self.node, self.lost_nodes, self.ranks = method, node, sorted(lost_nodes), sorted(ranks)
        super().__init__(
            f"{method}: the controller's node {node} lost every other node of the group at once "
            f"({', '.join(self.lost_nodes)}: ranks {self.ranks}), and none of them answers from here: the controller's "
            f"own node is cut off from the rest (its link or its network), far likelier than {len(self.ranks)} ranks "
            f"on {len(self.lost_nodes)} nodes dying at once. "
            "The group cannot go on and no policy replaces them; once the link is back Ray ends the cut-off "
            "nodes' processes: fix the network of this node, then start a new group")

    def __reduce__(self):
        return (type(self), (self.method, self.node, self.lost_nodes, self.ranks))


class FetchTimeoutError(BackendError, TimeoutError):
    """``fetch`` ran past its timeout; names the ranks still running."""

    def __init__(self, method: str, ranks: list[int], timeout: float) -> None:
        self.method, self.ranks, self.timeout = method, list(ranks), timeout
        super().__init__(f"{method}: ranks {self.ranks} did not finish within {timeout:g} s")

    def __reduce__(self):
        return (type(self), (self.method, self.ranks, self.timeout))


class HangError(FetchTimeoutError):
    """A call ran past its timeout, and each unfinished rank said where it is stuck.

    Still a :class:`FetchTimeoutError` (``method``, ``ranks``, ``timeout`` as before).
    ``report`` is the :class:`rankmesh.hangs.HangReport`: ``report.hangs`` one record per
    unfinished rank (rank, coordinates, node, state, every thread's stack, the collective it
    waits in), ``report.finished`` the ranks that finished; the message is its text, ranks stuck
    at the same place on one line.  ``note`` (when given) comes right after the first line: what
    the ranks do now and how to get them back, or why the call was never sent.
    """

    def __init__(self, method: str, ranks: list[int], timeout: float, report: object, note: str = "") -> None:
        super().__init__(method, ranks, timeout)
        self.report = report
        self.note = note
        head = self.args[0] if not note else f"{self.args[0]}. {note}"
        text = getattr(report, "text", None)
        self.args = (f"{head}\n{text()}",) if callable(text) else (head,)

    @property
    def hangs(self) -> list:
        """The report's records, one per unfinished rank (``rankmesh.hangs.RankHang``)."""
        return list(getattr(self.report, "hangs", ()))

    @property
    def finished(self) -> list[int]:
        """The ranks that finished the call."""
        return list(getattr(self.report, "finished", ()))

    def __reduce__(self):
        return (type(self), (self.method, self.ranks, self.timeout, self.report, self.note))


class StaleViewError(DispatchError):
    """A replica view (or a call made through it) predates a change of its group's mesh.

    A shrink or a grow renumbers the group's ranks, so a view taken before it would reach other
    replicas' processes; the message says what changed and how to take a fresh view.
    """


class AgentLostError(BackendError):
    """A node agent died during a call while the ranks it served are alive.

    ``ranks`` are the ranks it served; what the call did there is unknown.  The group stays
    usable: the next call starts new agents.
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks or [])

    def __reduce__(self):
        return (type(self), (str(self), self.ranks))


class WorkerEnvError(BackendError, ValueError):
    """``worker_env`` tried to set a variable the backend owns (RANK, MASTER_PORT, ...)."""


class ReshardError(MeshError):
    """A reshard cannot be planned or run: a parameter does not fit a mesh, or the two sides disagree."""


class CheckpointError(RankMeshError, RuntimeError):
    """A checkpoint cannot be saved or loaded: no such path, a directory in use, or a model that does not fit it.

    The message names the checkpoint directory and, for a mismatch, the tensor and both shapes.
    """


class PeerReadError(RankMeshError, OSError):
    """Reading another process's memory (``process_vm_readv``) failed; ``errno`` says why.

    ``refused`` is true when the kernel refused the access (another user, Yama, seccomp, another
    pid namespace) rather than an address being wrong: a copy through a store still works then.
    """

    @property
    def refused(self) -> bool:
        return self.errno in (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ESRCH)


class RingError(RankMeshError, RuntimeError):
    """A shared-memory command ring (:mod:`rankmesh.ring`) cannot be used: bad sizes, aborted, wrong party."""


class RingTimeout(RingError, TimeoutError):
    """A ring party waited past its deadline (for a message, or for a free slot)."""


class RingPeerDied(RingError):
    """A ring party's peer process exited while it waited; ``pid`` names the peer."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid

    def __reduce__(self):
        return (type(self), (str(self), self.pid))


class RecoveryError(BackendError):
    """Dead ranks could not be replaced (a survivor stayed blocked, a new process failed to start).

    ``ranks`` names the ranks at fault.  The group is failed afterwards, as after an unrecovered
    death: its processes are stopped and later calls raise at once.
    """

    def __init__(self, message: str, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks or [])

    def __reduce__(self):
        return (type(self), (str(self), self.ranks))


class ShardLostError(RecoveryError):
    """A dead rank's shard has no live copy (dp = 1, or its whole dp group died): restore from a checkpoint.

    ``shards`` maps each such rank to its :class:`~rankmesh.mesh.RankCoords`: the shard no live
    rank holds is the one at those coordinates, whatever the dp coordinate.
    """

    def __init__(self, message: str, ranks: list[int] | None = None, shards: "dict[int, RankCoords] | None" = None) -> None:
        super().__init__(message, ranks)
        self.shards = {int(r): c for r, c in (shards or {}).items()}

    def __reduce__(self):
        return (type(self), (str(self), self.ranks, self.shards))


class WorkerPickleError(BackendError, TypeError):
    """A worker class or one of its constructor arguments cannot be pickled to send to the worker processes.

    One line: the path to the part that fails (``ActorWorker.init_model -> global LOCK``), why the
    class is pickled by value (defined in ``__main__``), and the two fixes.  A ``TypeError`` too,
    as pickle's own refusal is.
    """


class ClusterError(RankMeshError, RuntimeError):
    """A namespaced test cluster (:mod:`rankmesh.testing.cluster`) could not be built or driven.

    The message names the command or node at fault and what to install or call instead.
    """


class RayHandleInChannel(BackendError):
    """A value sent to a forked rank over its holder's channel holds a Ray ObjectRef or actor handle (``kind``).

    The forked rank has no Ray worker of its own to use one; its holder turns this into an error
    naming the call (:mod:`rankmesh.backends.ray.forked`)."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"a Ray {kind} cannot reach a forked rank")
        self.kind = kind
