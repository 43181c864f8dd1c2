"""Out-of-band pickling of DataProto, receive-side isolation, and a real Ray round trip."""

from __future__ import annotations

import gc
import pickle
import weakref

import numpy as np
import pytest
import torch

from rankmesh import serialization
from rankmesh.data import DataProto, DataProtoFuture
from rankmesh.errors import DataProtoError

MIB = 1 << 20


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes in row-major order: exact, NaN-aware equality."""
    return torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8)


def addr(buf) -> int:
    """Address of the first byte of a buffer-protocol object."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


# --- tensors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(5, 3).to(torch.bfloat16),
        torch.randn(4).to(torch.float8_e4m3fn),
        torch.tensor([True, False]),
        torch.arange(6).to(torch.uint16).reshape(2, 3),
        torch.randn(3, 4).t(),  # non-contiguous
        torch.randn(6, 4)[::2, 1:],  # non-contiguous view with an offset
        torch.tensor(3.5),  # 0-d
        torch.zeros(0, 4),
        torch.zeros(3, 0, dtype=torch.bfloat16),
        torch.tensor([float("nan"), float("inf"), -0.0]),
        torch.randn(2, 2, dtype=torch.complex64).conj(),
        torch.randn(20000),  # out of band
    ],
    ids=lambda t: f"{t.dtype}{tuple(t.shape)}",
)
def test_tensor_round_trip_is_exact_and_private(t):
    for protocol in (4, 5):
        back = pickle.loads(pickle.dumps(_Carry(t), protocol=protocol)).t
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(bits(back), bits(t.resolve_conj()))
    data, bufs = serialization.dumps(_Carry(t))
    back = serialization.loads(data, bufs).t
    if back.numel():
        assert back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


class _Carry:
    """Pickles one tensor through rankmesh.serialization (what DataProto does per key)."""

    def __init__(self, t):
        self.t = t

    def __reduce_ex__(self, protocol):
        return (_rebuild_carry, (serialization.reduce_tensor(self.t, protocol),))


def _rebuild_carry(state):
    return _Carry(serialization.rebuild_tensor(state))


def test_requires_grad_survives():
    t = torch.randn(3, requires_grad=True)
    back = pickle.loads(pickle.dumps(_Carry(t), protocol=5)).t
    assert back.requires_grad and torch.equal(back.detach(), t.detach())


def test_tensor_from_buffer_copies_only_when_needed():
    arr = np.arange(4, dtype=np.int16)
    shared = serialization.tensor_from_buffer(arr, writable_copy=False)
    assert shared.data_ptr() == arr.ctypes.data
    assert serialization.tensor_from_buffer(arr, writable_copy=True).data_ptr() != arr.ctypes.data
    ro = arr.copy()
    ro.flags.writeable = False
    t = serialization.tensor_from_buffer(ro, writable_copy=False, dtype=torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.data_ptr() != ro.ctypes.data
    t[0] = 1  # writable


def test_loads_private_uses_the_given_memory():
    t = torch.randn(100000)
    data, bufs = serialization.dumps(_Carry(t))
    private = [bytearray(b.raw()) for b in bufs]
    back = serialization.loads_private(data, private).t
    assert back.data_ptr() == addr(private[0]) and torch.equal(back, t)
    with pytest.raises(TypeError):
        serialization.loads_private(data, bufs)
    again = serialization.loads(data, private).t  # not private here: copied
    assert again.data_ptr() != addr(private[0]) and torch.equal(again, t)


# --- DataProto ------------------------------------------------------------------------------------


def big_batch(total_mib: int) -> DataProto:
    rows = 1024
    per_key = total_mib * MIB // 4
    return DataProto.from_dict(
        {
            "f32": torch.empty(rows, per_key // (4 * rows)),
            "bf16": torch.empty(rows, per_key // (2 * rows), dtype=torch.bfloat16),
            "i64": torch.empty(rows, per_key // (8 * rows), dtype=torch.int64),
        },
        {"score": np.zeros((rows, per_key // (8 * rows))), "text": np.array(["x" * 10] * rows, dtype=object)},
        {"step": 3},
    )


def test_256mib_batch_travels_out_of_band_without_copy():
    d = big_batch(256)
    bufs: list[pickle.PickleBuffer] = []
    data = pickle.dumps(d, protocol=5, buffer_callback=bufs.append)
    assert len(data) < MIB
    assert sum(b.raw().nbytes for b in bufs) >= 256 * MIB
    ptrs = {addr(b.raw()) for b in bufs}
    for key in ("f32", "bf16", "i64"):
        assert d.batch[key].data_ptr() in ptrs  # sent straight from the tensor's memory
    assert d.non_tensor_batch["score"].ctypes.data in ptrs
    del bufs  # receiving (one copy per buffer) is covered with smaller batches below


def test_chunk_serializes_only_its_rows():
    d = DataProto.from_dict({"x": torch.arange(40000.0).reshape(4, 10000)})
    part = d.chunk(4)[1]
    bufs: list[pickle.PickleBuffer] = []
    pickle.dumps(part, protocol=5, buffer_callback=bufs.append)
    assert [b.raw().nbytes for b in bufs] == [10000 * 4]
    assert addr(bufs[0].raw()) == d.batch["x"][1].data_ptr()


def test_two_receivers_are_isolated():
    d = DataProto.from_dict({"x": torch.zeros(100, 100)}, {"n": np.zeros((100, 100))})
    data, bufs = serialization.dumps(d)
    r1, r2 = serialization.loads(data, bufs), serialization.loads(data, bufs)
    r1.batch["x"].add_(1)
    r1.non_tensor_batch["n"] += 1
    assert r2.batch["x"].sum() == 0 and d.batch["x"].sum() == 0
    assert r2.non_tensor_batch["n"].sum() == 0 and d.non_tensor_batch["n"].sum() == 0


def test_object_columns_in_band():
    col = np.empty(3, dtype=object)
    col[:] = [{"a": 1}, None, [1, 2]]
    assert isinstance(serialization.reduce_ndarray(col), serialization.PickledArray)
    d = DataProto(non_tensor_batch={"o": col})
    data, bufs = serialization.dumps(d)
    assert bufs == []
    assert list(serialization.loads(data, bufs).non_tensor_batch["o"]) == [{"a": 1}, None, [1, 2]]


def test_huge_first_dim_with_zero_size_trailing_dims():
    n = 1 << 40
    d = DataProto.from_dict({"t": torch.empty(n, 0, dtype=torch.bfloat16)}, {"c": np.empty((n, 0))})
    back = serialization.loads(*serialization.dumps(d))
    assert len(back) == n and back.batch["t"].shape == (n, 0) and back.non_tensor_batch["c"].shape == (n, 0)
    parts = d.chunk(4)
    assert [len(p) for p in parts] == [n // 4] * 4
    assert len(DataProto.concat(parts)) == n
    assert len(d.repeat(2, interleave=True)) == 2 * n and len(d.repeat(3, interleave=False)) == 3 * n
    assert len(d[5:]) == n - 5 and d.pad_to_divisor(8)[1] == 0


def test_no_reference_cycles_keep_tensors_alive():
    """Received batches must be freed by reference counting alone (big buffers, see bench)."""
    gc.disable()
    try:
        d = DataProto.from_dict({"x": torch.zeros(300, 300), "y": torch.ones(300)}, {"n": np.zeros(300)})
        outs = [
            serialization.loads(*serialization.dumps(d)),
            DataProto.concat(d.chunk(3)),
            d.repeat(2, interleave=False),
            d.pad_to_divisor(7)[0],
        ]
        refs = [weakref.ref(o.batch["x"]) for o in outs]
        del outs
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_big_concat_matches_torch_cat(dtype):
    x = (torch.randn(64, 40000) * 10).to(dtype)  # >= 4 MiB output: numpy-allocated path
    parts = [x[:10], x[10:40], x[40:]]
    got = DataProto.concat([DataProto.from_dict({"x": p}) for p in parts]).batch["x"]
    assert got.dtype == dtype and torch.equal(bits(got), bits(torch.cat(parts)))
    got.add_(1) if dtype != torch.bool else got.logical_not_()  # writable, owns its memory
    assert torch.equal(bits(parts[0]), bits(x[:10]))


# --- Ray ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_local(ray_session):
    """The session's Ray (tests/conftest.py): one Ray per test process, never re-initialized."""
    import ray

    return ray


@pytest.mark.parametrize("total_mib", [0, 16], ids=["inline", "plasma"])
def test_ray_round_trip_is_writable_and_isolated(ray_local, total_mib):
    ray = ray_local
    small = DataProto.from_dict({"x": torch.zeros(4, 2)}, {"n": np.zeros(4)}, {"k": 1})
    d = big_batch(total_mib) if total_mib else small
    ref = ray.put(d)
    r1, r2 = ray.get(ref), ray.get(ref)
    for key in d.batch.keys():
        assert torch.equal(bits(r1.batch[key]), bits(d.batch[key]))  # torch.empty may hold NaNs
        r1.batch[key].view(-1)[:1].view(torch.uint8).bitwise_not_()  # writable: flip the first element
        assert torch.equal(bits(r2.batch[key]), bits(d.batch[key]))
        assert not torch.equal(bits(r1.batch[key]), bits(d.batch[key]))
    n = next(k for k, v in d.non_tensor_batch.items() if v.dtype != object)
    r1.non_tensor_batch[n][...] = 7
    assert not np.any(r2.non_tensor_batch[n] == 7) and not np.any(d.non_tensor_batch[n] == 7)
    assert r1.meta_info == d.meta_info
    key = next(iter(d.batch.keys()))
    assert torch.equal(bits(ray.get(ref).batch[key]), bits(d.batch[key]))


def test_ray_future_routes_only_needed_parts(ray_local):
    from rankmesh.backends.ray.waiting import fetch_refs  # the Ray backend's fetch (data knows no Ray)

    ray = ray_local
    parts = [DataProto.from_dict({"i": torch.arange(3) + 3 * r}, meta_info={"metrics": {"r": r}}) for r in range(4)]
    refs = [ray.put(p) for p in parts]
    fut = DataProtoFuture.from_parts(refs, fetch_refs, rows=[3] * 4, pad_size=2)
    assert len(fut) == 10
    first, second = fut.chunk(2)
    assert first.handles == refs[:2] and second.handles == refs[1:]
    moved = ray.get(ray.put(second))  # futures travel through Ray (nested ObjectRefs)
    assert moved.get().batch["i"].tolist() == [5, 6, 7, 8, 9]
    assert fut.get().meta_info["metrics"] == {"r": [0, 1, 2, 3]}
    assert DataProtoFuture.concat(refs, fetch=fetch_refs).get().batch["i"].tolist() == list(range(12))
    with pytest.raises(DataProtoError, match="fetch="):  # raw handles need the backend's fetch
        DataProtoFuture.concat(refs)


def test_borrow_receive_skips_the_receive_copy_only_inside_the_block():
    """The controller's concat path: rebuilds borrow shared buffers; everywhere else they copy."""
    from rankmesh import serialization as ser
    from rankmesh.data import DataProto

    src = DataProto.from_dict({"x": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)})
    data, buffers = ser.dumps(src)
    ptr = src.batch["x"].data_ptr()
    with ser.receiving("borrow"):
        borrowed = ser.loads(data, buffers)
    assert borrowed.batch["x"].data_ptr() == ptr  # no copy: a read-only view of the sender's bytes
    joined = DataProto.concat([borrowed])
    assert joined.batch["x"].data_ptr() != ptr and torch.equal(joined.batch["x"], src.batch["x"])
    private = ser.loads(data, buffers)
    assert private.batch["x"].data_ptr() != ptr
    private.batch["x"][0, 0] = -1.0
    assert src.batch["x"][0, 0] == 0.0


def _shared_batch_pickle(nbytes: int):
    """A one-column batch pickled out of band, its buffers in an in-process shared file (as
    ``ray.get`` maps them), and the column."""
    from rankmesh import sharedmem

    src = torch.arange(nbytes // 8, dtype=torch.int64).reshape(64, -1)
    data, buffers = serialization.dumps(DataProto.from_dict({"x": src}))
    assert len(buffers) == 1
    store = sharedmem.SharedFile([b.raw() for b in buffers])
    return src, data, store


def test_copy_receive_copies_where_copy_on_write_would_map_and_says_why():
    """``receiving("copy")`` (a method declaring receive="copy"): the bytes that would have been a
    copy-on-write view are one private copy, counted with the declared reason; outside the block
    the same load maps them again."""
    from rankmesh import sharedmem

    src, data, store = _shared_batch_pickle(2 * MIB)
    before = sharedmem.receive_info()
    with serialization.receiving("copy"):
        copied = serialization.loads(data, store.views()).batch["x"]
    during = sharedmem.receive_info()
    viewed = serialization.loads(data, store.views()).batch["x"]
    after = sharedmem.receive_info()
    assert torch.equal(copied, src) and torch.equal(viewed, src)
    assert during["copies"] == before["copies"] + 1
    assert during["copied_bytes"] == before["copied_bytes"] + 2 * MIB
    assert during["cow_views"] == before["cow_views"]
    if before["fallback"] is None:  # the first fallback of this process is the one reported
        assert during["fallback"] == "the method or group declares receive='copy'"
    if sharedmem.receive_info()["mode"] != "copy":  # RANKMESH_RECEIVE=copy would copy both
        assert after["cow_views"] == during["cow_views"] + 1 and after["copies"] == during["copies"]
    copied[0, 0] = -1
    viewed[0, 1] = -1
    assert src[0, 0] == 0 and src[0, 1] == 1  # both are the receiver's own


def test_the_receive_choice_is_per_thread_and_ends_with_its_block():
    """The one receive setting is a context variable: another thread loading at the same time, or
    this thread after the block, rebuilds as usual (a private copy, never the sender's memory)."""
    import threading

    src = DataProto.from_dict({"x": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)})
    data, buffers = serialization.dumps(src)
    ptr = src.batch["x"].data_ptr()
    seen: list[int] = []
    with serialization.receiving("borrow"):
        other = threading.Thread(target=lambda: seen.append(serialization.loads(data, buffers).batch["x"].data_ptr()))
        other.start()
        other.join()
        assert serialization.loads(data, buffers).batch["x"].data_ptr() == ptr
        with serialization.receiving("cow"):  # nested: the inner choice wins, then the outer is back
            assert serialization.loads(data, buffers).batch["x"].data_ptr() != ptr
        assert serialization.loads(data, buffers).batch["x"].data_ptr() == ptr
    assert seen and seen[0] != ptr
    assert serialization.loads(data, buffers).batch["x"].data_ptr() != ptr


def test_an_unknown_receive_choice_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"receiving\(how\) must be one of \('cow', 'copy', 'borrow'\), got 'view'"):
        with serialization.receiving("view"):
            pass
