"""WorkerGroup: the controller-side object whose methods fan out to every rank of a group.

Binding happens once, at construction, the same way for every backend (:mod:`rankmesh.binding`):
each ``@register`` method of the worker class becomes a method of the group with the worker
method's name, doc and signature (minus ``self``), and its dispatch mode is resolved into a plan
for the group's mesh right then, so bad modes fail early and calls do no planning.

A call flows one way: split the arguments into pieces (:mod:`rankmesh.dispatch.split`), ship
each distinct object once (``executor.share``), submit one :class:`RankCall` per running rank
(``return_output`` only for collected ranks), then either fetch and join, or return a future.
The executor (a backend) never sees dispatch modes; it only ships, runs and fetches.
"""

from __future__ import annotations

import difflib
import enum
import os
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from rankmesh.backend import INLINE_BYTES, Backend, GroupCall, RankCall, Selection, Shared, check_receive
from rankmesh.binding import EXECUTE_ALL, Binding, BoundMethod, MethodTable, PerRank
from rankmesh.deadline import Deadline
from rankmesh.dispatch.modes import DispatchRegistry, Execute, UserMode
from rankmesh.dispatch.register import MethodSpec
from rankmesh.dispatch.spec import DispatchPlan, MeshSpec
from rankmesh.dispatch.split import CallSite, join_outputs, output_future, split_call
from rankmesh.errors import DispatchError, GroupAttributeError
from rankmesh.futures import GroupFuture
from rankmesh.mesh import RankMesh
from rankmesh.replicas import RankSubset, ReplicaSelection, restrict_plan, select_replicas
from rankmesh.tracing import TRACING, check_trace_path, write_trace
from rankmesh.tracing.observer import CallObserver, ObservedCall
from rankmesh.tracing.recorder import Recorder
from rankmesh.validate import is_int, positive_seconds

logger = logging.getLogger(__name__)

Args = tuple[Any, ...]
Kwargs = dict[str, Any]

#: Objects passed inline instead of through ``executor.share`` (small, or handles themselves).  A
#: future is shared, not inline: the references it holds must travel inside the backend's own
#: serialization (on Ray, a reference pickled any other way stays pinned in the object store).
_INLINE_TYPES = (type(None), bool, int, float, complex, str, enum.Enum, Shared)

class GroupMethod:
    """One bound group method (``wg.compute``): calling it runs one group call.

    It shows the worker method's name, doc and signature (minus ``self``), so ``help`` and
    ``inspect.signature`` read like the worker's; ``rankmesh_binding`` is its resolved
    :class:`Binding`.  ``timeout_s`` bounds each call (``None``: the group's ``call_timeout_s``);
    ``stall_warn_s`` warns where the ranks are when a call runs that long (``None``: the group's).
    """

    def __init__(
        self, group: "WorkerGroup", bound: "BoundMethod", timeout_s: float | None = None, stall_warn_s: float | None = None
    ) -> None:
        self.__name__ = bound.binding.name
        self.__qualname__ = f"{type(group).__name__}.{bound.binding.name}"
        self.__doc__ = bound.doc
        self.__module__ = bound.module
        self.__signature__ = bound.signature
        self.rankmesh_binding = bound.binding
        self._group, self._bound, self._timeout_s, self._stall_warn_s = group, bound, timeout_s, stall_warn_s

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._group._call(self.rankmesh_binding, args, kwargs, self._timeout_s, self._stall_warn_s)
        except KeyboardInterrupt:
            # Ctrl-C: the ranks are stopped first, and the caller sees a short exception, not the wait loop's frames.
            raise self._group.interrupted(self.__name__) from None

    def with_timeout(self, timeout_s: float | None, stall_warn_s: float | None = None) -> "GroupMethod":
        """This method with each call bounded by ``timeout_s`` seconds (and a stall warning after ``stall_warn_s``)."""
        return GroupMethod(self._group, self._bound, timeout_s, stall_warn_s)

    def __repr__(self) -> str:
        return f"<group method {self.__qualname__}>"


class TimedGroup:
    """``wg.with_timeout(s)``: the group's methods, each call bounded by ``s`` seconds.

    A view, not a copy: it calls the same group.  Non-method attributes are the group's.
    ``stall_warn_s`` (when given) overrides the group's stall warning for these calls.
    """

    def __init__(self, group: "WorkerGroup", timeout_s: float | None, stall_warn_s: float | None = None) -> None:
        self._group, self._timeout_s, self._stall_warn_s = group, timeout_s, stall_warn_s

    def __getattr__(self, name: str) -> Any:
        group = vars(self).get("_group")
        if group is None:  # copy and pickle probe a bare object: no group to ask yet
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name in group.method_names:
            method: GroupMethod = getattr(group, name)
            return method.with_timeout(self._timeout_s, self._stall_warn_s)
        if name.startswith("execute_"):
            raise DispatchError(f"{name} does not take a timeout; use a @register method or call_timeout_s on the group")
        return getattr(group, name)

    def __repr__(self) -> str:
        limits = [] if self._timeout_s is None else [f"{self._timeout_s:g}"]
        limits += [] if self._stall_warn_s is None else [f"stall_warn_s={self._stall_warn_s:g}"]
        return f"{self._group!r}.with_timeout({', '.join(limits)})"


@dataclass(frozen=True)
class CallLayout:
    """A plan as a call's shape: which share each running rank runs, and where the collected outputs are.

    A share is one piece with or without an output (``shares[i] = (piece, collected)``: a rank
    outside the collect set runs its piece and sends nothing back); ``selection`` is reusable
    (:meth:`rankmesh.backend.Selection.reusable`), so carriers keep what they derive from it;
    ``order[i]`` is where the ``i``-th collect rank's output is among the running ranks';
    ``collects_all``: every running rank is collected, in order (the outputs are the collected ones).
    """

    selection: Selection
    shares: tuple[tuple[int, bool], ...]
    order: tuple[int, ...]
    collects_all: bool

    @classmethod
    def of(cls, plan: DispatchPlan, broadcast: bool) -> "CallLayout":
        """The layout of ``plan``'s calls; ``broadcast``: every rank gets piece 0 (nothing was split)."""
        collect = set(plan.collect_ranks)
        shares: dict[tuple[int, bool], int] = {}
        index = [shares.setdefault((0 if broadcast else plan.piece_of_rank[r], r in collect), len(shares))
                 for r in plan.run_ranks]
        where = {r: i for i, r in enumerate(plan.run_ranks)}
        order = tuple(where[r] for r in plan.collect_ranks)
        return cls(Selection.reusable(plan.run_ranks, index), tuple(shares), order, order == tuple(range(len(plan.run_ranks))))


class WorkerGroup:
    """A group of ranks running one worker class, driven like one local object.

    ``mesh=None`` means ``RankMesh(dp=executor.world_size)``; ``meshes`` adds named meshes over
    the same ranks (``Dispatch.named("rollout", ...)``).  ``role`` picks the worker instance in
    processes that host several colocated roles.  ``registry`` resolves mode names.
    """

    def __init__(
        self,
        executor: Backend,
        worker_cls: type,
        mesh: RankMesh | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
        role: str | None = None,
        registry: DispatchRegistry | None = None,
    ) -> None:
        table = MethodTable.build(worker_cls, executor.world_size, mesh, meshes, role, registry, type(self))
        self._install(executor, table)

    # ----- construction ------------------------------------------------------------------------

    def _install(self, executor: Backend, table: MethodTable) -> None:
        """Drive ``executor`` with the methods of ``table`` (the one place a group gets its state)."""
        if table.mesh.world_size != executor.world_size:
            raise DispatchError(f"mesh {table.mesh} covers {table.mesh.world_size} ranks but the backend has {executor.world_size}")
        self._executor = executor
        self._table = table
        self._observer: CallObserver | None = None  # set by wg.trace(...) for this group alone
        self._receive: str | None = None  # set_receive: overrides every method's declaration
        self._registered_plans: dict[str, DispatchPlan] = {}
        self._adhoc: dict[tuple[str, str], Binding] = {}
        #: rankmesh.reshard.run.ReshardSession of the reshards into this group (made by the first one).
        self.reshard_session: Any = None
        self._weight_versions = [0] * table.mesh.size("dp")  # per dp replica, as the controller recorded them
        self._views: dict[tuple[int, ...], ReplicaGroup] = {}  # wg.replicas(...), made once per selection
        self._layouts: dict[tuple[int, bool], tuple[DispatchPlan, CallLayout]] = {}  # (id(plan), broadcast) -> its layout
        for name, bound in table.methods.items():
            setattr(self, name, GroupMethod(self, bound))

    def _reshape(self, mesh: RankMesh, weight_versions: Sequence[int]) -> None:
        """The group shrank or grew to ``mesh`` (its backend holds the new ranks already).

        Every method is planned again for the new mesh; what was planned or made for the old one
        (registered meshes' plans, ad-hoc bindings, replica views, the reshard session) is
        dropped.  ``weight_versions``: the new replicas' versions, in dp order.  A trace or a
        receive setting stays.
        """
        table = MethodTable.build(self._table.worker_cls, mesh.world_size, mesh, None, self._table.role,
                                  self._table.registry, type(self), self._table.late_meshes)
        for name in self._table.methods:
            delattr(self, name)
        self._table = table
        self._registered_plans.clear()
        self._adhoc.clear()
        self._views.clear()
        self._layouts.clear()
        self.reshard_session = None
        self._weight_versions = list(weight_versions)
        for name, bound in table.methods.items():
            setattr(self, name, GroupMethod(self, bound))

    # ----- introspection -----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._executor.world_size

    @property
    def mesh(self) -> RankMesh:
        return self._table.mesh

    @property
    def meshes(self) -> dict[str, RankMesh]:
        return dict(self._table.meshes)

    @property
    def executor(self) -> Backend:
        return self._executor

    @property
    def registry(self) -> DispatchRegistry:
        return self._table.registry

    @property
    def worker_cls(self) -> type:
        return self._table.worker_cls

    @property
    def role(self) -> str | None:
        return self._table.role

    @property
    def method_names(self) -> list[str]:
        """Names of the bound ``@register`` methods."""
        return list(self._table.methods)

    @property
    def node_labels(self) -> list[str]:
        """Where each rank runs, as traces name it (``node 0``...; in-process: ``local``)."""
        return ["local"] * self.world_size

    @property
    def ranks_run_at_once(self) -> bool:
        """Whether the ranks of one call run at the same time, each in its own process (traces
        then count a rank late to start as slow); in-process they run one after another."""
        return False

    @property
    def node_info(self) -> list[dict[str, Any]] | None:
        """Per rank, where its process runs (``node_id``, ``pid``, ...); ``None`` in-process, where every
        rank lives in the controller's process."""
        return None

    @property
    def trace_name(self) -> str:
        """The group's name in traces: its role, else its worker class."""
        return self.role or self.worker_cls.__name__

    @property
    def trace_startup(self) -> dict[str, Any] | None:
        """The group's start-up report as a trace keeps it (``None``: in-process ranks start at once)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_cls.__name__}, {self.mesh}, methods={len(self._table.methods)})"

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: say whether the worker defines ``name`` without
        # @register, and list what is registered.  Dunder names (copy and pickle probe them) and an
        # object without its table yet (being unpickled) get the plain error, without recursing.
        table: MethodTable | None = vars(self).get("_table")
        plain = f"{type(self).__name__!r} object has no attribute {name!r}"
        if table is None or name.startswith("__"):
            raise AttributeError(plain)
        public = sorted(m for m in table.methods if not m.startswith("_"))  # not Worker's own _query_* helpers
        registered = f"registered methods: {', '.join(public) or 'none'}"
        worker = table.worker_cls.__name__
        if callable(getattr(table.worker_cls, name, None)):
            raise GroupAttributeError(
                f"{plain}: {worker} defines {name} but it is not registered; decorate it with @register(...) "
                f"to call it as wg.{name}(...), or call it as it is with wg.call_ranks({name!r}, args=[...]), "
                f"one tuple of arguments per rank; {registered}"
            )
        close = difflib.get_close_matches(name, public, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise GroupAttributeError(f"{plain}{hint} ({worker} has no method of that name; {registered})")

    @property
    def weight_versions(self) -> tuple[int, ...]:
        """The weight version of each dp replica, as recorded here (by refits, or by setting :attr:`weight_version`).

        A record on the controller, kept without asking the ranks: ``reshard(..., version=v)``
        writes it for the replicas it refits (and each of their ranks learns ``v`` too, see
        ``Worker.weight_version``).  All 0 at start.
        """
        return tuple(self._weight_versions)

    @property
    def weight_version(self) -> int:
        """The one version every replica holds (the trainer's, say); reading it is refused while replicas differ.

        Setting it records ``version`` for every replica of this group (of this view: its replicas
        alone), e.g. ``actor.weight_version += 1`` after each optimizer step, so that a reshard from
        the actor carries the version on.  No rank is called (a refit tells its destination ranks itself).
        """
        versions = set(self.weight_versions)
        if len(versions) != 1:
            raise DispatchError(f"the replicas hold weight versions {self.weight_versions}; read weight_versions for each one")
        return versions.pop()

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        for replica in self._own_replicas():
            self.record_weight_version(replica, version)

    def _own_replicas(self) -> Sequence[int]:
        """The group's dp replicas this object covers (all of them; a view: its selection)."""
        return range(len(self._weight_versions))

    def record_weight_version(self, replica: int, version: int) -> None:
        """Record ``version`` for dp replica ``replica`` of this group alone."""
        if not is_int(version) or version < 0:
            raise DispatchError(f"weight_version must be a version >= 0, got {version!r}")
        self._weight_versions[replica] = int(version)

    def replica(self, index: int) -> "ReplicaGroup":
        """This group restricted to dp replica ``index`` (all its tp, cp and pp ranks); see :meth:`replicas`."""
        return self.replicas([index])

    def replicas(self, indices: Sequence[int]) -> "ReplicaGroup":
        """A view of this group restricted to dp replicas ``indices`` (their data pieces in that order).

        Every method of the group is on the view, planned for the view's mesh (the group's with
        ``dp=len(indices)``): a DataProto is split over the selected replicas only and outputs come
        from their collect ranks.  Calls go to the group's own processes through the group's
        path (timeouts, hang reports, failure policy); on Ray, non-blocking calls on disjoint
        replicas run at the same time, calls reaching one rank run in submission order, and a
        later whole-group call waits on each rank for the replica calls submitted before it.
        Errors and hang reports name the ranks by the group's numbering and coordinates (``dp``
        is the replica); traces put a view's calls on the group's tracks, named ``method [replica i]``.
        """
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise DispatchError(f"replicas(indices) takes a list of dp replica ids, got {type(indices).__name__}")
        key = tuple(indices)
        view = self._views.get(key) if all(type(i) is int for i in key) else None  # keys were checked once
        if view is None:  # a view is made once (its plans and reshard session are kept with it)
            selection = select_replicas(self.mesh, key, "replicas(indices)")  # checks them, names the argument
            view = self._views[selection.replicas] = ReplicaGroup(self, selection)
        return view

    def with_timeout(self, timeout_s: float | None = None, *, stall_warn_s: float | None = None) -> TimedGroup:
        """This group with every call bounded by ``timeout_s`` seconds (blocking or ``.get()``).

        A call that runs past it raises ``FetchTimeoutError`` naming the unfinished ranks (on
        Ray a ``HangError``, saying where each one is stuck); they keep running (stop them with
        ``shutdown()``).  ``stall_warn_s`` logs where the unfinished ranks are, once, when a call
        runs that long, and keeps waiting; ``timeout_s=None`` keeps the group's timeout.  The
        in-process backend runs calls before returning, so there is nothing to bound there.
        """
        if timeout_s is None and stall_warn_s is None:
            raise DispatchError("with_timeout() needs timeout_s, stall_warn_s or both, e.g. with_timeout(30, stall_warn_s=10)")
        return TimedGroup(
            self,
            None if timeout_s is None else positive_seconds(timeout_s, "with_timeout(timeout_s)", DispatchError),
            None if stall_warn_s is None else positive_seconds(stall_warn_s, "with_timeout(stall_warn_s)", DispatchError),
        )

    @contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[Recorder]:
        """Record this group's calls made in the block (no other group's); write a Chrome trace to ``path``.

        The per-group form of ``with rankmesh.trace(path):``: when a program-wide recorder is
        installed too, this group's calls in the block go to this file instead of that one.  A path
        no trace can be written to raises :class:`~rankmesh.errors.TraceError` on entry.
        """
        path = check_trace_path(path, "wg.trace(path)")
        recorder = Recorder(path)
        previous, self._observer = self._observer, recorder
        try:
            yield recorder
        finally:
            self._observer = previous
            write_trace(recorder, path)

    # ----- lifetime ----------------------------------------------------------------------------

    @property
    def call_timeout_s(self) -> float | None:
        """Seconds every call may take unless it gives its own (``None``: no limit)."""
        return self._executor.call_timeout_s

    @property
    def closed(self) -> bool:
        return self._executor.closed

    @property
    def failed(self) -> BaseException | None:
        """The error that made the backend unusable (a dead process on Ray), else None."""
        return self._executor.failed

    @property
    def outlives_driver(self) -> bool:
        """Whether the ranks are meant to run on after this process ends (a detached group on Ray)."""
        return False

    def interrupted(self, call: str) -> KeyboardInterrupt:
        """Ctrl-C during ``call``: stop the ranks, say so in one line, and return the exception to raise.

        Why stop them: they are mid-call, perhaps inside a collective, so no later call could trust
        their state, and a script that exits would otherwise wait on its busy processes to be reaped.
        A group whose ranks outlive the driver (:attr:`outlives_driver`) keeps running; its call is
        abandoned (the ranks finish it, and their next call queues behind it).
        """
        ranks = self.world_size
        if self.outlives_driver:
            return KeyboardInterrupt(f"{call} interrupted; the detached group keeps its {ranks} ranks running")
        logger.warning("interrupted: stopping %d worker process%s of %s", ranks, "" if ranks == 1 else "es", self.trace_name)
        self._executor.close()
        return KeyboardInterrupt(f"{call} interrupted; its group's {ranks} ranks were stopped")

    def shutdown(self) -> None:
        """Stop the ranks (on Ray: kill the processes, every role spawned from them too)."""
        observer = self._watcher()
        if observer is not None:  # a trace recording: it collects what the ranks still hold for it first
            observer.closing(self)
        self._executor.close()

    def drain_rank_timings(self) -> list[tuple[int, list[Any], int, int, int]]:
        """Per rank, the timings it keeps of traced non-blocking calls (``rankmesh.tracing.recorder.TraceSlot.drain``)."""
        return self._executor.drain_timings()

    # ----- calling -----------------------------------------------------------------------------

    def _call(
        self, binding: Binding, args: Args, kwargs: Kwargs, timeout: float | None = None, stall_warn_s: float | None = None
    ) -> Any:
        # Tracing off costs one look for an observer (`_watcher`); on, `seen` hears the call's life
        # (rankmesh.tracing.observer: begin, phases, shipped objects, outputs, end).
        observer = self._watcher()
        seen = None if observer is None else self._observe(observer, binding, args, kwargs)
        if isinstance(binding.entry, (UserMode, PerRank)):
            return self._call_user(binding, binding.entry, args, kwargs, timeout, seen, stall_warn_s)
        spec, site = binding.entry, binding.site
        plan = binding.plan if binding.plan is not None else self._late_plan(spec, site)
        deadline = Deadline.after(self.call_timeout_s if timeout is None else timeout)  # the call's one deadline
        split = split_call(spec, plan.n_pieces, args, kwargs, site, binding.method.padding)
        layout = self._layout(plan, split.broadcast)
        # A non-blocking concat call's future reads the collect ranks alone (output_future, below).
        outputs_only = not binding.method.blocking and spec.output == "concat" and not split.tensordicts
        if seen is None:
            pending = self._submit_pieces(binding, split.pieces, layout, deadline, outputs_only)
        else:
            seen.phase("split")
            per_rank = [split.pieces[0 if split.broadcast else plan.piece_of_rank[r]] for r in plan.run_ranks]
            pending = self._submit(binding, plan.run_ranks, per_rank, set(plan.collect_ranks), seen, deadline)
        order = layout.order

        def finish(outputs: list[Any]) -> Any:
            collected = outputs if layout.collects_all else [outputs[i] for i in order]
            return join_outputs(spec, split, collected, plan.collect_ranks, site)

        if binding.method.blocking:
            # concat writes every collected tensor into a fresh batch: borrow them as read-only
            # views, so the controller copies each byte once (not on receive and again in concat).
            outputs = self._executor.fetch(pending, borrow=spec.output == "concat", stall_warn_s=stall_warn_s, deadline=deadline)
            return finish(outputs) if seen is None else seen.end(finish(seen.received(outputs, self._group_ranks(plan.run_ranks))))
        if spec.output == "concat" and not split.tensordicts:  # TensorDicts join in finish()
            future: Any = output_future(split, [pending[i] for i in order], self._executor.fetcher(timeout, stall_warn_s))
        else:
            future = GroupFuture(self._executor.fetch, pending, finish, timeout, stall_warn_s, self._executor.fetcher())
        return future if seen is None else seen.end(future)

    def _call_user(
        self,
        binding: Binding,
        mode: UserMode | PerRank,
        args: Args,
        kwargs: Kwargs,
        timeout: float | None = None,
        seen: ObservedCall | None = None,
        stall_warn_s: float | None = None,
    ) -> Any:
        if isinstance(mode, PerRank):
            ranks, per_rank = args  # call_ranks: the ranks and each one's (args, kwargs), checked there
        else:
            ranks, per_rank = self._user_pieces(binding, mode, args, kwargs)
        deadline = Deadline.after(self.call_timeout_s if timeout is None else timeout)
        if seen is not None:
            seen.phase("split")
        pending = self._submit(binding, ranks, per_rank, set(ranks), seen, deadline)

        def finish(outputs: list[Any]) -> Any:
            return mode.collect_fn(self, list(outputs))

        if binding.method.blocking:
            outputs = self._executor.fetch(pending, stall_warn_s=stall_warn_s, deadline=deadline)
            return finish(outputs) if seen is None else seen.end(finish(seen.received(outputs, self._group_ranks(ranks))))
        future = GroupFuture(self._executor.fetch, pending, finish, timeout, stall_warn_s, self._executor.fetcher())
        return future if seen is None else seen.end(future)

    def _user_pieces(
        self, binding: Binding, mode: UserMode, args: Args, kwargs: Kwargs
    ) -> tuple[tuple[int, ...], list[tuple[Args, Kwargs]]]:
        """A user mode's ranks and each one's (args, kwargs), from its ``dispatch_fn``."""
        world, site = self.world_size, binding.site
        result = mode.dispatch_fn(self, *args, **kwargs)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise site.error("dispatch_fn must return (args_lists, kwargs_lists)")
        arg_lists, kwarg_lists = result
        if not isinstance(arg_lists, (tuple, list)) or not isinstance(kwarg_lists, Mapping):
            raise site.error("dispatch_fn must return a tuple of lists and a dict of lists")
        for key, value in [*enumerate(arg_lists), *kwarg_lists.items()]:
            if not isinstance(value, (list, tuple)) or len(value) != world:
                got = f"{len(value)} items" if isinstance(value, (list, tuple)) else type(value).__name__
                raise site.error(f"dispatch_fn returned {got} for {site.arg(key)}; need a list of {world} (world size)")
        ranks = (0,) if binding.method.execute_mode is Execute.RANK_ZERO else tuple(range(world))
        return ranks, [(tuple(a[r] for a in arg_lists), {k: v[r] for k, v in kwarg_lists.items()}) for r in ranks]

    def _layout(self, plan: DispatchPlan, broadcast: bool) -> CallLayout:
        """``plan``'s layout (made once per plan: every call of a method reuses it)."""
        kept = self._layouts.get((id(plan), broadcast))
        if kept is not None and kept[0] is plan:
            return kept[1]
        layout = CallLayout.of(plan, broadcast)
        self._layouts[(id(plan), broadcast)] = (plan, layout)
        return layout

    def _submit_pieces(self, binding: Binding, pieces: Sequence[tuple[Args, Kwargs]], layout: CallLayout,
                       deadline: Deadline, outputs_only: bool = False) -> Sequence[Any]:
        """Ship each piece's objects once and submit the call as its shares and the layout's selection
        (:class:`~rankmesh.backend.GroupCall`): nothing per rank on the controller.  ``outputs_only``:
        only the collect ranks' pendings will be kept (``GroupCall.outputs_only``)."""
        shipped = self._shipper(None)
        receive = self._receive or binding.method.receive
        blocking = binding.method.blocking
        shares = tuple(RankCall(-1, *shipped(pieces[piece]), collected, False, receive, 0, blocking)
                       for piece, collected in layout.shares)
        return self._executor.submit(binding.role, binding.target, GroupCall(shares, layout.selection, outputs_only),
                                     deadline)

    def _shipper(self, seen: ObservedCall | None) -> Callable[[tuple[Args, Kwargs]], tuple[Args, Kwargs]]:
        """``shipped(piece)``: ``piece`` with every distinct non-trivial object shipped once
        (``executor.share``) and replaced by its handle; the same piece object twice is shipped once."""
        shared: dict[int, Shared] = {}

        def ship(value: Any) -> Any:
            if isinstance(value, _INLINE_TYPES) or (isinstance(value, bytes) and len(value) <= INLINE_BYTES):
                return value
            handle = shared.get(id(value))
            if handle is None:
                handle = shared[id(value)] = self._executor.share(value)
                if seen is not None:
                    seen.shipped(value)
            return handle

        pieces: dict[int, tuple[Args, Kwargs]] = {}

        def shipped(piece: tuple[Args, Kwargs]) -> tuple[Args, Kwargs]:
            out = pieces.get(id(piece))
            if out is None:
                args, kwargs = piece
                out = pieces[id(piece)] = (tuple(ship(a) for a in args), {k: ship(v) for k, v in kwargs.items()})
            return out

        return shipped

    def _submit(
        self,
        binding: Binding,
        ranks: Sequence[int],
        per_rank: Sequence[tuple[Args, Kwargs]],
        collect: set[int],
        seen: ObservedCall | None = None,
        deadline: Deadline | None = None,
    ) -> list[Any]:
        """Ship every distinct non-trivial object once, then submit one RankCall per rank (bounded by ``deadline``).

        Observed (``seen``), every rank times itself (``RankCall.trace``); the observer says
        whether it sends its timing back with its output or keeps it under a key
        (``RankCall.keep``: a non-blocking call, whose outputs travel on inside a future).
        """
        shipped = self._shipper(seen)
        timed = seen is not None
        keep = 0 if seen is None else seen.timed(len(ranks))
        receive = self._receive or binding.method.receive
        blocking = binding.method.blocking
        calls = [
            RankCall(rank, *shipped(piece), rank in collect, timed, receive, keep, blocking)
            for rank, piece in zip(ranks, per_rank)
        ]
        if seen is None:
            return self._executor.submit(binding.role, binding.target, calls, deadline)
        seen.phase("put")
        pending = self._executor.submit(binding.role, binding.target, calls, deadline)
        seen.phase("submit")
        return pending

    def _watcher(self) -> CallObserver | None:
        """Who hears this group's calls: its own ``wg.trace`` recorder, else the program-wide one, else nobody."""
        return self._observer or TRACING.recorder

    def _observe(self, observer: CallObserver, binding: Binding, args: Args, kwargs: Kwargs) -> ObservedCall:
        """Tell ``observer`` a call of ``binding`` begins (a replica view's calls go on its group's tracks)."""
        return observer.begin(self, binding.name, binding.method.blocking, args, kwargs)

    def _group_ranks(self, ranks: Sequence[int]) -> Sequence[int]:
        """``ranks`` as the observer's tracks number them (the group's own ranks; a view maps its ranks)."""
        return ranks

    def _guarded(self, binding: Binding, run: Callable[[], Any]) -> Any:
        """Run one call of ``binding`` (``run``) under the group's failure policy; a backend may retry it."""
        return run()

    def _late_plan(self, spec: MeshSpec, site: CallSite) -> DispatchPlan:
        """The plan of a method whose mesh the table does not hold: verl's registered meshes."""
        return self._registered_plan(spec.mesh, site)

    def _registered_plan(self, mesh_name: str, site: CallSite) -> DispatchPlan:
        """verl's lazy dispatch info: ask every rank what it registered for ``mesh_name``."""
        plan = self._registered_plans.get(mesh_name)
        if plan is not None:
            return plan
        for query in ("_query_dispatch_info", "_query_collect_info"):
            if not callable(getattr(self.worker_cls, query, None)):
                raise site.error(f"mesh {mesh_name!r} is not declared on the group and {self.worker_cls.__name__} has no {query}")
        calls = [RankCall(r, (mesh_name,)) for r in range(self.world_size)]
        dp_ranks = self._executor.fetch(self._executor.submit(*self._table.route("_query_dispatch_info"), calls))
        is_collect = self._executor.fetch(self._executor.submit(*self._table.route("_query_collect_info"), calls))
        missing = [r for r, d in enumerate(dp_ranks) if d is None]
        if missing:
            raise site.error(
                f"mesh {mesh_name!r} is neither declared on the group (meshes=...) nor registered by ranks "
                f"{missing} (Worker._register_dispatch_collect_info)"
            )
        try:
            plan = DispatchPlan.from_dispatch_info(dp_ranks, is_collect)
        except DispatchError as exc:
            raise site.error(f"mesh {mesh_name!r}: {exc}") from exc
        self._registered_plans[mesh_name] = plan
        return plan

    # ----- verl's execute_* ----------------------------------------------------------------------

    def _adhoc_binding(self, method: str, execute: Execute, blocking: bool) -> Binding:
        key = (method, f"{execute.value}/{blocking}")
        binding = self._adhoc.get(key)
        if binding is None:
            if not isinstance(method, str) or not callable(getattr(self.worker_cls, method, None)):
                raise DispatchError(f"{self.worker_cls.__name__} has no method {method!r}")
            spec = MethodSpec(EXECUTE_ALL, execute, blocking)
            binding = self._adhoc[key] = self._table.resolve(method, spec, ())
        return binding

    def call_ranks(
        self,
        method: str,
        args: Sequence[Sequence[Any]],
        ranks: Sequence[int] | None = None,
        *,
        kwargs: Sequence[Mapping[str, Any]] | None = None,
        blocking: bool = True,
        timeout_s: float | None = None,
        stall_warn_s: float | None = None,
    ) -> Any:
        """Run worker method ``method`` on ``ranks`` (default: every rank), ``ranks[i]`` with ``*args[i], **kwargs[i]``.

        For calls no dispatch mode describes: a feature that computes each rank's arguments
        itself (a reshard's per-rank jobs) or talks to a few ranks only.  It takes the path every
        registered call takes (:meth:`_call`): arguments are shipped once each, the call is
        traced, bounded by ``timeout_s`` (``None``: the group's ``call_timeout_s``) with a hang
        report, warned about after ``stall_warn_s``, and on Ray a blocking call is retried once
        after replacing dead ranks when the group has ``on_rank_death="replace"``.

        ``method`` is a ``@register`` method (its inputs received as it declares) or any other
        method of the worker class.  Blocking: the outputs, in ``ranks`` order.
        ``blocking=False``: a :class:`GroupFuture` whose ``get()`` returns them and whose
        :attr:`~GroupFuture.handles` another group's call may take as an argument.
        """
        binding = self._rank_binding(method, blocking)
        site = binding.site
        ranks = tuple(range(self.world_size)) if ranks is None else tuple(ranks)
        bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world_size]
        if bad or not ranks:
            raise site.error(f"ranks must name ranks of this group (0..{self.world_size - 1}), got {list(ranks)}")
        if len(set(ranks)) != len(ranks):
            raise site.error(f"ranks {list(ranks)} name a rank twice; each rank runs one call")
        kwargs = [{}] * len(ranks) if kwargs is None else kwargs
        for what, given in (("args", args), ("kwargs", kwargs)):
            if not isinstance(given, (list, tuple)) or len(given) != len(ranks):
                got = f"{len(given)} items" if isinstance(given, (list, tuple)) else type(given).__name__
                raise site.error(f"{what} needs one entry per rank of {list(ranks)} ({len(ranks)}), got {got}")
        if not all(isinstance(a, (list, tuple)) for a in args) or not all(isinstance(k, Mapping) for k in kwargs):
            raise site.error("each entry of args must be a tuple of positional arguments and each of kwargs a dict")
        per_rank = [(tuple(a), dict(k)) for a, k in zip(args, kwargs)]
        return self._call(binding, (ranks, per_rank), {}, timeout_s, stall_warn_s)

    def _rank_binding(self, method: str, blocking: bool) -> Binding:
        """The binding of ``call_ranks(method, ...)``: the method's route and receive declaration, a PerRank entry."""
        key = (method, f"per_rank/{blocking}")
        binding = self._adhoc.get(key)
        if binding is None:
            bound = self._table.methods.get(method)
            if bound is None and (not isinstance(method, str) or not callable(getattr(self.worker_cls, method, None))):
                raise DispatchError(f"{self.worker_cls.__name__} has no method {method!r}")
            role, target = (bound.binding.role, bound.binding.target) if bound else self._table.route(method)
            receive = bound.binding.method.receive if bound else MethodSpec.receive  # @register's default
            spec = MethodSpec(EXECUTE_ALL, Execute.ALL, blocking, receive=receive)
            site = CallSite(f"{self.worker_cls.__name__}.{method}", (), "per rank")
            binding = self._adhoc[key] = Binding(method, spec, PerRank(), None, site, role, target)
        return binding

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method_name`` on every rank; arguments that are all world-size lists go rank by rank."""
        return self._call(self._adhoc_binding(method_name, Execute.ALL, True), args, kwargs)

    def execute_all_async(self, method_name: str, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._call(self._adhoc_binding(method_name, Execute.ALL, False), args, kwargs)

    def execute_rank_zero(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method_name`` on rank 0 with the arguments as given; return its output."""
        return self._call(self._adhoc_binding(method_name, Execute.RANK_ZERO, True), args, kwargs)

    def execute_rank_zero_async(self, method_name: str, *args: Any, **kwargs: Any) -> GroupFuture:
        return self._call(self._adhoc_binding(method_name, Execute.RANK_ZERO, False), args, kwargs)

    def set_receive(self, receive: str | None) -> None:
        """How this group's ranks receive their inputs, for every method (overrides ``@register(receive=...)``).

        ``"cow"``: copy-on-write views of the shared bytes; ``"copy"``: one private copy per rank
        up front (for workers that overwrite their input); ``None``: each method's declaration
        (``"cow"`` unless it says otherwise).  Role groups spawned later start from ``None``.
        """
        try:
            self._receive = check_receive(receive, "set_receive(receive)")
        except ValueError as exc:
            raise DispatchError(str(exc)) from None

    @property
    def receive(self) -> str | None:
        """The group-wide receive override (``None``: per method); see :meth:`set_receive`."""
        return self._receive

    def transport_info(self) -> list[dict[str, Any]]:
        """Per rank: which receive path its process takes and what receiving cost so far.

        Each entry has ``path`` (``"cow"``: inputs are copy-on-write views of the object store,
        ``"copy"``: private copies, ``"mixed"``, or ``"inline"`` while every input was small enough to
        travel inside the call, below the store's threshold),
        ``fallback`` (the first reason a copy was made), ``fd_source``, and byte counters.  The
        in-process backend shares one process, so its ranks report the same counters.
        ``control`` says how calls reach the rank (:meth:`rankmesh.backend.Backend.control_paths`):
        ``"session"`` for blocking calls with inline arguments through a call session, else
        ``"ray"`` (one task per rank) or ``"in-process"``.
        """
        infos = self.execute_all_sync("rankmesh_transport_info")  # waits on every group (verl's execute_all does not)
        return [{**info, "control": path} for info, path in zip(infos, self._executor.control_paths())]

    execute_all_sync = execute_all
    execute_rank_zero_sync = execute_rank_zero


class ReplicaGroup(WorkerGroup):
    """``wg.replicas([...])``: a worker group restricted to some of its dp replicas (see :meth:`WorkerGroup.replicas`).

    A view: it runs on the group's processes through :class:`~rankmesh.replicas.RankSubset`
    and lives as long as the group; shutting a view down is refused.  Methods on the group's
    default mesh are planned for the view's mesh; methods on a named mesh, or on a mesh the
    workers registered (verl), take the group's plan restricted to the view's ranks, which must
    hold a collect rank of every data piece they touch.
    """

    def __init__(self, group: WorkerGroup, selection: ReplicaSelection) -> None:
        self._group, self._selection = group, selection
        table = MethodTable.build(
            group.worker_cls, len(selection.ranks), selection.mesh, None, group.role, group.registry, type(self), late_meshes=True
        )
        self._install(RankSubset(group.executor, selection), table)
        self._late_plans: dict[str, DispatchPlan] = {}  # call site -> its plan over the view

    @property
    def group(self) -> WorkerGroup:
        """The whole group this view selects from."""
        return self._group

    @property
    def selection(self) -> ReplicaSelection:
        """Which replicas, which group ranks (view rank ``i`` is group rank ``selection.ranks[i]``)."""
        return self._selection

    @property
    def trace_name(self) -> str:
        return f"{self._group.trace_name} [{self._selection.label}]"

    @property
    def weight_versions(self) -> tuple[int, ...]:
        self._executor.check_current("weight_versions")
        versions = self._group.weight_versions
        return tuple(versions[i] for i in self._selection.replicas)

    def record_weight_version(self, replica: int, version: int) -> None:
        self._executor.check_current("record a weight version")
        self._group.record_weight_version(replica, version)

    def _own_replicas(self) -> Sequence[int]:
        return self._selection.replicas

    @property
    def node_labels(self) -> list[str]:
        labels = self._group.node_labels
        return [labels[r] for r in self._selection.ranks]

    @property
    def ranks_run_at_once(self) -> bool:
        return self._group.ranks_run_at_once

    @property
    def node_info(self) -> list[dict[str, Any]] | None:
        """The group's entries of the view's ranks (a reshard into a view reads same-node ranks directly)."""
        info = self._group.node_info
        return None if info is None else [info[r] for r in self._selection.ranks]

    def __repr__(self) -> str:
        return f"{self._group!r}.replicas({list(self._selection.replicas)})"

    def shutdown(self) -> None:
        raise DispatchError(f"{self!r} is a view of its group; shut the group down instead")

    def replicas(self, indices: Sequence[int]) -> "ReplicaGroup":
        """Some of this view's replicas (``indices`` count in the view): a view of the group itself."""
        if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence):
            raise DispatchError(f"replicas(indices) takes a list of dp replica ids, got {type(indices).__name__}")
        chosen = select_replicas(self.mesh, indices, "replicas(indices)").replicas
        return self._group.replicas([self._selection.replicas[i] for i in chosen])

    @contextmanager
    def trace(self, path: str | os.PathLike[str]) -> Iterator[Recorder]:
        raise DispatchError(f"{self!r} is a view: trace its group (with wg.trace(path): ...), whose tracks its calls go on")
        yield  # pragma: no cover - a generator, so that the error comes at `with`

    def _watcher(self) -> CallObserver | None:
        return self._group._watcher()

    def _call(
        self, binding: Binding, args: Args, kwargs: Kwargs, timeout: float | None = None, stall_warn_s: float | None = None
    ) -> Any:
        # The group's failure policy (on Ray: replace dead ranks, retry once) covers a view's calls.
        return self._group._guarded(binding, lambda: super(ReplicaGroup, self)._call(binding, args, kwargs, timeout, stall_warn_s))

    def _observe(self, observer: CallObserver, binding: Binding, args: Args, kwargs: Kwargs) -> ObservedCall:
        name = f"{binding.name} [{self._selection.label}]"
        return observer.begin(self._group, name, binding.method.blocking, args, kwargs)

    def _group_ranks(self, ranks: Sequence[int]) -> Sequence[int]:
        return [self._selection.ranks[r] for r in ranks]

    def _late_plan(self, spec: MeshSpec, site: CallSite) -> DispatchPlan:
        key = f"{site.method} ({site.mode})"
        plan = self._late_plans.get(key)
        if plan is None:
            meshes = self._group.meshes
            whole = spec.plan(meshes[spec.mesh]) if spec.mesh in meshes else self._group._late_plan(spec, site)
            plan = self._late_plans[key] = restrict_plan(whole, self._selection, site)
        return plan
