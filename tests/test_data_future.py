"""DataProtoFuture: windows over parts, fetching only what overlaps, pad rows removed."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankmesh.data import AUTO_PADDING_KEY, DataProto, DataProtoConfig, DataProtoFuture, identity_fetch
from rankmesh.errors import DataProtoError, PaddingError


class Store:
    """A picklable fetch over named parts that records which handles were fetched."""

    def __init__(self, parts: dict[str, DataProto]):
        self.parts = parts
        self.calls: list[list[str]] = []

    def __call__(self, handles):
        self.calls.append(list(handles))
        return [self.parts[h] for h in handles]

    @property
    def fetched(self) -> list[str]:
        return [h for call in self.calls for h in call]


def make_parts(rows: list[int]) -> tuple[Store, list[str]]:
    """Part r holds rows numbered consecutively across parts: a global row id per row."""
    parts, start = {}, 0
    for r, n in enumerate(rows):
        parts[f"p{r}"] = DataProto.from_dict(
            {"row": torch.arange(start, start + n)}, {"tag": [f"p{r}"] * n}, {"metrics": {"rank": r}, "same": 1}
        )
        start += n
    return Store(parts), list(parts)


def rows_of(d: DataProto) -> list[int]:
    return d.batch["row"].tolist()


def test_get_removes_pad_rows_and_merges_meta():
    store, handles = make_parts([3, 3, 3, 3])
    fut = DataProtoFuture.from_parts(handles, store, rows=[3] * 4, pad_size=2)
    assert len(fut) == 10 and fut.num_rows == 10 and fut.rows_known
    d = fut.get()
    assert rows_of(d) == list(range(10))
    assert d.meta_info == {"metrics": {"rank": [0, 1, 2, 3]}, "same": 1}
    assert store.fetched == handles


def test_chunk_futures_fetch_only_overlapping_parts():
    store, handles = make_parts([4, 4, 4])
    fut = DataProtoFuture.from_parts(handles, store, rows=[4, 4, 4], pad_size=0)
    chunks = fut.chunk(4)  # 3 rows each: [0,3) [3,6) [6,9) [9,12)
    assert store.calls == []  # chunking fetches nothing
    assert [c.handles for c in chunks] == [["p0"], ["p0", "p1"], ["p1", "p2"], ["p2"]]
    for i, c in enumerate(chunks):
        store.calls.clear()
        assert rows_of(c.get()) == list(range(3 * i, 3 * i + 3))
        assert store.fetched == c.handles


def test_slice_rows_across_boundaries_and_nested():
    store, handles = make_parts([2, 5, 1, 4])
    fut = DataProtoFuture.from_parts(handles, store, rows=[2, 5, 1, 4], pad_size=3)  # 9 real rows
    s = fut.slice_rows(1, 8)
    assert s.handles == ["p0", "p1", "p2"] and len(s) == 7
    inner = s.slice_rows(5, None)  # global rows 6, 7
    assert inner.handles == ["p1", "p2"]
    assert rows_of(inner.get()) == [6, 7]
    assert rows_of(fut.slice_rows(-2).get()) == [7, 8]


def test_uneven_chunk_needs_padding():
    store, handles = make_parts([5])
    fut = DataProtoFuture.from_parts(handles, store, rows=[5])
    with pytest.raises(PaddingError, match="5 rows into 2"):
        fut.chunk(2)
    padded, pad = fut.pad_to_divisor(4)
    assert pad == 3 and len(padded) == 8 and store.calls == []
    assert rows_of(padded.get()) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert [rows_of(c.get()) for c in padded.chunk(4)] == [[0, 1], [2, 3], [4, 0], [1, 2]]
    assert rows_of(padded.unpad(pad).get()) == [0, 1, 2, 3, 4]
    DataProtoConfig.auto_padding = True
    try:
        assert [len(c) for c in fut.chunk(2)] == [3, 2]
    finally:
        DataProtoConfig.auto_padding = False


def test_pad_cycles_when_shorter_than_pad():
    store, handles = make_parts([1, 1])
    fut = DataProtoFuture.from_parts(handles, store, rows=[1, 1])
    padded, pad = fut.pad_to_divisor(7)
    assert pad == 5 and rows_of(padded.get()) == [0, 1, 0, 1, 0, 1, 0]
    assert padded.get().meta_info["metrics"] == {"rank": [0, 1]}  # each part counted once


def test_empty_chunks_keep_the_schema():
    store, handles = make_parts([2])
    DataProtoConfig.auto_padding = True
    try:
        chunks = DataProtoFuture.from_parts(handles, store, rows=[2]).chunk(3)
    finally:
        DataProtoConfig.auto_padding = False
    empty = chunks[2].get()
    assert len(empty) == 0 and list(empty.batch.keys()) == ["row"] and "tag" in empty.non_tensor_batch
    assert len(DataProtoFuture.concat([]).get()) == 0


def test_concat_of_futures_flattens_and_dedupes():
    store, handles = make_parts([3, 3])
    fut = DataProtoFuture.from_parts(handles, store, rows=[3, 3])
    a, b = fut.chunk(2)
    again = DataProtoFuture.concat([b, a])
    assert rows_of(again.get()) == [3, 4, 5, 0, 1, 2]
    whole = DataProtoFuture.concat(fut.chunk(3))
    assert whole.handles == handles and whole.segments == ((0, 6),)
    store.calls.clear()
    assert rows_of(whole.get()) == list(range(6)) and store.calls == [handles]


def test_concat_with_other_fetch_nests():
    store, handles = make_parts([2, 2])
    f1 = DataProtoFuture.from_parts(handles[:1], store, rows=[2])
    local = DataProtoFuture.from_parts([store.parts["p1"]], identity_fetch, rows=[2])
    both = DataProtoFuture.concat([f1, local])
    assert len(both) == 4 and rows_of(both.slice_rows(1, 3).get()) == [1, 2]


def test_unknown_rows_defer_like_verl():
    store, handles = make_parts([2, 4])
    fut = DataProtoFuture.concat(handles, fetch=store)  # verl's constructor-free spelling
    assert not fut.rows_known and fut.num_rows is None
    with pytest.raises(DataProtoError, match="unknown"):
        len(fut)
    with pytest.raises(DataProtoError):
        fut.pad_to_divisor(4)
    parts = fut.chunk(3)
    assert [rows_of(p.get()) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert rows_of(fut.unpad(1).slice_rows(1, None).get()) == [1, 2, 3, 4]
    odd = DataProtoFuture.from_parts(handles[:1], store)
    with pytest.raises(PaddingError):
        odd.chunk(3)[0].get()
    store.parts["p0"].meta_info[AUTO_PADDING_KEY] = True  # the per-batch flag is seen after fetching
    assert [len(c.get()) for c in odd.chunk(3)] == [1, 1, 0]
    nested = DataProtoFuture.concat([fut, DataProtoFuture.from_parts(handles[:1], store, rows=[2])])
    assert not nested.rows_known and rows_of(nested.get()) == [0, 1, 2, 3, 4, 5, 0, 1]


def test_pickle_round_trip_and_bad_parts():
    store, handles = make_parts([2, 2])
    fut = DataProtoFuture.from_parts(handles, store, rows=[2, 2], pad_size=1).chunk(1)[0]
    back = pickle.loads(pickle.dumps(fut))
    assert rows_of(back.get()) == [0, 1, 2]
    lying = DataProtoFuture.from_parts(handles, store, rows=[2, 3])
    with pytest.raises(DataProtoError, match="announced"):
        lying.get()
    with pytest.raises(DataProtoError):
        DataProtoFuture.from_parts(handles, store, rows=[2])
    with pytest.raises(DataProtoError):
        DataProtoFuture.from_parts(handles, store, rows=[2, 2], pad_size=5)
    with pytest.raises(DataProtoError, match="not a DataProto"):
        DataProtoFuture.from_parts(["x"], identity_fetch, rows=[1]).get()



def test_counts_follow_one_rule_numpy_ints_accepted_bools_refused():
    """DataProto and DataProtoFuture check counts alike (they had drifted: numpy ints refused here)."""
    store, handles = make_parts([2, 2])
    known = DataProtoFuture.from_parts(handles, store, rows=[np.int64(2), 2], pad_size=np.int32(1))
    unknown = DataProtoFuture.from_parts(handles, store)
    assert rows_of(known.unpad(np.int64(1)).get()) == [0, 1]
    assert rows_of(unknown.unpad(np.int64(1)).get()) == [0, 1, 2]
    assert rows_of(store.parts["p0"].unpad(np.int64(1))) == [0]
    assert len(known.pad_to_divisor(np.int64(4))[0]) == 4 and len(known.chunk(np.int8(3))) == 3
    for fut in (known, unknown, store.parts["p0"]):
        for bad in (True, -1, 1.0):
            with pytest.raises(DataProtoError, match="pad_size"):
                fut.unpad(bad)
        with pytest.raises(DataProtoError, match="chunks"):
            fut.chunk(True)
    with pytest.raises(DataProtoError, match="pad_size"):
        known.unpad(4)  # more than the 3 rows it has

@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=5),
    st.integers(0, 4),
    st.integers(1, 5),
    st.data(),
)
def test_chunk_windows_match_reference(rows, pad, chunks, data):
    total = sum(rows)
    pad = min(pad, total)
    store, handles = make_parts(rows)
    fut = DataProtoFuture.from_parts(handles, store, rows=rows, pad_size=pad)
    real = list(range(total - pad))
    if len(real) % chunks:
        fut, extra = fut.pad_to_divisor(chunks)
        real = real + [real[i % len(real)] for i in range(extra)]
    bounds = [(i * len(real) // chunks, (i + 1) * len(real) // chunks) for i in range(chunks)]
    starts = [0, *itertools.accumulate(rows)]
    for c, (lo, hi) in zip(fut.chunk(chunks), bounds):
        want = real[lo:hi]
        store.calls.clear()
        assert rows_of(c.get()) == want
        touched = {f"p{i}" for i in range(len(rows)) for r in want if starts[i] <= r < starts[i + 1]}
        assert set(store.fetched) == (touched or set(store.fetched[:1]))
    a = data.draw(st.integers(0, len(real)))
    b = data.draw(st.integers(a, len(real)))
    assert rows_of(fut.slice_rows(a, b).get()) == real[a:b]
