"""The in-process backend: every rank is an object in the controller's own process.

Ranks run one after the other, in rank order, in the calling thread, so a breakpoint in a worker
method just works.  Everything else behaves as on Ray: each rank receives its own private
arguments (a worker that writes into its input changes neither the caller's batch nor another
rank's), outputs are copied when fetched, ranks outside the collect set return nothing, and a
failing rank surfaces as :class:`~rankmesh.errors.WorkerError` when its output is fetched.

How arguments stay private without a deep copy per rank: ``share`` pickles an object once
(protocol 5) and writes its large buffers into one shared-memory file
(:class:`rankmesh.sharedmem.SharedFile`, the in-process object store: one copy, as ``ray.put``).
Each rank unpickles it from read-only views of that file, and the data layer's rebuild makes its
tensors copy-on-write mappings (:func:`rankmesh.sharedmem.private_bytes`), exactly as on Ray:
no bytes copied until a rank writes, then only the written pages.  Small arguments, objects
pickle cannot carry (lambdas, locks) and objects with no large buffer are deep-copied per rank.
"""

from __future__ import annotations

import copy
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rankmesh.backend import Change, GroupCall, RankCall, Shared, merge_failures
from rankmesh.deadline import Deadline
from rankmesh.data import DataProtoFuture
from rankmesh.errors import BackendError, DispatchError, WorkerError
from rankmesh.group import WorkerGroup
from rankmesh.mesh import RankMesh
from rankmesh.serialization import loads
from rankmesh.sharedmem import COW_MIN_BYTES, SharedFile
from rankmesh.tracing.marks import timed_call
from rankmesh.tracing.recorder import deliver
from rankmesh.worker import WorkerContext, construct, invoke

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LocalPending:
    """A finished rank call: its output, or the error it raised.

    Handles are references, never copied themselves (a future that travels to another rank
    keeps pointing at the same output); :func:`fetch_local` copies what they hold.
    """

    rank: int
    value: Any = None
    error: BaseException | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "LocalPending":
        return self

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return copy.deepcopy(self.value)


def fetch_local(handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """The picklable fetch function of local futures: a private copy of each output.

    Calls already ran, so ``timeout`` has nothing to bound.  Several failing ranks: the lowest
    is raised, the others attached (``WorkerError.others``), as on Ray.
    """
    checked = [_check_handle(h) for h in handles]
    failed = [(h.rank, None, None, h.error) for h in checked if h.error is not None]
    if failed:
        raise merge_failures(failed)
    return [h.result() for h in checked]


def _check_handle(handle: Any) -> LocalPending:
    if not isinstance(handle, LocalPending):
        raise DispatchError(f"the local backend cannot fetch a {type(handle).__name__}")
    return handle


@dataclass(frozen=True, eq=False)
class StoredObject:
    """An object shared in-process: its pickle's in-band bytes and its large buffers in a file.

    Not copied by ``deepcopy`` (ranks share the one stored object); :meth:`receive` gives each
    rank its own, copy-on-write over the file.
    """

    inband: bytes
    file: SharedFile

    def __deepcopy__(self, memo: dict[int, Any]) -> "StoredObject":
        return self

    def receive(self) -> Any:
        return loads(self.inband, self.file.views())


def store_object(obj: Any) -> Any:
    """``obj`` as a :class:`StoredObject` when it pickles with large out-of-band buffers, else ``obj``.

    Futures stay as they are: their handles point at outputs that each rank's fetch copies
    once anyway, so storing them first would add a copy.
    """
    if isinstance(obj, DataProtoFuture):
        return obj
    buffers: list[pickle.PickleBuffer] = []
    try:
        inband = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:  # noqa: BLE001 - not picklable (a lambda, a lock): deep-copied per rank
        return obj
    if sum(b.raw().nbytes for b in buffers) < COW_MIN_BYTES:
        return obj
    return StoredObject(inband, SharedFile(buffers))


@dataclass(frozen=True, eq=False)
class LocalObject:
    """An object put in-process: a reference, shared by every rank (never copied by ``deepcopy``)."""

    value: Any

    def __deepcopy__(self, memo: dict[int, Any]) -> "LocalObject":
        return self

    def __reduce__(self) -> Any:  # never leaves the process: storing an argument that holds one deep-copies it
        raise TypeError("a LocalObject is a reference inside this process and cannot be pickled")


class LocalObjects:
    """:class:`~rankmesh.backend.ObjectTransport` in-process: ``put`` keeps a reference, calls are done already.

    One per group (its ranks share the controller's process), so ``outbox`` is keyed by rank.
    """

    def __init__(self) -> None:
        self.outbox: dict[Any, Any] = {}

    def put(self, value: Any) -> LocalObject:
        return LocalObject(value)

    def get(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        return [h.value if isinstance(h, LocalObject) else fetch_local([h])[0] for h in handles]

    def wait_any(self, handles: Sequence[Any], timeout: float | None = None) -> list[int]:
        return list(range(len(handles)))  # every call ran before its submit returned

    def peer_tracer(self) -> int | None:
        return None  # every rank is in this process: none reads another's memory


def _private(shared: Shared) -> Any:
    """This rank's own copy of a shared argument (already deep-copied unless stored)."""
    ref = shared.ref
    return ref.receive() if isinstance(ref, StoredObject) else ref


class LocalExecutor:
    """:class:`~rankmesh.backend.Backend` over worker objects living in this process.

    ``workers`` maps a role (``None`` for a single-role group) to one worker object per rank.
    Calls run before :meth:`submit` returns, so there is nothing for a timeout to bound
    (``call_timeout_s`` is always ``None``) and nothing can fail the backend as a whole
    (``failed`` is always ``None``).
    """

    call_timeout_s: float | None = None

    def __init__(self, workers: Mapping[str | None, Sequence[Any]]) -> None:
        sizes = {role: len(ranks) for role, ranks in workers.items()}
        if not sizes or len(set(sizes.values())) != 1:
            raise DispatchError(f"every role needs one worker per rank, got {sizes}")
        self._workers = {role: list(ranks) for role, ranks in workers.items()}
        self.world_size = next(iter(sizes.values()))
        self._closed = False

    @classmethod
    def start(
        cls,
        worker_cls: type,
        contexts: Sequence[WorkerContext],
        init_args: tuple[Any, ...] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        role: str | None = None,
    ) -> "LocalExecutor":
        """Build one ``worker_cls`` per context, in rank order, each seeing its context in ``__init__``."""
        workers = []
        for ctx in contexts:
            args, kwargs = copy.deepcopy((tuple(init_args), dict(init_kwargs or {})))
            workers.append(construct(worker_cls, ctx, args, kwargs))
        return cls({role: workers})

    def workers(self, role: str | None = None) -> list[Any]:
        return list(self._role(role))

    def _role(self, role: str | None) -> list[Any]:
        try:
            return self._workers[role]
        except KeyError:
            if role is None and len(self._workers) == 1:
                return next(iter(self._workers.values()))
            raise DispatchError(f"no role {role!r} here (roles: {sorted(map(str, self._workers))})") from None

    # ----- Backend -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> BaseException | None:
        return None

    @property
    def generation(self) -> int:
        """Always 0: in-process ranks are never replaced or renumbered."""
        return 0

    def changes_since(self, generation: int) -> list[Change]:
        return []

    def drain_timings(self) -> list[tuple[int, list[Any], int, int, int]]:
        """``[]``: in-process ranks hand their timings to the recorder as each call ends (``deliver``)."""
        return []

    def control_paths(self) -> list[str]:
        return ["in-process"] * self.world_size

    def close(self) -> None:
        """Drop the worker objects; later calls raise."""
        self._closed = True
        self._workers = {role: [] for role in self._workers}

    def share(self, obj: Any) -> Shared:
        """Store ``obj`` once (:func:`store_object`); each rank receives it copy-on-write."""
        if isinstance(obj, Shared):
            return obj
        return Shared(store_object(obj))

    def submit(
        self, role: str | None, method: str, calls: Sequence[RankCall] | GroupCall, deadline: Deadline | None = None
    ) -> list[LocalPending]:
        """Run every call now, in the given (rank) order; errors are kept for :meth:`fetch` (nothing to bound)."""
        if isinstance(calls, GroupCall):
            calls = calls.rank_calls()
        if self._closed:
            raise BackendError(f"cannot call {method}: the worker group has been shut down")
        workers = self._role(role)
        pending = []
        for call in calls:
            try:
                enter_ns = time.time_ns() if call.trace else 0
                args, kwargs = copy.deepcopy((call.args, call.kwargs))
                if call.trace:
                    value = timed_call(
                        invoke, workers[call.rank], method, args, kwargs, call.return_output, resolve=_private,
                        enter_ns=enter_ns, inputs=(args, kwargs), return_output=call.return_output, receive=call.receive,
                    )
                    if call.keep:  # non-blocking: the timing goes to the recorder now, the output into the future
                        deliver(call.rank, [[call.keep, *value[1:]]], time.time_ns())
                        value = value[0]
                else:
                    value = invoke(
                        workers[call.rank], method, args, kwargs, call.return_output, resolve=_private, receive=call.receive
                    )
                pending.append(LocalPending(call.rank, value))
            except WorkerError as exc:
                pending.append(LocalPending(call.rank, error=exc))
            except Exception as exc:  # copying the arguments failed: still the rank's failure
                err = WorkerError.from_exception(exc, call.rank, None, method)
                err.__cause__ = exc
                pending.append(LocalPending(call.rank, error=err))
        return pending

    def fetch(
        self, pending: Sequence[Any], timeout: float | None = None, borrow: bool = False, stall_warn_s: float | None = None,
        deadline: Deadline | None = None,
    ) -> list[Any]:
        """Private copies of the outputs, even with ``borrow``: in-process, a borrowed output would
        be the worker's own object, which the caller could then change under the worker.  Calls
        already ran, so neither a deadline nor ``stall_warn_s`` has anything to watch."""
        return fetch_local(pending)

    def fetcher(self, timeout: float | None = None, stall_warn_s: float | None = None) -> "LocalFetcher":
        return LocalFetcher()


@dataclass(frozen=True)
class LocalFetcher:
    """The in-process backend's fetch for futures: :func:`fetch_local`, and every call is already done.

    All instances are equal, so futures of in-process groups merge flat when concatenated.
    """

    def __call__(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        return fetch_local(handles, timeout)

    def ready(self, handles: Sequence[Any], timeout: float | None = 0.0) -> list[int]:
        """:class:`rankmesh.backend.ReadyCheck`: calls ran before ``submit`` returned."""
        return list(range(len(handles)))


def _default_mesh(mesh: RankMesh | None, world_size: int | None) -> RankMesh:
    if mesh is None:
        return RankMesh(dp=1 if world_size is None else world_size)
    if world_size is not None and world_size != mesh.world_size:
        raise DispatchError(f"world_size={world_size} but the mesh {mesh} has {mesh.world_size} ranks")
    return mesh


class LocalWorkerGroup(WorkerGroup):
    """A worker group whose ranks are objects in this process (same dispatch as every backend).

    ``mesh=None`` gives ``RankMesh(dp=world_size)`` (``world_size`` defaults to 1).
    """

    def __init__(
        self,
        worker_cls: type,
        mesh: RankMesh | None = None,
        init_args: tuple[Any, ...] = (),
        init_kwargs: Mapping[str, Any] | None = None,
        world_size: int | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
    ) -> None:
        mesh = _default_mesh(mesh, world_size)
        objects = LocalObjects()
        contexts = [
            WorkerContext(
                rank=rank,
                world_size=mesh.world_size,
                mesh=mesh,
                meshes=dict(meshes or {}),
                local_rank=rank,
                local_world_size=mesh.world_size,
                objects=objects,
            )
            for rank in range(mesh.world_size)
        ]
        self._local = LocalExecutor.start(worker_cls, contexts, init_args, init_kwargs)
        super().__init__(self._local, worker_cls, mesh=mesh, meshes=meshes)

    @property
    def workers(self) -> list[Any]:
        """The worker objects, by rank (handy in a debugger)."""
        return self._local.workers()
