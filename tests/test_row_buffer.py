"""RowBuffer and rankmesh.wait on the in-process backend: accounting, ordering, bounds, bad input.

The accounting test runs random put/take sequences (hypothesis) against a plain list model of
a FIFO with a staleness floor, written here independently of the buffer: every row put comes
out exactly once, in a take or among the dropped rows, oldest first.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rankmesh
from rankmesh import DataProto, DataProtoFuture, LocalWorkerGroup, RankMesh, RowBuffer
from rankmesh.data import identity_fetch
from rankmesh.errors import DispatchError, RowBufferError, WorkerError
from tests.replica_workers import ReplicaWorker


def _rows(ids: list[int]) -> DataProto:
    return DataProto.from_dict({"id": torch.tensor(ids, dtype=torch.int64)})


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 5), st.integers(0, 4)),  # rows, version
        st.tuples(st.just("take"), st.integers(1, 6), st.one_of(st.none(), st.integers(0, 4))),  # n, min_version
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, as_future=st.booleans())
def test_every_row_comes_out_exactly_once_oldest_first(ops, as_future):
    """Versions are put in any order (replicas finish out of order): a take drops every stale row held."""
    buf = RowBuffer(capacity_rows=12)
    model: list[tuple[int, int]] = []  # (row id, version), oldest first
    next_id, put_ids, out_ids = 0, [], []
    for op, a, b in ops:
        if op == "put":
            ids = list(range(next_id, next_id + a))
            if len(model) + a > 12:
                with pytest.raises(RowBufferError, match="holds"):
                    buf.put(_rows(ids), version=b, block=False)
                continue
            batch = _rows(ids)
            buf.put(DataProtoFuture.from_parts([batch], identity_fetch, rows=[a]) if as_future else batch, version=b, block=False)
            next_id += a
            put_ids += ids
            model += [(i, b) for i in ids]
        else:
            stale = [] if b is None else [m for m in model if m[1] < b]
            rest = [m for m in model if b is None or m[1] >= b]
            if len(rest) < a:
                with pytest.raises(RowBufferError, match=rf"take\({a}\)"):
                    buf.take(a, min_version=b, block=False)
                model = rest  # stale rows are dropped even by a take that cannot be served
                out_ids += [i for i, _ in stale]
                continue
            taken = buf.take(a, min_version=b, block=False)
            got = taken.data.get().batch["id"].tolist()
            dropped = taken.dropped.get().batch["id"].tolist() if taken.dropped_versions else []
            assert got == [i for i, _ in rest[:a]]
            assert list(taken.versions) == [v for _, v in rest[:a]]
            assert dropped == [i for i, _ in stale] and list(taken.dropped_versions) == [v for _, v in stale]
            out_ids += got + dropped
            model = rest[a:]
        assert buf.rows == len(model) <= 12
        assert buf.put_rows == buf.taken_rows + buf.dropped_rows + buf.rows
    remaining = [i for i, _ in model]
    assert sorted(out_ids + remaining) == put_ids and len(set(out_ids)) == len(out_ids)


def test_a_full_buffer_blocks_a_put_until_a_take_makes_room():
    buf = RowBuffer(4)
    buf.put(_rows([0, 1, 2]), version=0)
    done = threading.Event()

    def producer():
        buf.put(_rows([3, 4]), version=1, timeout=10)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.2)
    assert not done.is_set()  # blocked: 3 + 2 > 4
    assert buf.take(2).data.get().batch["id"].tolist() == [0, 1]
    t.join(10)
    assert done.is_set()
    assert buf.take(3).data.get().batch["id"].tolist() == [2, 3, 4]


def test_waits_end_with_a_clear_error_instead_of_hanging():
    buf = RowBuffer(2)
    buf.put(_rows([0, 1]), version=0)
    start = time.monotonic()
    with pytest.raises(RowBufferError, match=r"holds 2 of 2 rows and no take freed room within 0.2 s"):
        buf.put(_rows([2]), version=0, timeout=0.2)
    with pytest.raises(RowBufferError, match=r"take\(2\): 0 rows of version >= 1 held.*within 0.2 s; 2 stale rows were dropped"):
        buf.take(2, min_version=1, timeout=0.2)
    assert time.monotonic() - start < 5
    assert buf.dropped_rows == 2 and buf.rows == 0


@pytest.mark.parametrize(
    "call, match",
    [(lambda b: RowBuffer(0), r"capacity_rows\) must be a positive"),
     (lambda b: b.put(_rows([1]), version=-1), r"put\(version\) must be a weight version >= 0"),
     (lambda b: b.put([1, 2], version=0), r"takes a DataProto or a DataProtoFuture, got list"),
     (lambda b: b.put(_rows(list(range(5))), version=0), r"5 rows can never fit a buffer of capacity_rows=4"),
     (lambda b: b.put(DataProtoFuture.from_parts([_rows([1])], identity_fetch), version=0), r"row count is unknown"),
     (lambda b: b.take(5), r"take\(n\) must be 1..4"),
     (lambda b: b.take(1, min_version="new"), r"min_version\) must be None or a version"),
     (lambda b: b.take(1, timeout=-1), r"timeout must be None or seconds >= 0")],
)
def test_bad_input_is_refused_naming_the_argument(call, match):
    with pytest.raises(RowBufferError, match=match):
        call(RowBuffer(4))


def test_part_futures_are_the_rows_of_each_replica_and_concat_back():
    wg = LocalWorkerGroup(ReplicaWorker, mesh=RankMesh(tp=2, dp=3))
    batch = DataProto.from_dict({"x": torch.arange(6, dtype=torch.float32)})
    fut = wg.execute_all_async("where")
    assert rankmesh.wait([fut]) == ([fut], [])  # in-process calls are done when they return
    out = wg.generate_later(batch)
    parts = out.part_futures()
    assert [p.get().batch["rank"].tolist() for p in parts] == [[0, 0], [2, 2], [4, 4]]
    assert torch.equal(DataProtoFuture.concat(parts).get().batch["x"], out.get().batch["x"])
    padded, _ = out.slice_rows(0, 5).pad_to_divisor(4)  # 5 rows + the first 3 again
    assert [len(p) for p in padded.part_futures()] == [2, 2, 1, 2, 1]
    assert DataProtoFuture.concat(padded.part_futures()).get().batch["x"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    done, pending = rankmesh.wait(parts, num_returns=2)
    assert done == parts[:2] and pending == parts[2:]


def test_unknown_row_futures_split_only_before_narrowing():
    fut = DataProtoFuture.from_parts([_rows([0, 1]), _rows([2])], identity_fetch)
    assert [p.get().batch["id"].tolist() for p in fut.part_futures()] == [[0, 1], [2]]
    with pytest.raises(Exception, match="cannot split .* by part"):
        fut.slice_rows(1, 3).part_futures()


@pytest.mark.parametrize(
    "args, match",
    [(([],), r"got no futures"),
     (([object()],), r"futures\[0\] is a object"),
     (("f2",), r"num_returns must be 1..1"),
     (("dup",), r"listed twice"),
     (("timeout",), r"timeout must be None or seconds >= 0"),
     (("foreign",), r"cannot say whether its parts are done")],
)
def test_wait_refuses_bad_input_naming_it(args, match):
    wg = LocalWorkerGroup(ReplicaWorker, mesh=RankMesh(dp=2))
    fut = wg.execute_all_async("where")
    kind = args[0]
    with pytest.raises(DispatchError, match=match):
        if kind == "f2":
            rankmesh.wait([fut], num_returns=2)
        elif kind == "dup":
            rankmesh.wait([fut, fut])
        elif kind == "timeout":
            rankmesh.wait([fut], timeout=-1)
        elif kind == "foreign":
            rankmesh.wait([DataProtoFuture.from_parts([object()], lambda hs: list(hs))])
        else:
            rankmesh.wait(*args)


def test_generated_rows_carry_the_version_that_made_them_through_slicing_and_the_buffer():
    wg = LocalWorkerGroup(ReplicaWorker, mesh=RankMesh(tp=2, dp=2))
    assert wg.replica(1).load_version(4) == [4, 4]  # replica 1 refitted, replica 0 still on version 0
    out = wg.generate(DataProto.from_dict({"x": torch.arange(4, dtype=torch.float32)}))
    assert out.batch["weight_version"].tolist() == [0, 0, 4, 4]
    assert DataProto.concat([out[2:], out[:1]]).batch["weight_version"].tolist() == [4, 4, 0]
    buf = RowBuffer(8)
    buf.put(out[:2], version=0)
    buf.put(out[2:], version=4)
    taken = buf.take(4)
    assert taken.staleness(5) == 5 and taken.staleness(4) == 4  # the oldest row taken lags by that much
    assert taken.data.get().batch["weight_version"].tolist() == list(taken.versions) == [0, 0, 4, 4]
    with pytest.raises(WorkerError, match=r"rank 0: weight_version must be a version >= 0, got -2"):
        wg.load_version(-2)


def test_discard_drops_stale_rows_anywhere_and_returns_them():
    buf = RowBuffer(8)
    buf.put(_rows([0, 1]), version=2)
    buf.put(_rows([2]), version=1)  # an older version finished later (a slow replica)
    buf.put(_rows([3]), version=3)
    out = buf.discard(2)
    assert out.dropped_versions == (1,) and out.dropped.get().batch["id"].tolist() == [2] and out.rows == 0
    assert buf.versions() == [(2, 2), (3, 1)] and buf.dropped_rows == 1
    assert buf.take(3).data.get().batch["id"].tolist() == [0, 1, 3]
    with pytest.raises(RowBufferError, match=r"discard\(min_version\) must be a version >= 0"):
        buf.discard(None)


def test_available_counts_the_rows_a_take_could_hand_out():
    buf = RowBuffer(8)
    buf.put(_rows([0, 1]), version=2)
    buf.put(_rows([2, 3, 4]), version=1)
    assert (buf.available(), buf.available(2), buf.available(3)) == (5, 2, 0)
    buf.take(1, min_version=1)
    assert buf.available(1) == 4 and buf.rows == 4  # nothing dropped: every row held is of version >= 1
