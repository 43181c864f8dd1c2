"""Hypothesis property tests of DataProto against plain torch / numpy reference computations."""

from __future__ import annotations

import copy
import math
import os
import pickle
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankmesh import serialization
from rankmesh.data import AUTO_PADDING_KEY, DataProto
from rankmesh.errors import DataProtoError

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool
]


# --- reference comparisons (independent of rankmesh) ----------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor: equality of these is exact and NaN-aware."""
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))  # standard strides
    return flat.view(torch.uint8)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_cell(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


def same_column(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == object:
        return all(same_cell(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))
    return a.tobytes() == b.tobytes()


def same_row_cell(got, want) -> bool:
    """One row of a column: a sub-array (2-D columns), a numpy scalar or an object cell."""
    if isinstance(want, (np.ndarray, np.generic)):
        return isinstance(got, type(want)) and same_column(np.asarray(got), np.asarray(want))
    return same_cell(got, want)


def assert_same(got: DataProto, tensors: dict, columns: dict) -> None:
    """``got`` holds exactly the reference tensors and columns."""
    got_t = dict(got.batch.items()) if got.batch is not None else {}
    assert set(got_t) == set(tensors)
    for k, t in tensors.items():
        assert same_tensor(got_t[k], t), k
    assert set(got.non_tensor_batch) == set(columns)
    for k, c in columns.items():
        assert same_column(got.non_tensor_batch[k], c), k


def content(d: DataProto) -> tuple[dict, dict]:
    return (dict(d.batch.items()) if d.batch is not None else {}), dict(d.non_tensor_batch)


def deep_snapshot(d: DataProto) -> tuple:
    t, c = content(d)
    return {k: v.clone() for k, v in t.items()}, copy.deepcopy(c), copy.deepcopy(d.meta_info)


def assert_snapshot(d: DataProto, snap: tuple) -> None:
    t, c, meta = snap
    assert_same(d, t, c)
    assert d.meta_info.keys() == meta.keys()
    assert all(same_cell(d.meta_info[k], v) or d.meta_info[k] == v for k, v in meta.items())


# --- strategies ----------------------------------------------------------------------------------


@st.composite
def tensors(draw, n: int) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    trailing = draw(st.lists(st.integers(0, 3), max_size=2))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (n, *trailing)
    base = torch.randn(shape, generator=g) * 50
    if dtype == torch.bool:
        t = base > 0
    elif dtype.is_floating_point:
        t = base.to(dtype)
        t[torch.rand(shape, generator=g) < 0.2] = float("nan")
    else:
        t = base.abs().to(dtype)
    if draw(st.booleans()):  # same values, non-contiguous layout
        t = torch.stack([t, torch.zeros_like(t)], dim=1)[:, 0]
    return t


OBJ_VALUES = st.one_of(
    st.none(),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.floats(allow_nan=True),
    st.lists(st.integers(0, 3), max_size=2),
)


@st.composite
def columns(draw, n: int) -> np.ndarray:
    kind = draw(st.sampled_from(["f8", "i4", "U", "obj", "f4x2"]))
    if kind == "obj":
        col = np.empty(n, dtype=object)
        for i, v in enumerate(draw(st.lists(OBJ_VALUES, min_size=n, max_size=n))):
            col[i] = v
        return col
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    vals = rng.normal(size=2 * n) * 1e3
    vals[rng.random(2 * n) < 0.2] = np.nan
    if kind == "f8":
        return vals[:n].copy()
    if kind == "i4":
        return np.nan_to_num(vals[:n]).astype(np.int32)
    if kind == "U":
        return np.array([str(v)[:4] for v in vals[:n]])
    return vals.astype(np.float32).reshape(n, 2)


@st.composite
def dataprotos(draw, min_rows: int = 0, max_rows: int = 9) -> DataProto:
    n = draw(st.integers(min_rows, max_rows))
    tkeys = draw(st.lists(st.sampled_from(["a", "b", "c"]), unique=True, max_size=3))
    ckeys = draw(st.lists(st.sampled_from(["x", "y"]), unique=True, max_size=2))
    if not tkeys and not ckeys:
        ckeys = ["x"]
    t = {k: draw(tensors(n)) for k in tkeys}
    c = {k: draw(columns(n)) for k in ckeys}
    meta = {"temp": draw(st.floats(allow_nan=False)), "tag": draw(st.text(max_size=3))}
    return DataProto.from_dict(t, c, meta)


# --- properties -------------------------------------------------------------------------------------


@SETTINGS
@given(dataprotos(), st.integers(1, 5))
def test_chunk_concat_round_trip(d, k):
    snap = deep_snapshot(d)
    d.meta_info[AUTO_PADDING_KEY] = True
    chunks = d.chunk(k)
    bounds = [(int(a[0]), int(a[-1]) + 1) if len(a) else None for a in np.array_split(np.arange(len(d)), k)]
    assert [len(c) for c in chunks] == [0 if b is None else b[1] - b[0] for b in bounds]
    t, c = snap[0], snap[1]
    for chunk, b in zip(chunks, bounds):
        lo, hi = b if b is not None else (0, 0)
        assert_same(chunk, {key: v[lo:hi] for key, v in t.items()}, {key: v[lo:hi] for key, v in c.items()})
        for key, v in content(d)[0].items():  # views of the parent, no bytes copied
            assert chunk.batch[key].untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert_same(DataProto.concat(chunks), t, c)
    del d.meta_info[AUTO_PADDING_KEY]
    assert_snapshot(d, snap)


@SETTINGS
@given(dataprotos(), st.data())
def test_select_union(d, data):
    t, c = content(d)
    t1 = data.draw(st.lists(st.sampled_from(sorted(t)), unique=True)) if t else []
    c1 = data.draw(st.lists(st.sampled_from(sorted(c)), unique=True)) if c else []
    snap = deep_snapshot(d)
    a = d.select(batch_keys=t1, non_tensor_batch_keys=c1)
    b = d.select(batch_keys=sorted(set(t) - set(t1)) + t1[:1], non_tensor_batch_keys=sorted(set(c) - set(c1)) + c1[:1])
    assert_same(a, {k: t[k] for k in t1}, {k: c[k] for k in c1})
    u = a.union(b)
    assert_same(u, t, c)
    assert u.meta_info == d.meta_info or math.isnan(d.meta_info["temp"])
    assert_snapshot(d, snap)


@SETTINGS
@given(dataprotos(), st.integers(0, 3), st.booleans())
def test_repeat_matches_index_reference(d, r, interleave):
    n = len(d)
    idx = [i for i in range(n) for _ in range(r)] if interleave else [i for _ in range(r) for i in range(n)]
    t, c = content(d)
    snap = deep_snapshot(d)
    out = d.repeat(r, interleave=interleave)
    ti = torch.tensor(idx, dtype=torch.long)
    assert_same(out, {k: v[ti] for k, v in t.items()}, {k: v[np.array(idx, dtype=np.int64)] for k, v in c.items()})
    assert_snapshot(d, snap)


@SETTINGS
@given(dataprotos(), st.integers(1, 6))
def test_pad_unpad_round_trip(d, divisor):
    n = len(d)
    pad_ref = (divisor - n % divisor) % divisor
    idx = np.array([i % n for i in range(n + pad_ref)] if n else [], dtype=np.int64)
    t, c = content(d)
    snap = deep_snapshot(d)
    padded, pad = d.pad_to_divisor(divisor)
    assert pad == pad_ref
    assert_same(padded, {k: v[torch.from_numpy(idx)] for k, v in t.items()}, {k: v[idx] for k, v in c.items()})
    assert_same(padded.unpad(pad), t, c)
    assert_snapshot(d, snap)


def _round_trips(d: DataProto):
    data, bufs = serialization.dumps(d)
    yield "dumps", serialization.loads(data, bufs)
    yield "pickle4", pickle.loads(pickle.dumps(d, protocol=4))
    yield "deepcopy", copy.deepcopy(d)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "d.bin")
        d.save_to_disk(path)
        yield "file", DataProto.load_from_disk(path)


@SETTINGS
@given(dataprotos(max_rows=40))
def test_serialization_round_trip(d):
    t, c = content(d)
    snap = deep_snapshot(d)
    for how, back in _round_trips(d):
        assert_same(back, t, c)
        assert back.meta_info.keys() == d.meta_info.keys(), how
        for k, v in content(back)[0].items():
            if v.numel():
                assert v.untyped_storage().data_ptr() != t[k].untyped_storage().data_ptr(), how
                v.view(-1)[0] = v.view(-1)[1 % v.numel()]  # writable; must not reach the sender
        for k, v in content(back)[1].items():
            if v.size and v.dtype != object:
                assert not np.shares_memory(v, c[k]) and v.flags.writeable, how
    assert_snapshot(d, snap)


@SETTINGS
@given(dataprotos(min_rows=1), st.data())
def test_bad_lengths_name_the_key(d, data):
    t, c = content(d)
    bad_key = data.draw(st.sampled_from(["bad_t", "bad_c"]))
    t_in, c_in = dict(t), dict(c)
    extra = data.draw(st.integers(1, 3))
    if bad_key == "bad_t":
        t_in[bad_key] = torch.zeros(len(d) + extra)
    else:
        c_in[bad_key] = np.zeros(len(d) + extra)
    snap_t, snap_c = dict(t_in), dict(c_in)
    with pytest.raises(DataProtoError, match=bad_key):
        DataProto.from_dict(t_in, c_in)
    assert t_in == snap_t and set(c_in) == set(snap_c)


OPS = ["slice", "index", "chunk", "split", "select", "repeat", "pad", "to", "concat", "getitem"]


@SETTINGS
@given(dataprotos(), st.lists(st.sampled_from(OPS), max_size=6))
def test_non_mutating_ops_leave_input_alone(d, ops):
    snap = deep_snapshot(d)
    n = len(d)
    for op in ops:
        if op == "slice":
            out = d[1:]
        elif op == "index":
            out = d[list(range(n))[::-1]]
        elif op == "chunk":
            out = d.chunk(1)[0]
        elif op == "split":
            out = d.split(2)[0] if n else copy.copy(d)
        elif op == "select":
            out = d.select(deepcopy=True)
        elif op == "repeat":
            out = d.repeat(2)
        elif op == "pad":
            out = d.pad_to_divisor(4)[0]
        elif op == "to":
            out = d.to("cpu")
        elif op == "concat":
            out = DataProto.concat([d, d])
        elif not n:
            with pytest.raises(IndexError):
                d[0]
            continue
        else:
            out = d[0]  # one row: a DataProtoItem holding row 0 of the snapshot's tensors and columns
            t, c, _ = snap
            assert set(out.batch.keys() if out.batch is not None else ()) == set(t)
            assert all(same_tensor(out.batch[k], v[0]) for k, v in t.items())
            assert set(out.non_tensor_batch) == set(c)
            assert all(same_row_cell(out.non_tensor_batch[k], v[0]) for k, v in c.items())
        out.meta_info["temp"] = "changed"
        out.meta_info.clear()
        if out.batch is not None:
            for k in list(out.batch.keys()):
                out.batch.pop(k)
        out.non_tensor_batch.clear()
    assert_snapshot(d, snap)
