"""Backend-neutral dispatch tests: every mode, routing tables, round trips, isolation, errors.

How a backend runs this suite: in its own ``tests/test_dispatch_<backend>.py``::

    from tests.dispatch_matrix import *  # noqa: F401,F403  -- pytest collects the tests below

    @pytest.fixture
    def group_factory():
        def make(worker_cls, mesh=None, *, meshes=None, init_args=(), init_kwargs=None):
            return MyWorkerGroup(worker_cls, mesh=mesh, meshes=meshes,
                                 init_args=init_args, init_kwargs=init_kwargs)
        return make

Every test takes ``group_factory`` and nothing else from the backend.  Worker classes live in
``tests/dispatch_workers.py`` (importable by remote workers).  Tests drain the workers' logs
before using them and depend on no other worker state, so a factory may cache one group per
``(worker_cls, mesh, meshes, init_args, init_kwargs)``.

The routing tables below are derived by hand, not by rankmesh.  With megatron's default order
(tp fastest, then cp, dp, pp) ``rank = tp + 2*cp + 4*dp + 8*pp`` on tp2·cp2·dp2·pp2,
``rank = tp + 2*dp + 4*pp`` on tp2·dp2·pp2, and ``rank = tp + 2*pp + 4*dp`` with order tp-pp-dp.
"""

from __future__ import annotations

import pytest
import torch

from rankmesh.data import AUTO_PADDING_KEY, DataProto, DataProtoFuture
from rankmesh.errors import DispatchError, PaddingError, WorkerError
from rankmesh.mesh import RankMesh
from tests.dispatch_workers import (
    NamedMeshWorker,
    NoSuperWorker,
    RecordingWorker,
    RegisteringWorker,
    make_batch,
    plus_one_hundred,
    rows_of,
)

MESHES = {
    "tp2cp2dp2pp2": RankMesh(tp=2, cp=2, dp=2, pp=2),
    "tp2dp2pp2": RankMesh(tp=2, dp=2, pp=2),
    "tp2dp2pp2-order-tp-pp-dp": RankMesh(tp=2, dp=2, pp=2, order="tp-pp-dp"),
    "dp4": RankMesh(dp=4),
}

# mode -> (piece index of each rank, collected ranks in output order)
TABLES = {
    "tp2cp2dp2pp2": {
        # piece = dp
        "megatron": ([0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], [8, 12]),
        # piece = (cp*2 + dp)*2 + pp; collected: every tp==0 rank, by piece
        "pp_as_dp": ([0, 0, 4, 4, 2, 2, 6, 6, 1, 1, 5, 5, 3, 3, 7, 7], [0, 8, 4, 12, 2, 10, 6, 14]),
        "pp_only": [0, 8],
    },
    "tp2dp2pp2": {
        "megatron": ([0, 0, 1, 1, 0, 0, 1, 1], [4, 6]),
        "pp_as_dp": ([0, 0, 2, 2, 1, 1, 3, 3], [0, 4, 2, 6]),
        "pp_only": [0, 4],
    },
    "tp2dp2pp2-order-tp-pp-dp": {
        "megatron": ([0, 0, 0, 0, 1, 1, 1, 1], [2, 6]),
        "pp_as_dp": ([0, 0, 1, 1, 2, 2, 3, 3], [0, 2, 4, 6]),
        "pp_only": [0, 2],
    },
    "dp4": {
        "megatron": ([0, 1, 2, 3], [0, 1, 2, 3]),
        "pp_as_dp": ([0, 1, 2, 3], [0, 1, 2, 3]),
        "pp_only": [0],
    },
}

PROTO_METHODS = {"dp_compute_proto": "dp", "megatron_compute_proto": "megatron", "megatron_pp_as_dp_proto": "pp_as_dp"}
LIST_METHODS = {"dp_compute": "dp", "megatron_compute": "megatron", "megatron_pp_as_dp": "pp_as_dp"}


def table(mesh_name: str, kind: str) -> tuple[list[int], list[int]]:
    world = MESHES[mesh_name].world_size
    if kind == "dp":  # DP_COMPUTE*: one piece per rank, every rank collected
        return list(range(world)), list(range(world))
    return TABLES[mesh_name][kind]


def fresh(group_factory, worker_cls=RecordingWorker, mesh=None, **kw):
    wg = group_factory(worker_cls, mesh, **kw)
    wg.take_log()
    return wg


def two_rows_each(pieces: list[int]) -> list[list[tuple]]:
    return [[(("proto", [2 * p, 2 * p + 1]),)] for p in pieces]


def assert_same_rows(out: DataProto, batch: DataProto) -> None:
    assert len(out) == len(batch)
    assert torch.equal(out.batch["x"], batch.batch["x"])
    assert torch.equal(out.batch["y"], batch.batch["y"])
    assert out.non_tensor_batch["name"].tolist() == batch.non_tensor_batch["name"].tolist()
    assert out.meta_info["step"] == batch.meta_info["step"]


# ----- routing: who gets which rows, whose outputs come back ----------------------------------


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("method", list(PROTO_METHODS))
def test_proto_mode_routing(group_factory, mesh_name, method):
    pieces, collect = table(mesh_name, PROTO_METHODS[method])
    wg = fresh(group_factory, mesh=MESHES[mesh_name])
    batch = make_batch(2 * (max(pieces) + 1))
    out = getattr(wg, method)(batch)
    assert rows_of(out) == list(range(len(batch)))
    assert out.batch["rank"].tolist() == [r for r in collect for _ in range(2)]
    assert wg.take_log() == two_rows_each(pieces)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("method", list(LIST_METHODS))
def test_list_mode_routing(group_factory, mesh_name, method):
    pieces, collect = table(mesh_name, LIST_METHODS[method])
    wg = fresh(group_factory, mesh=MESHES[mesh_name])
    items = [f"item{i}" for i in range(max(pieces) + 1)]
    assert getattr(wg, method)(items) == [(r, f"item{pieces[r]}") for r in collect]
    assert wg.take_log() == [[(f"item{p}",)] for p in pieces]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_replicated_modes(group_factory, mesh_name):
    wg = fresh(group_factory, mesh=MESHES[mesh_name])
    world = MESHES[mesh_name].world_size
    assert wg.one_to_all("same") == [(r, "same") for r in range(world)]
    assert wg.take_log() == [[("same",)]] * world
    assert wg.megatron_pp_only("same") == [(r, "same") for r in TABLES[mesh_name]["pp_only"]]
    assert wg.take_log() == [[("same",)]] * world
    assert wg.rank_zero("only") == (0, "only")
    assert wg.take_log() == [[("only",)]] + [[]] * (world - 1)


def test_execute_rank_zero_mode(group_factory):
    wg = fresh(group_factory, mesh=MESHES["tp2dp2pp2"])
    assert wg.one_to_all_on_rank_zero("v") == (0, "v")
    assert wg.take_log() == [[("v",)]] + [[]] * 7


def test_all_to_all(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    assert wg.all_to_all(["a", "b", "c", "d"]) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert wg.take_log() == [[("a",)], [("b",)], [("c",)], [("d",)]]
    # verl's rule: unless every argument is a world-size list, every rank gets the arguments whole
    assert wg.all_to_all(["a", "b", "c", "d"], y=5) == [(r, ["a", "b", "c", "d"], 5) for r in range(4)]
    assert wg.all_to_all("x") == [(r, "x") for r in range(4)]
    wg.take_log()


def test_dp_compute_metric_is_never_trimmed(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    expected = [{"rank": r, "rows": [2 * r, 2 * r + 1]} for r in range(4)]
    assert wg.dp_compute_metric(make_batch(8)) == expected
    assert wg.dp_compute_metric_nb(make_batch(8)).get() == expected
    # 6 rows padded to 8 (pad rows repeat rows 0, 1): still one entry per rank (verl dropped two)
    assert wg.dp_compute_metric_pad(make_batch(6)) == [
        {"rank": 0, "rows": [0, 1]},
        {"rank": 1, "rows": [2, 3]},
        {"rank": 2, "rows": [4, 5]},
        {"rank": 3, "rows": [0, 1]},
    ]


def test_dp_compute_proto_with_func(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    out = wg.dp_compute_proto_with_func(plus_one_hundred, make_batch(4))
    assert rows_of(out) == [100, 101, 102, 103]
    assert out.batch["rank"].tolist() == [0, 1, 2, 3]
    assert wg.take_log() == [[(("func", "plus_one_hundred"), ("proto", [r]))] for r in range(4)]


def test_spec_over_pp_axis(group_factory):
    wg = fresh(group_factory, mesh=MESHES["tp2dp2pp2"])
    # MeshSpec(split=("pp",), collect tp0/dp0/cp0): stage s gets item s; outputs of ranks 0 and 4
    assert wg.spec_pp_stages(["s0", "s1"]) == [(0, "s0"), (4, "s1")]
    assert wg.take_log() == [[("s0",)]] * 4 + [[("s1",)]] * 4


# ----- round trips: padding, blocking and not ---------------------------------------------------

ROUND_TRIP = [
    # (method, blocking, rows on tp2·dp2·pp2 (dp=2, pp·dp=4, world 8), batch meta)
    ("dp_compute_proto", True, 16, {}),
    ("dp_compute_proto_nb", False, 16, {}),
    ("dp_compute_proto_pad", True, 13, {}),
    ("megatron_compute_proto", True, 6, {}),
    ("megatron_compute_proto_nb", False, 6, {}),
    ("megatron_compute_proto_pad", True, 7, {}),
    ("megatron_compute_proto_pad_nb", False, 7, {}),
    ("megatron_compute_proto", True, 5, {AUTO_PADDING_KEY: True}),
    ("megatron_compute_proto_nb", False, 5, {AUTO_PADDING_KEY: True}),
    ("megatron_pp_as_dp_proto", True, 8, {}),
    ("megatron_pp_as_dp_proto_nb", False, 8, {}),
    ("megatron_pp_as_dp_proto_pad", True, 3, {}),
    ("megatron_pp_as_dp_proto_nb", False, 1, {AUTO_PADDING_KEY: True}),
    ("async_echo", True, 4, {}),
]


@pytest.mark.parametrize("method,blocking,rows,meta", ROUND_TRIP)
def test_round_trip(group_factory, method, blocking, rows, meta):
    wg = fresh(group_factory, mesh=MESHES["tp2dp2pp2"])
    batch = make_batch(rows, **meta)
    before = (batch.batch["x"].clone(), dict(batch.meta_info), len(batch))
    out = getattr(wg, method)(batch)
    if not blocking:
        assert isinstance(out, DataProtoFuture)
        assert len(out) == rows  # the window excludes pad rows, known before fetching
        out = out.get()
    assert_same_rows(out, batch)
    assert torch.equal(batch.batch["x"], before[0]) and batch.meta_info == before[1] and len(batch) == before[2]
    wg.take_log()


def test_round_trip_all_ranks(group_factory):
    wg = fresh(group_factory, mesh=MESHES["tp2cp2dp2pp2"])
    batch = make_batch(11, **{AUTO_PADDING_KEY: True})
    for method in ("dp_compute_proto", "megatron_compute_proto", "megatron_pp_as_dp_proto"):
        assert_same_rows(getattr(wg, method)(batch), batch)
    wg.take_log()


def test_padding_error_names_size_and_divisor(group_factory):
    wg = fresh(group_factory, mesh=MESHES["tp2dp2pp2"])
    batch = make_batch(5)
    with pytest.raises(PaddingError, match=r"5 rows.*2 pieces"):
        wg.megatron_compute_proto(batch)
    with pytest.raises(PaddingError):  # padding=False wins over the batch's own flag
        wg.megatron_compute_proto_nopad(make_batch(5, **{AUTO_PADDING_KEY: True}))
    assert len(batch) == 5 and wg.take_log() == [[]] * 8


def test_nonblocking_list_outputs(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    fut = wg.one_to_all_nb("q")
    assert fut.get() == [(r, "q") for r in range(4)]
    assert fut.get() == [(r, "q") for r in range(4)]
    wg.take_log()


# ----- isolation -------------------------------------------------------------------------------


def test_isolation_between_ranks_and_caller(group_factory):
    wg = fresh(group_factory, mesh=MESHES["tp2dp2pp2"])
    t = torch.zeros(3)
    assert [o.tolist() for o in wg.mutate_tensor(t)] == [[1.0, 1.0, 1.0]] * 8
    assert t.tolist() == [0.0, 0.0, 0.0]
    batch = make_batch(8)
    out = wg.mutate_batch(batch)
    assert rows_of(out) == [1000 + i for i in range(8)]
    assert rows_of(batch) == list(range(8)) and "touched" not in batch.meta_info


def test_future_results_are_private_copies(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    fut = wg.dp_compute_proto_nb(make_batch(4))
    part = fut.slice_rows(0, 1)  # one part: get() returns it without a concatenating copy
    first = part.get()
    first.batch["x"] += 1
    assert rows_of(part.get()) == [0] and rows_of(fut.get()) == [0, 1, 2, 3]
    wg.take_log()


# ----- binding, workers, modes -------------------------------------------------------------------


def test_method_keeps_name_doc_signature(group_factory):
    import inspect

    wg = fresh(group_factory, mesh=MESHES["dp4"])
    assert wg.compute.__name__ == "compute"
    assert "doubles y" in wg.compute.__doc__
    params = inspect.signature(wg.compute).parameters
    assert list(params) == ["data", "scale"] and params["scale"].default == 1.0
    assert list(inspect.signature(wg.take_log).parameters) == []
    out = wg.compute(make_batch(4))
    assert out.batch["y"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_worker_context(group_factory):
    wg = fresh(group_factory, mesh=MESHES["tp2dp2pp2"])
    info = wg.identity()
    assert [i["rank"] for i in info] == list(range(8))
    assert [i["init_rank"] for i in info] == list(range(8))  # visible inside __init__
    assert {i["world"] for i in info} == {8}
    # rank = tp + 2*dp + 4*pp
    assert [(i["info"].tp_rank, i["info"].dp_rank, i["info"].pp_rank) for i in info] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1),
    ]
    assert info[0]["meshes"] == ["default"]
    assert group_factory(NoSuperWorker, RankMesh(dp=2), init_kwargs={"offset": 10}).value_of() == [10, 11]


def test_user_modes(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    # TEST_REVERSED: rank r gets item 3 - r; collect sorts by item
    assert wg.user_reversed(["a", "b", "c", "d"]) == [(3, "a"), (2, "b"), (1, "c"), (0, "d")]
    assert wg.take_log() == [[("d",)], [("c",)], [("b",)], [("a",)]]
    # dict form: every rank gets the first half of the batch
    assert wg.user_dict(make_batch(6)) == [(r, [0, 1, 2]) for r in range(4)]
    wg.take_log()


def test_named_mesh_modes(group_factory):
    # rollout mesh tp4·dp2: rank = tp + 4*dp -> pieces [0,0,0,0,1,1,1,1], tp==0 ranks 0 and 4
    wg = fresh(group_factory, NamedMeshWorker, MESHES["tp2dp2pp2"], meshes={"rollout": RankMesh(tp=4, dp=2)})
    for method in ("rollout_tp0", "rollout_nd"):
        out = getattr(wg, method)(make_batch(4))
        assert rows_of(out) == [0, 1, 2, 3] and out.batch["rank"].tolist() == [0, 0, 4, 4]
        assert wg.take_log() == two_rows_each([0, 0, 0, 0, 1, 1, 1, 1])
    assert wg.rollout_lists(["a", "b"]) == [(0, "a"), (4, "b")]
    assert wg.identity()[0]["meshes"] == ["default", "rollout"]
    # the training-mesh modes are unchanged: megatron collects tp0/last pp = ranks 4, 6
    assert wg.megatron_compute(["a", "b"]) == [(4, "a"), (6, "b")]
    wg.take_log()


def test_worker_registered_dispatch_info(group_factory):
    # ranks register dp = rank // 2, collected = odd ranks: pieces [0,0,1,1], outputs of 1 and 3
    wg = fresh(group_factory, RegisteringWorker, RankMesh(dp=4))
    out = wg.actor_nd(make_batch(4))
    assert rows_of(out) == [0, 1, 2, 3] and out.batch["rank"].tolist() == [1, 1, 3, 3]
    assert wg.take_log() == two_rows_each([0, 0, 1, 1])


def test_async_methods(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    out = wg.async_echo(make_batch(8))
    assert out.batch["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    first, second = wg.loop_id(), wg.loop_id()
    assert first == second  # each rank keeps one event loop across calls


def test_execute_all_and_rank_zero(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    assert wg.execute_all("not_registered", 5) == [(r, 5) for r in range(4)]
    assert wg.execute_all("not_registered", [10, 11, 12, 13]) == [(r, 10 + r) for r in range(4)]
    assert wg.execute_rank_zero("not_registered", 7) == (0, 7)
    assert wg.execute_all_async("not_registered", 1).get() == [(r, 1) for r in range(4)]
    assert wg.execute_rank_zero_async("not_registered", 2).get() == (0, 2)
    with pytest.raises(DispatchError, match="no_such_method"):
        wg.execute_all("no_such_method")
    assert wg.world_size == 4 and wg.mesh == MESHES["dp4"]


# ----- futures across groups ----------------------------------------------------------------------


def test_future_parts_follow_the_consumer_split(group_factory):
    producer = fresh(group_factory, mesh=RankMesh(dp=4))
    fut = producer.dp_compute_proto_nb(make_batch(8))  # 4 parts of 2 rows
    two = fresh(group_factory, mesh=RankMesh(dp=2))
    assert two.peek_future(fut) == [
        {"parts": 2, "rows": 4, "x": [0, 1, 2, 3]},
        {"parts": 2, "rows": 4, "x": [4, 5, 6, 7]},
    ]
    eight = fresh(group_factory, mesh=RankMesh(dp=8))
    assert eight.peek_future(fut) == [{"parts": 1, "rows": 1, "x": [r]} for r in range(8)]
    out = two.megatron_compute_proto(fut)
    assert rows_of(out) == list(range(8)) and out.batch["rank"].tolist() == [0] * 4 + [1] * 4


def test_padded_future_into_another_group(group_factory):
    producer = fresh(group_factory, mesh=RankMesh(dp=4))
    batch = make_batch(7)
    fut = producer.megatron_compute_proto_pad_nb(batch)
    assert len(fut) == 7
    consumer = fresh(group_factory, mesh=RankMesh(dp=2))
    assert_same_rows(consumer.megatron_compute_proto_pad(fut), batch)
    with pytest.raises(PaddingError):
        consumer.megatron_compute_proto(fut)


def test_auto_padding_flag_follows_a_batch_into_its_future(group_factory):
    # One rule for batches and futures: a batch with verl's meta flag is padded, and so is a
    # future computed from it (its own meta_info cannot be seen before it is fetched).
    producer = fresh(group_factory, mesh=RankMesh(dp=2))
    consumer = fresh(group_factory, mesh=RankMesh(dp=4))
    batch = make_batch(6, _verl_auto_padding=True)
    assert rows_of(consumer.megatron_compute_proto(batch)) == list(range(6))  # 6 rows over dp4: padded
    fut = producer.dp_compute_proto_nb(batch)  # 6 rows over dp2: no padding needed there
    assert fut.auto_padding
    assert rows_of(consumer.megatron_compute_proto(fut)) == list(range(6))
    plain = producer.dp_compute_proto_nb(make_batch(6))
    with pytest.raises(PaddingError, match="enable padding"):
        consumer.megatron_compute_proto(plain)


# ----- bad input -----------------------------------------------------------------------------------


def test_bad_arguments(group_factory):
    wg = fresh(group_factory, mesh=MESHES["dp4"])
    batch = make_batch(4)
    with pytest.raises(DispatchError, match=r"compute.*MEGATRON_COMPUTE_PROTO.*'data'.*int.*DataProto"):
        wg.compute(5)
    with pytest.raises(DispatchError, match=r"dp_compute .*DP_COMPUTE.*str.*list"):
        wg.dp_compute("not a list")
    with pytest.raises(DispatchError, match=r"2 items.*exactly 4"):
        wg.dp_compute([1, 2])
    with pytest.raises(DispatchError, match="same number of rows"):
        wg.megatron_compute_proto(batch, make_batch(8))
    with pytest.raises(DispatchError, match="function"):
        wg.dp_compute_proto_with_func(5, batch)
    with pytest.raises(DispatchError, match="dict"):
        wg.dp_compute_proto({"x": [1, 2, 3, 4]})
    assert rows_of(batch) == [0, 1, 2, 3] and wg.take_log() == [[]] * 4


def test_worker_failure_names_the_rank(group_factory):
    wg = fresh(group_factory, mesh=RankMesh(tp=2, dp=2))
    with pytest.raises(WorkerError, match="boom") as info:
        wg.fail_on_rank(make_batch(4))  # rank 1 is tp=1: not collected, still reported
    assert info.value.rank == 1 and info.value.coords["tp"] == 1
    assert "fail_on_rank" in info.value.method
    with pytest.raises(WorkerError, match="kaput"):
        wg.fail_everywhere("kaput")
    assert wg.one_to_all("still alive") == [(r, "still alive") for r in range(4)]
