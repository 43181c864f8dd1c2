"""Isolation and copy counts on every receive path and both backends.

Paths: ``auto`` (copy-on-write views; as root through /proc/self/map_files), ``procfd`` (the
unprivileged route: the object store's fd from the raylet, or the in-process store's own fd)
and ``copy`` (the forced fallback, ``RANKMESH_RECEIVE=copy``); each with the method declaring
``receive="cow"`` (default) or ``receive="copy"``.  Backends: Ray (4 worker processes, tp2·dp2)
and in-process.  Expected values come from numpy on the caller's own copy of the batch; copies
are counted by the receive counters and, independently, by /proc/self/smaps (a written or
copied page is anonymous memory, a copy-on-write page not yet written is not).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankmesh import sharedmem
from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.data import DataProto
from rankmesh.dispatch import Dispatch, register
from rankmesh.mesh import RankMesh
from rankmesh.worker import Worker

ray = pytest.importorskip("ray")

from rankmesh.backends.ray import RayClassWithInitArgs, RayWorkerGroup  # noqa: E402

MiB = 1 << 20
MESH = RankMesh(tp=2, dp=2)


def anonymous_kib(addr: int, size: int) -> int:
    """KiB of anonymous pages in this process's mappings overlapping ``[addr, addr + size)``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + size and addr < hi
            elif inside and head == "Anonymous:":
                total += int(line.split()[1])
    return total


class Inplace(Worker):
    """Keeps its input, writes into it in place on request, reports what it sees."""

    def __init__(self) -> None:
        self.kept: DataProto | None = None

    @register(Dispatch.ONE_TO_ALL)
    def force(self, mode: str) -> dict:
        sharedmem.set_receive_mode(mode)
        return sharedmem.receive_info()

    @register(Dispatch.ONE_TO_ALL)
    def info(self) -> dict:
        return sharedmem.receive_info()

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def keep(self, data: DataProto) -> DataProto:
        self.kept = data
        return data

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, receive="copy")
    def keep_copy(self, data: DataProto) -> DataProto:
        self.kept = data
        return data

    @register(Dispatch.MEGATRON_COMPUTE_PROTO, blocking=False)
    def echo_later(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.ONE_TO_ALL)
    def write(self, how: str, value: int) -> None:
        """``row``: row 0 of every tensor := value + rank; ``all``: every element += value + rank."""
        for t in self.kept.batch.values():
            if how == "row":
                t[0] = value + self.rank
            else:
                t.add_(value + self.rank)

    @register(Dispatch.ONE_TO_ALL)
    def look(self) -> dict:
        out = {k: t.clone() for k, t in self.kept.batch.items()}
        x = self.kept.batch["x"]
        out["_dirty_kib"] = anonymous_kib(x.data_ptr(), x.numel() * x.element_size())
        return out

    @register(Dispatch.ONE_TO_ALL)
    def big(self, mib: int) -> DataProto:
        return DataProto.from_dict({"x": torch.full((4, mib * MiB // 16), float(self.rank))})

    @register(Dispatch.ONE_TO_ALL)
    def to_device_report(self) -> dict:
        """Move the kept batch to this rank's device as MegatronWorker does; count host copies."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = self.kept.batch["x"]
        before = sharedmem.receive_info()["copies"]
        moved = self.kept.to(device)
        return {
            "device": device,
            "host_copies": sharedmem.receive_info()["copies"] - before,
            "equal": bool(torch.equal(moved.batch["x"].cpu(), x)),
            "dirty_kib": anonymous_kib(x.data_ptr(), x.numel() * x.element_size()),
        }

    @register(Dispatch.ONE_TO_ALL)
    def give_kept(self) -> DataProto:
        return self.kept

    @register(Dispatch.ONE_TO_ALL)
    def sum_kept(self) -> float:
        return float(self.kept.batch["x"].double().sum())


# The Ray group comes from the session's host bank (requested by name below, so declared here).
pytestmark = pytest.mark.usefixtures("host_bank")


@pytest.fixture(scope="module")
def ray_group(host_bank):
    # Ranks in Ray actors: they map Ray's store, which is what these receive paths are about (a
    # forked rank's objects come through its holder, as private copies).
    wg = host_bank.build(RayClassWithInitArgs(Inplace), MESH, process_model="ray")
    yield wg
    host_bank.give_back(wg)


@pytest.fixture(scope="module")
def local_group():
    return LocalWorkerGroup(Inplace, mesh=MESH)


@pytest.fixture(params=["ray", "local"])
def backend(request):
    return request.param


@pytest.fixture(params=["auto", "procfd", "copy"])
def path(request):
    return request.param


@pytest.fixture
def group(backend, path, request):
    """The backend's group with every rank (and, in-process, this process) on ``path``."""
    wg = request.getfixturevalue(f"{backend}_group")
    before = sharedmem._STATE.mode
    wg.force(path)
    yield wg
    wg.force("auto")
    sharedmem.set_receive_mode(before)


def batch_of(rows: int, cols: int, dtype=torch.float32) -> DataProto:
    x = torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols).to(dtype)
    return DataProto.from_dict({"x": x})


def piece(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The rows rank ``rank`` of the tp2·dp2 mesh holds (dp index = rank // 2)."""
    half = x.shape[0] // 2
    dp = rank // 2
    return x[dp * half:(dp + 1) * half]


@pytest.mark.parametrize("declared", ["cow", "copy"])
def test_every_replica_writes_waits_and_reads_back(group, path, declared):
    batch = batch_of(64, 16 * 1024)  # 4 MiB; 2 MiB per dp piece, two tp replicas each
    original = batch.batch["x"].clone()
    before = group.info()
    out = (group.keep_copy if declared == "copy" else group.keep)(batch)
    assert torch.equal(out.batch["x"], original)
    group.write("row", 100)  # every replica writes ...
    seen = group.look()  # ... waits for the others (a group call is a barrier) and reads back
    for rank, s in enumerate(seen):
        expected = piece(original, rank).clone()
        expected[0] = 100.0 + rank
        assert torch.equal(s["x"], expected), rank
    group.write("all", 1)  # now every replica writes its whole input
    for rank, s in enumerate(group.look()):
        expected = piece(original, rank).clone()
        expected[0] = 100.0 + rank
        expected += 1.0 + rank
        assert torch.equal(s["x"], expected), rank
    assert torch.equal(batch.batch["x"], original)  # the caller's batch ...
    assert torch.equal(out.batch["x"], original)  # ... and the output fetched before are untouched
    after = group.info()
    grew = [(a["cow_views"] - b["cow_views"], a["copies"] - b["copies"]) for a, b in zip(after, before)]
    if isinstance(group, LocalWorkerGroup):
        grew = [grew[0]]  # one process: the counters are shared by the ranks
    if path == "copy" or declared == "copy":
        # one private copy per rank; the forced fallback never makes a view at all
        assert all(copies >= 1 for _, copies in grew), grew
        if path == "copy":
            assert all(views == 0 for views, _ in grew), grew
    else:
        assert all(views >= 1 and copies == 0 for views, copies in grew), grew


def test_outputs_nobody_wrote_go_out_from_the_shared_original(group, path):
    """A rank returning its received view unwritten serializes it from the object store's mapping
    (counted by ``sent_shared``); after a write, from its private pages: the output shows the write."""
    batch = batch_of(64, 16 * 1024)  # 2 MiB pieces: above the copy-on-write threshold
    original = batch.batch["x"].clone()
    before = group.info()
    out = group.keep(batch)  # collect ranks (tp 0: ranks 0 and 2) return their pieces unwritten
    assert torch.equal(out.batch["x"], original)
    sent = [a["sent_shared"] - b["sent_shared"] for a, b in zip(group.info(), before)]
    if isinstance(group, RayWorkerGroup):
        if path == "copy":
            assert sent == [0, 0, 0, 0]  # private copies: nothing shared to send from
        else:
            assert sent[0] >= 1 and sent[2] >= 1 and sent[1] == sent[3] == 0, sent
    group.write("row", 50)
    before = group.info()
    for rank, got in enumerate(group.give_kept()):
        expected = piece(original, rank).clone()
        expected[0] = 50.0 + rank
        assert torch.equal(got.batch["x"], expected), rank
    if isinstance(group, RayWorkerGroup):
        assert [a["sent_shared"] - b["sent_shared"] for a, b in zip(group.info(), before)] == [0, 0, 0, 0]


def test_untouched_pages_are_not_copied(group, path):
    """On the copy-on-write paths a rank that writes one row holds one row of private pages."""
    batch = batch_of(64, 16 * 1024)
    group.keep(batch)
    group.write("row", 7)
    dirty = [s["_dirty_kib"] for s in group.look()]
    if isinstance(group, LocalWorkerGroup):
        pytest.skip("in-process ranks share one address space: smaps cannot tell ranks apart")
    if path == "copy":
        assert all(d >= 2 * 1024 for d in dirty), dirty  # whole 2 MiB pieces copied
    else:
        assert all(d <= 256 for d in dirty), dirty  # one 64 KiB row (fault-around at most), not 2 MiB


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    rows=st.sampled_from([2, 8, 64]),
    kib_per_row=st.sampled_from([1, 48, 96]),  # in-band, copied (small), copy-on-write pieces
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
    declared=st.sampled_from(["cow", "copy"]),
    how=st.sampled_from(["row", "all"]),
)
def test_in_place_writes_stay_private(group, rows, kib_per_row, dtype, declared, how):
    """Hypothesis: any size, dtype, declaration and write pattern leaves others' data alone."""
    cols = kib_per_row * 1024 // torch.tensor([], dtype=dtype).element_size()
    batch = batch_of(rows, cols, dtype)
    original = batch.batch["x"].clone()
    out = (group.keep_copy if declared == "copy" else group.keep)(batch)
    group.write(how, 3)
    for rank, s in enumerate(group.look()):
        expected = piece(original, rank).clone()
        if how == "row":
            expected[0] = 3 + rank
        else:
            expected += 3 + rank
        assert torch.equal(s["x"], expected), (rank, how)
    assert torch.equal(batch.batch["x"], original)
    assert torch.equal(out.batch["x"], original)


# ----- one copy on every path, counted --------------------------------------------------------


@pytest.fixture
def cow(backend, request):
    wg = request.getfixturevalue(f"{backend}_group")
    wg.force("auto")
    return wg


def test_blocking_call_copies_once(cow):
    """Workers receive views; the controller borrows the outputs and concat copies them once."""
    batch = batch_of(64, 16 * 1024)
    here = sharedmem.receive_info()
    ranks = cow.info()
    out = cow.keep(batch)
    assert torch.equal(out.batch["x"], batch.batch["x"])
    after = cow.info()
    if isinstance(cow, LocalWorkerGroup):
        # in-process: each rank's view (4), then the fetch copies each collected output once
        assert after[0]["cow_views"] - ranks[0]["cow_views"] == 4
    else:
        assert [a["copies"] - b["copies"] for a, b in zip(after, ranks)] == [0] * 4
        assert [a["cow_views"] - b["cow_views"] for a, b in zip(after, ranks)] == [1] * 4
        now = sharedmem.receive_info()
        assert (now["copies"], now["cow_views"]) == (here["copies"], here["cow_views"])  # borrowed, then concat


def test_future_handed_to_another_group_is_received_once(cow, backend, request):
    """A future of group A passed to group B: B's ranks fetch the parts as views; the controller nothing."""
    batch = batch_of(64, 16 * 1024)
    future = cow.echo_later(batch)
    here = sharedmem.receive_info()
    ranks = cow.info()
    cow.keep(future)
    assert cow.sum_kept() == [pytest.approx(float(piece(batch.batch["x"], r).double().sum())) for r in range(4)]
    after = cow.info()
    if backend == "ray":
        assert [a["copies"] - b["copies"] for a, b in zip(after, ranks)] == [0] * 4
        assert all(a["cow_views"] > b["cow_views"] for a, b in zip(after, ranks))
        now = sharedmem.receive_info()
        assert now["copies"] == here["copies"]


def test_list_and_single_outputs_arrive_as_views(cow, backend):
    """``execute_all`` (a list) and ``execute_rank_zero`` (one output): no copy on receive."""
    if backend == "local":
        pytest.skip("in-process outputs are deep-copied on fetch (the worker keeps its own object)")
    here = sharedmem.receive_info()
    outs = [o.batch["x"] for o in cow.big(2)]
    assert [float(o[0, 0]) for o in outs] == [0.0, 1.0, 2.0, 3.0]
    one = cow.execute_rank_zero("big", 2).batch["x"]
    assert float(one[-1, -1]) == 0.0
    now = sharedmem.receive_info()
    assert now["copies"] == here["copies"]
    assert now["cow_views"] - here["cow_views"] == 5
    assert all(anonymous_kib(o.data_ptr(), 2 * MiB) == 0 for o in outs)  # no private page yet
    outs[1][0, 0] = -1.0  # writable, and the write stays in this process
    assert float(cow.big(2)[1].batch["x"][0, 0]) == 1.0


def test_in_process_share_is_one_copy_not_one_per_rank(local_group):
    """In-process: one copy into the shared store, then copy-on-write views per rank."""
    local_group.force("auto")
    batch = batch_of(64, 16 * 1024)
    before = sharedmem.receive_info()
    local_group.keep(batch)
    after = sharedmem.receive_info()
    assert after["cow_views"] - before["cow_views"] == 4  # 4 ranks, 4 views
    assert after["copies"] == before["copies"]  # and no per-rank copy


def test_to_device_reads_the_shared_bytes(cow):
    """``DataProto.to(device)`` on a received batch copies nothing on the host first."""
    batch = batch_of(64, 16 * 1024)
    cow.keep(batch)
    moved = cow.to_device_report()
    for r in moved:
        assert r["host_copies"] == 0, r
        assert r["equal"]
        assert r["dirty_kib"] == 0 or isinstance(cow, LocalWorkerGroup)
