"""Copy-on-write receive (rankmesh.sharedmem) and its fallback, on real shared memory and real Ray.

What is proven: a received piece is the stored bytes, writable; a write changes only the writer's
pages (the other replicas, the controller and the stored object keep the original); untouched
pages are not copied (counted in /proc/self/smaps, an independent source); a kept view survives
the object being freed and its memory reused; the forced fallback (``RANKMESH_RECEIVE=copy``)
gives the same isolation with a full copy; ``wg.transport_info()`` says which path each rank took.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from rankmesh import serialization, sharedmem

MiB = 1 << 20


def copied_kib(addr: int, size: int) -> int:
    """KiB of anonymous (copied) pages in this process's mappings over ``[addr, addr + size)``.

    From /proc/self/smaps.  A copy-on-write page the process wrote becomes anonymous; pages it
    only reads stay the shared file's pages.  A plain copy (numpy's own memory) is anonymous
    throughout.  Mappings are counted whole (numpy's huge-page advice may split one in parts).
    """
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    inside = False
    total = 0
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + size and addr < hi
            continue
        if inside and head == "Anonymous:":
            total += int(line.split()[1])
    return total


@pytest.fixture
def shm_file(tmp_path):
    """A 4 MiB file in shared memory (/dev/shm, like Ray's object store), mapped shared read-only."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"rankmesh-test-{os.getpid()}")
    data = (np.arange(4 * MiB, dtype=np.uint64) % 251).astype(np.uint8)
    data.tofile(path)
    # Mapped with libc's mmap, not Python's (which keeps a dup of the fd open): afterwards this
    # process holds no fd of the file, as a Ray worker holds none of the object store's.
    fd = os.open(path, os.O_RDONLY)
    addr = _libc.mmap(None, 4 * MiB, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    shared = memoryview((ctypes.c_char * (4 * MiB)).from_address(addr)).cast("B").toreadonly()
    yield path, shared, data
    shared.release()
    os.unlink(path)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


@pytest.fixture
def mode():
    before = sharedmem._STATE.mode
    yield sharedmem.set_receive_mode
    sharedmem._STATE.mode = before


def test_private_bytes_is_copy_on_write(shm_file, mode):
    mode("auto")
    path, shared, expected = shm_file
    before = sharedmem.receive_info()
    view = sharedmem.private_bytes(shared[MiB:3 * MiB])
    assert sharedmem.receive_info()["cow_views"] == before["cow_views"] + 1
    assert view.flags.writeable and np.array_equal(view, expected[MiB:3 * MiB])
    assert copied_kib(view.ctypes.data, view.nbytes) == 0  # nothing copied yet
    view[5] = 99
    view[MiB + 7] = 98
    dirty = copied_kib(view.ctypes.data, view.nbytes)
    assert 0 < dirty <= 2 * 64  # two written pages (huge pages at most), not 2 MiB
    assert shared[MiB + 5] == expected[MiB + 5]  # the shared bytes are untouched ...
    assert np.fromfile(path, dtype=np.uint8)[MiB + 5] == expected[MiB + 5]  # ... and so is the file
    assert view[6] == expected[MiB + 6]


def _reset_fds():
    sharedmem._STATE.fds.clear()
    sharedmem._STATE.how.clear()
    sharedmem._STATE.unreachable.clear()


def test_unprivileged_route_through_the_store_process(shm_file, mode, monkeypatch):
    """``procfd``: the file is found through the store process's fd, as an ordinary user must.

    A subprocess keeps the file open, as Ray's raylet does; it counts only once registered as a
    store process (the Ray backend registers the raylet), never by scanning every process.
    """
    mode("procfd")
    path, shared, expected = shm_file
    keeper = subprocess.Popen([sys.executable, "-c", f"import sys; f = open({path!r}, 'rb'); sys.stdin.read()"],
                              stdin=subprocess.PIPE)
    monkeypatch.setattr(sharedmem._STATE, "store_pids", set())
    try:
        for _ in range(100):  # wait until the keeper has the file open
            if any(os.readlink(f"/proc/{keeper.pid}/fd/{n}") == path for n in os.listdir(f"/proc/{keeper.pid}/fd")):
                break
            time.sleep(0.05)
        _reset_fds()
        before = sharedmem.receive_info()["copies"]
        view = sharedmem.private_bytes(shared[:2 * MiB])  # not registered: not looked at
        assert sharedmem.receive_info()["copies"] == before + 1
        _reset_fds()
        sharedmem.register_store_processes([keeper.pid])
        view = sharedmem.private_bytes(shared[:2 * MiB])
        assert sharedmem.receive_info()["fd_source"] == [f"proc_fd:{keeper.pid}"]
        view[:] = 1
        assert np.array_equal(np.asarray(shared[:2 * MiB]), expected[:2 * MiB])
    finally:
        keeper.communicate(b"")
        _reset_fds()


def test_route_through_this_process_fd(shm_file, mode):
    """A file this process itself holds open is found in /proc/self/fd, with no other process."""
    mode("procfd")
    path, shared, expected = shm_file
    fd = os.open(path, os.O_RDONLY)
    try:
        _reset_fds()
        view = sharedmem.private_bytes(shared[:2 * MiB])
        assert sharedmem.receive_info()["fd_source"] == ["self_fd"]
        view[:] = 3
        assert np.array_equal(np.asarray(shared[:2 * MiB]), expected[:2 * MiB])
    finally:
        os.close(fd)
        _reset_fds()


def test_forced_fallback_copies_and_says_why(shm_file, mode):
    mode("copy")
    _, shared, expected = shm_file
    before = sharedmem.receive_info()
    view = sharedmem.private_bytes(shared[:2 * MiB])
    info = sharedmem.receive_info()
    assert info["copies"] == before["copies"] + 1 and info["copied_bytes"] == before["copied_bytes"] + 2 * MiB
    assert info["fallback"] is not None
    assert copied_kib(view.ctypes.data, view.nbytes) >= 2 * 1024  # a full private copy
    view[:] = 0
    assert np.array_equal(np.asarray(shared[:2 * MiB]), expected[:2 * MiB])


def test_private_memory_falls_back_to_a_copy(mode):
    mode("auto")
    src = np.arange(MiB, dtype=np.float32)
    view = sharedmem.private_bytes(memoryview(src).cast("B").toreadonly())
    assert view.ctypes.data != src.ctypes.data
    view[:] = 0
    assert src[1] == 1.0


# ----- Ray: replicas of one piece ---------------------------------------------------------------

ray = pytest.importorskip("ray")

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.backends.local import LocalWorkerGroup  # noqa: E402
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402


class Writer(Worker):
    """Keeps its piece, writes into it in place, reports what it sees and what it cost."""

    def __init__(self) -> None:
        self.kept: DataProto | None = None

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def keep(self, data: DataProto) -> DataProto:
        self.kept = data
        return data

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def echo_later(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.ONE_TO_ALL)
    def write_own_rank(self) -> None:
        """Every rank writes its rank + 1 into the first row of its piece (one page)."""
        self.kept.batch["x"][0, :] = float(self.rank + 1)

    @register(Dispatch.ONE_TO_ALL)
    def write_all(self) -> None:
        self.kept.batch["x"].add_(float(self.rank + 1))

    @register(Dispatch.ONE_TO_ALL)
    def look(self) -> dict:
        x = self.kept.batch["x"]
        dirty = copied_kib(x.data_ptr(), x.numel() * 4)
        return {"first": float(x[0, 0]), "second_row": float(x[1, 0]), "sum": float(x.double().sum()),
                "writable": bool(x.numpy().flags.writeable), "dirty_kib": dirty}


def _batch(mib: int) -> DataProto:
    rows = 64
    x = torch.arange(rows, dtype=torch.float32).repeat_interleave(mib * MiB // 4 // rows).reshape(rows, -1)
    return DataProto.from_dict({"x": x})


@pytest.fixture(scope="module", params=["auto", "copy"])
def writer_group(request, ray_session):
    pool = RayResourcePool([4], use_gpu=False)
    init = RayClassWithInitArgs(Writer)
    init.update_options({"runtime_env": {"env_vars": {sharedmem.RECEIVE_ENV: request.param}}})
    # Copy-on-write from Ray's object store is a Ray actor's receive (a forked rank's inputs come
    # through its holder as private copies).
    wg = RayWorkerGroup(pool, init, mesh=RankMesh(tp=2, dp=2), process_model="ray")
    yield request.param, wg
    wg.shutdown()


def test_every_replica_writes_waits_and_reads_back(writer_group):
    receive, wg = writer_group
    batch = _batch(8)  # 4 MiB per dp piece, each shared by the two tp ranks of a replica
    original = batch.batch["x"].clone()
    out = wg.keep(batch)
    assert torch.equal(out.batch["x"], original)
    wg.write_own_rank()
    seen = wg.look()  # every rank wrote, then every rank reads back
    half = original.shape[0] // 2
    for rank, s in enumerate(seen):
        dp = rank // 2
        assert s["first"] == rank + 1  # its own write ...
        assert s["second_row"] == float(original[dp * half + 1, 0])  # ... and nothing else changed
        assert s["writable"]
    assert torch.equal(batch.batch["x"], original)  # the caller's batch is untouched
    assert torch.equal(out.batch["x"], original)  # and so is the output fetched before
    info = wg.transport_info()
    if receive == "copy":
        assert all(i["path"] == "copy" and i["fallback"] for i in info)
        assert all(s["dirty_kib"] >= 4 * 1024 for s in seen), [s["dirty_kib"] for s in seen]  # every rank copied its whole piece
    else:
        assert all(i["path"] == "cow" and i["fallback"] is None for i in info), info
        assert all(s["dirty_kib"] <= 2 * 1024 for s in seen), [s["dirty_kib"] for s in seen]  # one row (16 KiB) written, not 4 MiB


def test_whole_input_writes_stay_private(writer_group):
    _, wg = writer_group
    batch = _batch(8)
    original = batch.batch["x"].clone()
    wg.keep(batch)
    wg.write_all()
    half = original.shape[0] // 2
    for rank, s in enumerate(wg.look()):
        piece = original[(rank // 2) * half:(rank // 2 + 1) * half].double()
        assert s["sum"] == pytest.approx(float((piece + rank + 1).sum()))
    assert torch.equal(batch.batch["x"], original)


def test_kept_view_survives_the_object_being_freed(writer_group):
    """The view pins the stored object: filling the store afterwards never changes it."""
    _, wg = writer_group
    batch = _batch(8)
    original = batch.batch["x"].clone()
    wg.keep(batch)
    before = wg.look()
    import gc

    gc.collect()
    junk = [ray.put(np.full(16 * MiB, 255, dtype=np.uint8)) for _ in range(12)]
    del junk
    gc.collect()
    half = original.shape[0] // 2
    after = wg.look()
    assert after == before
    assert [a["sum"] for a in after] == [pytest.approx(float(original[(r // 2) * half:(r // 2 + 1) * half].double().sum()))
                                         for r in range(4)]


def test_local_backend_isolation():
    wg = LocalWorkerGroup(Writer, mesh=RankMesh(tp=2, dp=2))
    batch = _batch(2)
    original = batch.batch["x"].clone()
    wg.keep(batch)
    wg.write_own_rank()
    for rank, s in enumerate(wg.look()):
        assert s["first"] == rank + 1
        assert s["second_row"] == float(original[(rank // 2) * 32 + 1, 0])
    assert torch.equal(batch.batch["x"], original)


def test_future_with_several_parts_receives_without_a_copy(writer_group):
    """The controller's DataProtoFuture.get() of 2 parts: no receive copy, only concat's."""
    receive, wg = writer_group
    if receive != "auto":
        pytest.skip("the controller's receive path is this process's, not the group's")
    batch = _batch(8)
    future = wg.echo_later(batch)
    before = sharedmem.receive_info()
    out = future.get()
    after = sharedmem.receive_info()
    assert torch.equal(out.batch["x"], batch.batch["x"])
    assert after["copies"] == before["copies"]  # nothing copied on receive ...
    assert after["cow_views"] - before["cow_views"] == 2, (before, after)  # ... two copy-on-write parts
    out.batch["x"][0, 0] = -1.0  # the result is the caller's own
    assert float(future.get().batch["x"][0, 0]) == float(batch.batch["x"][0, 0])


def proto_of(arr: np.ndarray) -> DataProto:
    """A one-column DataProto over ``arr``'s memory (no copy): tensors pickle out of band."""
    return DataProto.from_dict({"x": torch.from_numpy(arr).view(-1, 1024)})


def test_unwritten_view_is_serialized_from_the_shared_original(shm_file, mode):
    """An output that is a received view nobody wrote goes out from the store's own mapping; once
    a page is written, from the private mapping (the written bytes live only there)."""
    mode("auto")
    path, shared, expected = shm_file
    view = sharedmem.private_bytes(shared[MiB:3 * MiB])
    shared_addr = np.frombuffer(shared, dtype=np.uint8).ctypes.data + MiB
    assert sharedmem.written_pages(view.ctypes.data, view.nbytes) == 0
    before = sharedmem.receive_info()["sent_shared"]
    data, buffers = serialization.dumps(proto_of(view))
    assert np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data == shared_addr  # the original, not the view
    assert sharedmem.receive_info()["sent_shared"] == before + 1
    assert np.array_equal(serialization.loads(data, buffers).batch["x"].numpy().reshape(-1), expected[MiB:3 * MiB])

    view[MiB + 5] = 99  # one page of the second MiB written
    assert sharedmem.written_pages(view.ctypes.data, view.nbytes) == 1
    data, buffers = serialization.dumps(proto_of(view))
    assert np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data == view.ctypes.data  # the private mapping
    got = serialization.loads(data, buffers).batch["x"].numpy().reshape(-1)
    want = expected[MiB:3 * MiB].copy()
    want[MiB + 5] = 99
    assert np.array_equal(got, want)
    assert shared[2 * MiB + 5] == expected[2 * MiB + 5]  # the write stayed private
    # The unwritten first MiB alone still goes out from the original.
    data, buffers = serialization.dumps(proto_of(view[:MiB]))
    assert np.frombuffer(buffers[0], dtype=np.uint8).ctypes.data == shared_addr
    assert np.array_equal(serialization.loads(data, buffers).batch["x"].numpy().reshape(-1), expected[MiB:2 * MiB])


def test_a_process_that_received_only_small_inputs_reports_the_inline_path():
    # A fresh process: nothing mapped, nothing copied; the path says why rather than None.
    import subprocess
    import sys

    code = "from rankmesh.sharedmem import receive_info; i = receive_info(); print(i['path'], i['cow_views'], i['copies'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["inline", "0", "0"]
