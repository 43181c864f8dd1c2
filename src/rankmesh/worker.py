"""A rank's view of itself (:class:`Worker`, :class:`WorkerContext`) and the worker-side call path.

The backend describes each rank with a :class:`WorkerContext` and constructs the worker inside
``with worker_context(ctx):``.  :meth:`Worker.__new__` picks the context up, so ``self.rank`` and
``self.mesh`` already work inside a subclass's ``__init__`` -- even one that forgets to call
``super().__init__()`` -- and nothing is parsed from environment variables or other globals.

:func:`invoke` is the one function every backend calls to run a method on a worker: it resolves
:class:`Shared` handles, runs the method (registered methods materialize ``DataProtoFuture``
arguments themselves), awaits async methods, drops the output for ranks outside the collect set,
and wraps failures in :class:`WorkerError` carrying the rank.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Mapping

from rankmesh.dispatch.modes import Dispatch
from rankmesh.dispatch.register import register
from rankmesh.dispatch.spec import DEFAULT_MESH
from rankmesh.errors import DispatchError, RecoveryError, WorkerError
from rankmesh.backend import ObjectTransport, Shared, check_receive
from rankmesh.mesh import DistRankInfo, RankCoords, RankMesh
from rankmesh.data.buffer import stamp_version
from rankmesh.data.receive import own_copies
from rankmesh.serialization import receiving
from rankmesh.sharedmem import receive_info
from rankmesh.validate import is_int

logger = logging.getLogger(__name__)

#: Attribute of a fused worker (verl's ``create_colocated_worker_raw_cls``) that maps each role
#: name to the role object it built in the same process; backends route a role's calls there.
FUSED_ROLES_ATTR = "fused_worker_dict"


@dataclass(frozen=True)
class WorkerContext:
    """Everything a rank knows about its place in the group, set by the backend.

    ``meshes`` holds the group's extra named meshes (all over the same ranks); ``"default"`` is
    always ``mesh``.  ``objects`` is the backend's object transport for this process
    (:class:`~rankmesh.backend.ObjectTransport`; ``None`` outside a backend).
    """

    rank: int
    world_size: int
    mesh: RankMesh
    meshes: Mapping[str, RankMesh] = field(default_factory=dict)
    local_rank: int = 0
    local_world_size: int = 1
    node: str = "localhost"
    role: str | None = None
    objects: ObjectTransport | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mesh.world_size != self.world_size:
            raise DispatchError(f"mesh {self.mesh} has world size {self.mesh.world_size}, not {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise DispatchError(f"rank {self.rank} is out of range for world size {self.world_size}")
        meshes = {DEFAULT_MESH: self.mesh, **dict(self.meshes)}
        if meshes[DEFAULT_MESH] is not self.mesh and meshes[DEFAULT_MESH] != self.mesh:
            raise DispatchError("meshes['default'] must be the group's mesh")
        for name, m in meshes.items():
            if m.world_size != self.world_size:
                raise DispatchError(f"mesh {name!r} ({m}) has world size {m.world_size}, not {self.world_size}")
        object.__setattr__(self, "meshes", meshes)

    @classmethod
    def standalone(cls) -> "WorkerContext":
        """Rank 0 of a world of one: what a worker built outside any backend sees."""
        return cls(rank=0, world_size=1, mesh=RankMesh())

    @property
    def rank_info(self) -> DistRankInfo:
        return self.mesh.coords(self.rank)

    def coords(self) -> RankCoords:
        """This rank's place in the mesh, as every message names it (``coords().label()``: ``tp1 dp0``)."""
        return self.mesh.rank_coords(self.rank)


_CURRENT: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar("rankmesh_worker_context", default=None)


@contextlib.contextmanager
def worker_context(ctx: WorkerContext) -> Iterator[WorkerContext]:
    """Construct workers inside this block so that they see ``ctx`` from ``__init__`` on."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_context() -> WorkerContext | None:
    return _CURRENT.get()


class Worker:
    """Base class of worker classes (verl's ``Worker``): rank, world size and mesh from the backend."""

    _rankmesh_context: WorkerContext

    def __new__(cls, *args: Any, **kwargs: Any) -> "Worker":
        self = super().__new__(cls)
        ctx = _CURRENT.get()
        if ctx is None:
            logger.debug("%s built outside a backend: acting as rank 0 of 1", cls.__name__)
            ctx = WorkerContext.standalone()
        self._rankmesh_context = ctx
        self._rankmesh_dispatch_dp_rank: dict[str, int] = {}
        self._rankmesh_collect_dp_rank: dict[str, bool] = {}
        self._rankmesh_weight_version = 0
        return self

    def __init__(self) -> None:  # the context is set in __new__; subclasses may skip this
        pass

    @property
    def context(self) -> WorkerContext:
        return self._rankmesh_context

    def rankmesh_transport_info(self) -> dict[str, Any]:
        """This rank's receive path (copy-on-write or copy) and its counters; see ``WorkerGroup.transport_info``."""
        return {"rank": self.rank, **receive_info()}

    @property
    def rank(self) -> int:
        return self._rankmesh_context.rank

    @property
    def world_size(self) -> int:
        return self._rankmesh_context.world_size

    @property
    def mesh(self) -> RankMesh:
        return self._rankmesh_context.mesh

    @property
    def meshes(self) -> Mapping[str, RankMesh]:
        return self._rankmesh_context.meshes

    @property
    def rank_info(self) -> DistRankInfo:
        return self._rankmesh_context.rank_info

    @property
    def local_rank(self) -> int:
        return self._rankmesh_context.local_rank

    @property
    def local_world_size(self) -> int:
        return self._rankmesh_context.local_world_size

    @property
    def node(self) -> str:
        return self._rankmesh_context.node

    # ----- weight versions (asynchronous pipelines: docs/async.md) -------------------------------

    @property
    def weight_version(self) -> int:
        """The version of the weights this rank holds: 0 at start, then what the last refit into it said.

        ``rankmesh.reshard.reshard(..., version=v)`` sets it on every destination rank it writes;
        set it yourself for weights loaded otherwise (``self.weight_version = v``, or ``+= 1``
        after an update, as weight-sync code elsewhere does).  :meth:`stamp_weight_version`
        writes it into the rows a rank generates.
        """
        return self._rankmesh_weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        if not is_int(version) or version < 0:
            raise DispatchError(f"rank {self.rank}: weight_version must be a version >= 0, got {version!r}")
        self._rankmesh_weight_version = int(version)

    def stamp_weight_version(self, data: Any) -> Any:
        """``data`` (a DataProto this rank made) with a ``weight_version`` column: this rank's version on every row.

        A column, so it survives slicing and concat on the way to the trainer, which can check
        its staleness bound on the rows it trains on.  Returns ``data`` (changed in place).
        """
        return stamp_version(data, self._rankmesh_weight_version)

    # ----- recovery hooks (called when the Ray backend replaces dead ranks) --------------------

    def leave_distributed(self) -> None:
        """A survivor of a rank death, before torch.distributed is re-formed: let go of old groups.

        Drop every reference to a process group this worker built or captured (the backend then
        destroys the default group).  Called once the rank's main thread is free.  Default: nothing.
        """

    def rejoin_distributed(self) -> None:
        """A survivor, after the default process group was re-formed with the new rank(s): rebuild
        the groups dropped by :meth:`leave_distributed`.  Default: nothing."""

    def restore_from_peer(self, peer_rank: int, sending: bool) -> None:
        """Give a replaced rank the state its dead predecessor had, from a live peer holding it.

        Called on both ends at once, after the world was re-formed: on the new rank with
        ``sending=False`` (receive from ``peer_rank``) and on its live dp peer, the rank with the
        same (tp, pp, cp, ep) coordinates, with ``sending=True`` (send to ``peer_rank``).  Use
        point-to-point ``torch.distributed.send``/``recv`` on the default group, in the same
        order on both ends.  A worker with no state needs none: the default does nothing.
        """

    def recovery_state(self) -> Any:
        """What a replaced rank takes from this live peer through the backend's object store, for
        state that cannot go over torch.distributed (a group without process groups); ``None``
        (the default): nothing.  Run on the peer after :meth:`restore_from_peer`; the new rank
        gets it in :meth:`load_recovery_state`."""
        return None

    def load_recovery_state(self, state: Any) -> None:
        """A replaced rank: take ``state``, what its live peer's :meth:`recovery_state` returned
        (never ``None``).  Default: nothing."""

    # ----- verl's worker-side dispatch info ----------------------------------------------------

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        """Say which dp piece this rank takes for ``mesh_name`` and whether its output is kept."""
        if mesh_name in self._rankmesh_dispatch_dp_rank:
            raise DispatchError(f"rank {self.rank}: mesh {mesh_name!r} is already registered")
        self._rankmesh_dispatch_dp_rank[mesh_name] = int(dp_rank)
        self._rankmesh_collect_dp_rank[mesh_name] = bool(is_collect)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int | None:
        """This rank's dp rank for ``mesh_name`` (registered, or from a declared mesh), else None."""
        if mesh_name in self._rankmesh_dispatch_dp_rank:
            return self._rankmesh_dispatch_dp_rank[mesh_name]
        mesh = self.meshes.get(mesh_name)
        return None if mesh is None else mesh.coords(self.rank).dp_rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool | None:
        """Whether this rank's output is kept for ``mesh_name``, else None if unknown."""
        if mesh_name in self._rankmesh_collect_dp_rank:
            return self._rankmesh_collect_dp_rank[mesh_name]
        mesh = self.meshes.get(mesh_name)
        return None if mesh is None else mesh.is_collect(self.rank)

    def get_dispatch_collect(self) -> tuple[dict[str, int], dict[str, bool]]:
        """Copies of every registered (dispatch dp rank, collect flag) mapping, keyed by mesh name."""
        return dict(self._rankmesh_dispatch_dp_rank), dict(self._rankmesh_collect_dp_rank)

    def set_dispatch_collect(self, dispatch_dp_rank: Mapping[str, int], collect_dp_rank: Mapping[str, bool]) -> None:
        """Replace the registered dispatch info (e.g. copied from a colocated worker)."""
        if set(dispatch_dp_rank) != set(collect_dp_rank):
            raise DispatchError("dispatch and collect info must name the same meshes")
        self._rankmesh_dispatch_dp_rank = {k: int(v) for k, v in dispatch_dp_rank.items()}
        self._rankmesh_collect_dp_rank = {k: bool(v) for k, v in collect_dp_rank.items()}


# ----- the worker-side call path ---------------------------------------------------------------


def _describe(worker: Any) -> tuple[int, RankCoords | None, str | None]:
    ctx = getattr(worker, "_rankmesh_context", None)
    if isinstance(ctx, WorkerContext):
        return ctx.rank, ctx.coords(), ctx.node
    return -1, None, None


def _fail(worker: Any, method: str, exc: BaseException) -> WorkerError:
    """The rank's error, with its node and the traceback text (which survives pickling)."""
    rank, coords, node = _describe(worker)
    return WorkerError.from_exception(exc, rank, coords, f"{type(worker).__name__}.{method}", node)


def _prepare(
    worker: Any, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], resolve: Callable[[Shared], Any] | None
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    def one(value: Any) -> Any:
        if isinstance(value, Shared):
            if resolve is None:
                raise DispatchError(f"{method}: got a Shared handle but the backend gave no resolve function")
            return resolve(value)
        return value

    fn = getattr(worker, method)
    return fn, tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def run_awaitable(worker: Any, awaitable: Awaitable[Any]) -> Any:
    """Run ``awaitable`` to completion on ``worker``'s own event loop (kept across calls).

    Async workers often create loop-bound objects (locks, engines) in one call and use them in the
    next, so each worker keeps one loop.  If the calling thread already runs a loop (an async
    controller), the worker's loop runs in a helper thread instead.
    """
    store = getattr(worker, "__dict__", None)
    loop = store.get("_rankmesh_loop") if store is not None else None
    if loop is None or loop.is_closed():
        loop = asyncio.new_event_loop()
        if store is not None:
            store["_rankmesh_loop"] = loop
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return loop.run_until_complete(awaitable)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rankmesh-async") as pool:
        return pool.submit(loop.run_until_complete, awaitable).result()


def invoke(
    worker: Any,
    method: str,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    return_output: bool = True,
    resolve: Callable[[Shared], Any] | None = None,
    receive: str | None = None,
) -> Any:
    """Run ``worker.method(*args, **kwargs)`` as a group call does; see the module docstring.

    ``resolve`` turns a :class:`Shared` handle into this rank's private copy of the object.
    ``receive="copy"``: inputs that arrived as copy-on-write views become private copies before
    the method runs, and whatever the method fetches itself (futures) arrives copied
    (:mod:`rankmesh.data.receive`; the call runs inside :func:`rankmesh.serialization.receiving`,
    the one per-call receive setting).  Returns the output, or ``None`` when ``return_output``
    is false.  Raises :class:`WorkerError`.
    """
    try:
        with receiving(check_receive(receive) or "cow"):
            fn, args, call_kwargs = _prepare(worker, method, args, kwargs or {}, resolve)
            if receive == "copy":
                args, call_kwargs = own_copies(args), own_copies(call_kwargs)
            result = fn(*args, **call_kwargs)
            if inspect.isawaitable(result):
                result = run_awaitable(worker, result)
    except Exception as exc:
        err = _fail(worker, method, exc)  # keeps the traceback as text
        # The frames' locals (tensors, process groups) go now, not whenever the exception does:
        # a process group left alive this way keeps its gloo connections, and its peers blocked.
        traceback.clear_frames(exc.__traceback__)
        raise err from exc
    return result if return_output else None


def construct(cls: type, ctx: WorkerContext, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
    """Build one rank's worker with ``ctx`` visible from ``__init__`` on; failures name the rank."""
    with worker_context(ctx):
        try:
            return cls(*args, **dict(kwargs or {}))
        except Exception as exc:
            raise WorkerError.from_exception(exc, ctx.rank, ctx.coords(), f"{cls.__name__}.__init__", ctx.node) from exc


def move(worker: Any, ctx: WorkerContext) -> None:
    """Give a live worker its new place after its group shrank or grew (:mod:`rankmesh.backends.ray.remesh`).

    The worker keeps its state (parameters, optimizer, caches); only where it stands changes:
    rank, world size and mesh (its shard, i.e. every coordinate but dp, stays the same).  The dp
    ranks a worker registered for meshes of its own (verl's ``_register_dispatch_collect_info``)
    are dropped, since they were computed for the old world: register them again in
    ``rejoin_distributed``, which runs next.
    """
    if not isinstance(worker, Worker):
        raise RecoveryError(f"cannot move a {type(worker).__name__} to rank {ctx.rank} of a re-meshed group: only a "
                            "rankmesh Worker knows its place (derive the class from rankmesh.Worker)", [ctx.rank])
    worker._rankmesh_context = ctx
    worker._rankmesh_dispatch_dp_rank.clear()
    worker._rankmesh_collect_dp_rank.clear()
