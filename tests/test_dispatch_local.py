"""The backend-neutral dispatch matrix on the in-process backend, plus in-process-only checks."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rankmesh.backend import GroupCall
from rankmesh.backends.local import LocalExecutor, LocalWorkerGroup, fetch_local
from rankmesh.data import DataProtoFuture
from rankmesh.dispatch import Dispatch, DispatchRegistry, Execute, MeshSpec, register
from rankmesh.errors import DispatchError, WorkerError
from rankmesh.group import WorkerGroup
from rankmesh.mesh import RankMesh
from rankmesh.worker import Worker, WorkerContext
from tests.dispatch_matrix import *  # noqa: F401,F403  (the backend-neutral suite)
from tests.dispatch_workers import RecordingWorker, make_batch, rows_of


@pytest.fixture
def group_factory():
    def make(worker_cls, mesh=None, *, meshes=None, init_args=(), init_kwargs=None):
        return LocalWorkerGroup(worker_cls, mesh=mesh, meshes=meshes, init_args=init_args, init_kwargs=init_kwargs)

    return make


class CountingExecutor:
    """Wraps a LocalExecutor and records every share, call and fetch."""

    def __init__(self, inner: LocalExecutor) -> None:
        self.inner, self.world_size = inner, inner.world_size
        self.shared: list[object] = []
        self.calls: list[list] = []
        self.fetched: list[list] = []

    def share(self, obj):
        self.shared.append(obj)
        return self.inner.share(obj)

    def submit(self, role, method, calls, deadline=None):
        self.calls.append(calls.rank_calls() if isinstance(calls, GroupCall) else list(calls))
        return self.inner.submit(role, method, calls, deadline)

    call_timeout_s = None
    closed = False
    failed = None
    generation = 0

    def changes_since(self, generation):
        return []

    def close(self):
        self.inner.close()

    def drain_timings(self):
        return self.inner.drain_timings()

    def fetch(self, pending, timeout=None, borrow=False, stall_warn_s=None, deadline=None):
        return self.inner.fetch(pending, timeout, borrow, stall_warn_s, deadline)

    def fetcher(self, timeout=None, stall_warn_s=None):
        fetched = self.fetched

        def counting_fetch(handles):
            fetched.append([h.rank for h in handles])
            return fetch_local(handles)

        return counting_fetch


def counting_group(worker_cls, mesh, **kw):
    contexts = [WorkerContext(rank=r, world_size=mesh.world_size, mesh=mesh) for r in range(mesh.world_size)]
    executor = CountingExecutor(LocalExecutor.start(worker_cls, contexts))
    return WorkerGroup(executor, worker_cls, mesh=mesh, **kw), executor


def test_share_counts_and_return_output():
    wg, ex = counting_group(RecordingWorker, RankMesh(tp=2, cp=2, dp=2, pp=2))
    batch = make_batch(4)
    wg.one_to_all(batch)
    assert len(ex.shared) == 1 and len(ex.calls[-1]) == 16
    ex.shared.clear()
    wg.megatron_compute_proto(batch)
    assert len(ex.shared) == 2  # one per dp piece, not one per rank
    assert [c.rank for c in ex.calls[-1] if c.return_output] == [8, 12]
    ex.shared.clear()
    wg.one_to_all(3)  # small scalars travel inline
    assert ex.shared == []


def test_future_consumers_fetch_only_their_parts():
    producer, pex = counting_group(RecordingWorker, RankMesh(dp=4))
    fut = producer.dp_compute_proto_nb(make_batch(8))
    consumer = LocalWorkerGroup(RecordingWorker, RankMesh(dp=2))
    consumer.megatron_compute_proto(fut)
    assert pex.fetched == [[0, 1], [2, 3]]  # one fetch per consumer rank, only its two parts


def test_ranks_run_in_order_in_the_calling_thread():
    class Where(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def where(self):
            return self.rank, threading.get_ident()

    out = LocalWorkerGroup(Where, world_size=3).where()
    assert out == [(r, threading.get_ident()) for r in range(3)]


def test_worker_error_keeps_the_cause():
    wg = LocalWorkerGroup(RecordingWorker, RankMesh(tp=2, dp=2))
    with pytest.raises(WorkerError) as info:
        wg.fail_on_rank(make_batch(4))
    assert isinstance(info.value.__cause__, ValueError)
    assert "rank 1 (tp1 dp0) on node" in str(info.value)  # one rank label everywhere (RankCoords.label)


def test_constructor_failure_names_the_rank():
    class Bad(Worker):
        def __init__(self):
            if self.rank == 2:
                raise RuntimeError("no GPU")

    with pytest.raises(WorkerError, match=r"rank 2 .*Bad.__init__.*no GPU"):
        LocalWorkerGroup(Bad, world_size=4)


def test_async_method_from_a_running_event_loop():
    wg = LocalWorkerGroup(RecordingWorker, RankMesh(dp=2))

    async def controller():
        return wg.async_echo(make_batch(2)), wg.loop_id()

    out, loops = asyncio.run(controller())
    assert out.batch["rank"].tolist() == [0, 1] and len(loops) == 2


# ----- registry and modes ---------------------------------------------------------------------------


def test_dispatch_is_extensible_at_runtime():
    from rankmesh.dispatch import DEFAULT_REGISTRY, register_dispatch_mode

    def dispatch(wg, *args, **kwargs):
        return tuple([a] * wg.world_size for a in args), {}

    def collect(wg, outputs):
        return len(outputs)

    mode = register_dispatch_mode("TEST_LOCAL_COUNT", dispatch, collect)
    try:
        assert Dispatch.TEST_LOCAL_COUNT == mode and mode in Dispatch and Dispatch["TEST_LOCAL_COUNT"] == mode
        with pytest.raises(DispatchError, match="already exists"):
            register_dispatch_mode("TEST_LOCAL_COUNT", dispatch, collect)

        class Counting(Worker):
            @register(Dispatch.TEST_LOCAL_COUNT)
            def run(self, x):
                return x

        assert LocalWorkerGroup(Counting, world_size=3).run(1) == 3
    finally:
        DEFAULT_REGISTRY.remove("TEST_LOCAL_COUNT")
    with pytest.raises(AttributeError, match="TEST_LOCAL_COUNT"):
        Dispatch.TEST_LOCAL_COUNT  # noqa: B018
    with pytest.raises(DispatchError, match="NOPE"):
        Dispatch.from_name("NOPE")


def test_update_dispatch_mode_on_a_private_registry():
    registry = DispatchRegistry()
    registry.update_dispatch_mode(Dispatch.ONE_TO_ALL, lambda wg, x: (([x * 2] * wg.world_size,), {}), lambda wg, o: o[0])
    with pytest.raises(DispatchError, match="unknown dispatch mode"):
        registry.update_dispatch_mode("NOT_THERE", lambda wg: ((), {}), lambda wg, o: o)

    class W(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def echo(self, x):
            return x

    contexts = [WorkerContext(rank=r, world_size=2, mesh=RankMesh(dp=2)) for r in range(2)]
    private = WorkerGroup(LocalExecutor.start(W, contexts), W, registry=registry)
    assert private.echo(5) == 10
    assert LocalWorkerGroup(W, world_size=2).echo(5) == [5, 5]  # the default registry is untouched


def test_register_stores_a_frozen_spec():
    from dataclasses import FrozenInstanceError

    from rankmesh.dispatch import MethodSpec, UserMode

    spec = RecordingWorker.megatron_compute_proto.__rankmesh_register__
    assert isinstance(spec, MethodSpec) and spec.dispatch_mode == Dispatch.MEGATRON_COMPUTE_PROTO
    with pytest.raises(FrozenInstanceError):
        spec.blocking = False
    assert isinstance(RecordingWorker.user_dict.__rankmesh_register__.dispatch_mode, UserMode)
    with pytest.raises(DispatchError, match="collect_fn"):
        register({"dispatch_fn": print})


def test_bad_modes_fail_when_the_group_binds():
    class Unknown(Worker):
        @register("NO_SUCH_MODE")
        def f(self):
            pass

    with pytest.raises(DispatchError, match=r"Unknown.f.*NO_SUCH_MODE"):
        LocalWorkerGroup(Unknown, world_size=2)

    class RankZeroSplit(Worker):
        @register(Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO)
        def f(self, data):
            pass

    with pytest.raises(DispatchError, match="RANK_ZERO"):
        LocalWorkerGroup(RankZeroSplit, world_size=2)

    class MissingMesh(Worker):
        @register(Dispatch.named("rollout", collect={"tp": 0}))
        def f(self, data):
            pass

    with pytest.raises(DispatchError, match="rollout"):
        LocalWorkerGroup(MissingMesh, world_size=2)

    class Clash(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def execute_all(self):
            pass

    with pytest.raises(DispatchError, match="clashes"):
        LocalWorkerGroup(Clash, world_size=2)


def test_unregistered_nd_mesh_is_a_clear_error():
    from rankmesh.dispatch import make_nd_compute_dataproto_dispatch_fn

    class Forgot(Worker):
        @register(make_nd_compute_dataproto_dispatch_fn("actor"))
        def f(self, data):
            return data

    wg = LocalWorkerGroup(Forgot, world_size=2)
    with pytest.raises(DispatchError, match=r"'actor'.*_register_dispatch_collect_info"):
        wg.f(make_batch(2))


def test_meshes_must_cover_the_same_ranks():
    with pytest.raises(DispatchError, match="rollout"):
        LocalWorkerGroup(RecordingWorker, RankMesh(dp=4), meshes={"rollout": RankMesh(tp=2)})
    with pytest.raises(DispatchError, match="world_size=3"):
        LocalWorkerGroup(RecordingWorker, RankMesh(dp=4), world_size=3)


# ----- specs and plans ------------------------------------------------------------------------------


def test_spec_validation():
    with pytest.raises(DispatchError, match="unknown axis 'xp'"):
        MeshSpec(split=("xp",))
    with pytest.raises(DispatchError, match="'rank'"):
        MeshSpec(split=("rank", "dp"))
    with pytest.raises(DispatchError, match="twice"):
        MeshSpec(split=("dp", "dp"))
    with pytest.raises(DispatchError, match="integer"):
        MeshSpec(collect={"tp": "0"})
    with pytest.raises(DispatchError, match="proto=True"):
        MeshSpec(split=("dp",), output="concat")
    with pytest.raises(DispatchError, match="out of range"):
        MeshSpec(collect={"tp": 2}).plan(RankMesh(tp=2))
    with pytest.raises(DispatchError, match="one collected rank per piece"):
        MeshSpec(split=("dp",), collect={"tp": 0}, proto=True).plan(RankMesh(tp=2, pp=2, dp=2))
    with pytest.raises(DispatchError, match="exactly one collected rank"):
        MeshSpec(collect={"tp": 0}, output="single").plan(RankMesh(tp=2, dp=2))


def test_plans_by_hand():
    # tp2·pp2·dp2, rank = tp + 2*dp + 4*pp
    mesh = RankMesh(tp=2, pp=2, dp=2)
    plan = MeshSpec(split=("pp", "dp"), collect={"tp": -1}).plan(mesh)
    # piece = pp*2 + dp: ranks 0,1 -> 0; 2,3 -> 1; 4,5 -> 2; 6,7 -> 3; tp==1 ranks by piece
    assert plan.n_pieces == 4
    assert plan.piece_of_rank == (0, 0, 1, 1, 2, 2, 3, 3)
    assert plan.collect_ranks == (1, 3, 5, 7)
    assert MeshSpec(collect={"rank": 5}, run="collect", output="single").plan(mesh).run_ranks == (5,)


def test_standalone_worker_and_invoke():
    from rankmesh.worker import invoke

    w = RecordingWorker()
    assert (w.rank, w.world_size) == (0, 1)
    assert invoke(w, "one_to_all", ("a",)) == (0, "a")
    assert invoke(w, "one_to_all", ("b",), return_output=False) is None
    with pytest.raises(WorkerError, match="nope"):
        invoke(w, "nope")


def test_register_wrapper_materializes_futures_on_direct_calls():
    batch = make_batch(3)
    fut = DataProtoFuture.from_parts([batch], lambda handles: list(handles), rows=[3])
    w = RecordingWorker()
    assert rows_of(w.dp_compute_proto(fut)) == [0, 1, 2]
    assert w.peek_future(fut)["parts"] == 1  # materialize_futures=False keeps the future


class HalfRegistered(Worker):
    """One registered method and one plain one (the first hour's mistake: a method without @register)."""

    @register(Dispatch.ONE_TO_ALL)
    def compute(self, x):
        return x

    def plain(self, x):
        return x + 1


def test_an_unregistered_method_says_to_register_it_and_lists_the_registered_ones():
    import copy
    import pickle

    from rankmesh.errors import GroupAttributeError, RankMeshError

    wg = LocalWorkerGroup(HalfRegistered, world_size=2)
    with pytest.raises(AttributeError) as info:
        wg.plain  # noqa: B018
    text = str(info.value)
    assert isinstance(info.value, (GroupAttributeError, RankMeshError)), type(info.value)
    assert "HalfRegistered defines plain but it is not registered" in text, text
    assert "@register(...)" in text and "wg.call_ranks('plain'" in text, text
    assert "registered methods: compute" in text, text
    assert wg.call_ranks("plain", [(1,), (2,)]) == [2, 3]  # the way the message offers works

    with pytest.raises(AttributeError) as info:
        wg.compte  # noqa: B018  (a typo of a registered method)
    text = str(info.value)
    assert "'LocalWorkerGroup' object has no attribute 'compte'" in text and "registered methods: compute" in text, text
    assert "did you mean 'compute'" in text, text
    # The timeout view reaches the same error; hasattr and getattr's default still work.
    with pytest.raises(AttributeError, match="not registered"):
        wg.with_timeout(5).plain  # noqa: B018
    assert not hasattr(wg, "plain") and getattr(wg, "nope", 7) == 7

    # Copying and pickling look dunder names up before any state exists: no recursion, no message building.
    bare = object.__new__(LocalWorkerGroup)
    with pytest.raises(AttributeError):
        bare.plain  # noqa: B018
    with pytest.raises(AttributeError):
        bare.__setstate__x  # noqa: B018
    assert copy.copy(wg).compute(3) == [3, 3]
    assert pickle.loads(pickle.dumps(wg)).compute(4) == [4, 4]


def test_every_backend_group_takes_the_one_attribute_error():
    """RayWorkerGroup gets the message by the shared code path, not by a Ray test: it defines no lookup of its own."""
    pytest.importorskip("ray")
    from rankmesh.backends.ray.group import RayWorkerGroup
    from rankmesh.group import ReplicaGroup

    for cls in (LocalWorkerGroup, RayWorkerGroup, ReplicaGroup):
        assert issubclass(cls, WorkerGroup) and cls.__getattr__ is WorkerGroup.__getattr__, cls


def test_a_mode_string_that_can_never_name_a_mode_is_refused_at_decoration():
    for bad in ("DP-COMPUTE-PROTO", "dp compute proto", ""):
        with pytest.raises(DispatchError) as info:
            register(dispatch_mode=bad)
        text = str(info.value)
        assert f"dispatch_mode={bad!r}" in text and "DP_COMPUTE_PROTO" in text and "ONE_TO_ALL" in text, text


def test_a_mistyped_mode_name_fails_once_at_group_construction():
    class Typo(Worker):
        @register(dispatch_mode="DP_COMPUTE_PROT")  # an identifier: it could still be registered later
        def f(self, data):
            return data

    with pytest.raises(DispatchError) as info:
        LocalWorkerGroup(Typo, world_size=2)
    text = str(info.value)
    assert "Typo.f" in text and "'DP_COMPUTE_PROT'" in text and "did you mean 'DP_COMPUTE_PROTO'" in text, text
    assert "registered: ONE_TO_ALL" in text, text
    assert info.value.__cause__ is None and info.value.__suppress_context__, "one error, not a chained pair"

    # Why such a name is not refused at decoration: a registry may learn it after the class is defined.
    registry = DispatchRegistry()
    registry.register_dispatch_mode("DP_COMPUTE_PROT", lambda wg, x: (([x] * wg.world_size,), {}), lambda wg, o: o)
    contexts = [WorkerContext(rank=r, world_size=2, mesh=RankMesh(dp=2)) for r in range(2)]
    assert WorkerGroup(LocalExecutor.start(Typo, contexts), Typo, registry=registry).f(9) == [9, 9]


class _NoBatches(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> int:
        return self.rank

    @register(Dispatch.DP_COMPUTE)
    def scores(self, value: int) -> int:
        return value


class _TakesBatches(_NoBatches):
    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def compute(self, data):
        return data


def test_only_groups_that_take_batches_import_tensordict_as_they_start():
    # What a rank imports before its workers are built (the Ray backend's HostSetup.preload):
    # tensordict for a proto mode or a user mode (which may send anything), nothing otherwise.
    from rankmesh.binding import MethodTable

    registry = DispatchRegistry()
    user = registry.register_dispatch_mode("ANY_ROWS", lambda wg, *a, **k: (a, k), lambda wg, out: out)

    class _UserMode(_NoBatches):
        @register(user)
        def custom(self, x):
            return x

    assert MethodTable.build(_NoBatches, 4).preload == ()
    assert MethodTable.build(_TakesBatches, 4, RankMesh(tp=2, dp=2)).preload == ("tensordict",)
    assert MethodTable.build(_UserMode, 4, registry=registry).preload == ("tensordict",)
