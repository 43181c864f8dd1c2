"""What of the CUDA IPC refit and the pinned receive can be checked without a GPU.

The route rule of a (source, destination) pair (:func:`rankmesh.reshard.run.pair_route`), the
jobs it makes (:func:`~rankmesh.reshard.run.build_jobs`), the refusal of
``transport="cuda_ipc"`` between CPU tensors, the page arithmetic of the read-only host
registration (:func:`rankmesh.data.receive.page_spans`) and the pinned receive's fallback and
re-pointing on real copy-on-write views.  Expected values are derived by hand (page arithmetic,
rank pairs) or from numpy on the test's own copy, never from the code under test.  The device
side (bytes arriving through IPC, the registration itself) is ``scripts/check_gpu_refit.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rankmesh import sharedmem
from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.data import DataProto
from rankmesh.data.receive import page_spans, pinned, reading_shared, shared_originals, to_device
from rankmesh.errors import ReshardError
from rankmesh.mesh import RankMesh
from rankmesh.reshard import ParamLayout, plan_reshard, reshard
from rankmesh.reshard.run import build_jobs, pair_route
from rankmesh.reshard.worker import TensorPlace, tensor_place
from tests.reshard_workers import ShardHolder
from tests.test_cow_receive import copied_kib, mode, shm_file  # noqa: F401 - fixtures reused

MiB = 1 << 20
GPU_A = "4b04ee3e-2ae6-e7b1-5a3a-88a122e84198"
GPU_B = "207f3e0f-c24b-2a5d-b463-cb71cf50c36c"


# ----- which route a pair takes ---------------------------------------------------------------------


def cuda(pid: int, uuid: str = GPU_A, index: int = 0) -> TensorPlace:
    return TensorPlace(pid, f"cuda:{index}", uuid)


CPU_PLACE = TensorPlace(12, "cpu")


@pytest.mark.parametrize("src, dst, same_node, refused, want", [
    # one physical GPU, two processes: IPC, whatever each process calls the device
    (cuda(10), cuda(11), True, False, "ipc"),
    (cuda(10, index=0), cuda(11, index=3), True, False, "ipc"),
    # two GPUs, or a CPU side, on one node: the process read (the source's CUDA regions then go by the store)
    (cuda(10, GPU_A), cuda(11, GPU_B), True, False, "direct"),
    (cuda(10), CPU_PLACE, True, False, "direct"),
    (CPU_PLACE, cuda(11), True, False, "direct"),
    (TensorPlace(10, "mixed"), cuda(11), True, False, "direct"),
    # one process cannot open its own handle
    (cuda(10), cuda(10), True, False, "direct"),
    # other node, or a pair that failed before: the store
    (cuda(10), cuda(11), False, False, "store"),
    (cuda(10), cuda(11), True, True, "store"),
    # not asked (None): never IPC
    (None, None, True, False, "direct"),
])
def test_auto_routes_a_pair_by_gpu_uuid(src, dst, same_node, refused, want) -> None:
    assert pair_route("auto", (0, 1), same_node, src, dst, refused) == want


def test_store_routes_every_pair_through_the_store() -> None:
    assert pair_route("store", (0, 1), True, cuda(10), cuda(11)) == "store"


def test_cuda_ipc_takes_a_pair_on_one_gpu_and_names_any_other() -> None:
    assert pair_route("cuda_ipc", (2, 5), True, cuda(10), cuda(11, index=1)) == "ipc"
    with pytest.raises(ReshardError, match=r"source rank 3 -> destination rank 1 cannot use CUDA IPC: source on cpu"
                                           r".*transport='auto'"):
        pair_route("cuda_ipc", (3, 1), True, CPU_PLACE, cuda(11))
    with pytest.raises(ReshardError, match=r"source rank 0 -> destination rank 2 .*on different nodes"):
        pair_route("cuda_ipc", (0, 2), False, cuda(10), cuda(11))


def test_a_cpu_rank_reports_no_gpu() -> None:
    assert tensor_place({"w": torch.zeros(2)}) == TensorPlace(os.getpid(), "cpu", None)
    assert tensor_place({}) == TensorPlace(os.getpid(), "cpu", None)


def test_ipc_pairs_travel_as_handles_not_objects() -> None:
    """tp2 -> dp2, every pair through IPC: nothing is put; each source shares its shard whole and
    each destination copies from both sources (a replicated 8x4 float32 from rank 0 alone)."""
    layouts = [ParamLayout("w", (8, 4), tp_dim=0), ParamLayout("b", (8, 4))]
    plan = plan_reshard(layouts, RankMesh(tp=2), RankMesh(dp=2))
    pairs = frozenset((t.src_rank, t.dst_rank) for t in plan.transfers)
    jobs = build_jobs(plan, frozenset(), ipc=pairs)
    assert jobs.n_objects == 0 and jobs.bytes_put == 0
    assert all(not s.objects and not s.direct for s in jobs.sends)
    assert all(not r.objects and not r.direct for r in jobs.recvs)
    # each destination keeps all of w (2 halves of 4x4 float32 = 64 B each) and all of b (128 B)
    for recv in jobs.recvs:
        got = sum(np.prod([s.stop - s.start for s in read.dst_slices]) * 4 for read in recv.ipc)
        assert got == 8 * 4 * 4 + 8 * 4 * 4
        assert {read.src_rank for read in recv.ipc if read.name == "w"} == {0, 1}
    assert sum(len(s.ipc) for s in jobs.sends) >= 3  # w from both sources, b from at least one
    # the other pairs keep their routes
    store_only = build_jobs(plan, frozenset())
    assert store_only.bytes_put > 0 and all(not r.ipc for r in store_only.recvs)


def test_cuda_ipc_between_in_process_groups_says_why() -> None:
    layouts = [ParamLayout("w", (8, 4), tp_dim=0)]
    src = LocalWorkerGroup(ShardHolder, mesh=RankMesh(tp=2), init_args=(layouts, 1))
    dst = LocalWorkerGroup(ShardHolder, mesh=RankMesh(dp=2), init_args=(layouts, None))
    plan = plan_reshard(layouts, src.mesh, dst.mesh)
    with pytest.raises(ReshardError, match="two processes: use Ray worker groups"):
        reshard(src, dst, plan, transport="cuda_ipc")
    assert all(not np.any(s["w"]) for s in dst.shards())  # nothing was written


# ----- the pages a registration covers --------------------------------------------------------------


@pytest.mark.parametrize("spans, page, want", [
    ([(4096, 100)], 4096, [(4096, 4096)]),                       # inside one page
    ([(4100, 8192)], 4096, [(4096, 12288)]),                     # 4100..12292 touches pages 1, 2, 3
    ([(0, 10), (100, 10)], 4096, [(0, 4096)]),                   # two tensors on one page: registered once
    ([(0, 4096), (4096, 1)], 4096, [(0, 8192)]),                 # adjacent pages: one range
    ([(0, 1), (8192, 1)], 4096, [(0, 4096), (8192, 4096)]),      # a page apart: two ranges
    ([(12000, 5000), (8192, 0), (0, 1)], 4096, [(0, 4096), (8192, 12288)]),  # unsorted, empty dropped
    ([(70000, 1)], 65536, [(65536, 65536)]),                     # 64 KiB pages (aarch64)
    ([], 4096, []),
])
def test_page_spans_covers_whole_pages_once(spans, page, want) -> None:
    assert page_spans(spans, page) == want


def test_page_spans_refuses_a_page_size_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        page_spans([(0, 1)], 3000)


# ----- the pinned receive on real copy-on-write views -----------------------------------------------


@pytest.fixture
def received(shm_file, mode):  # noqa: F811 - the fixtures imported above
    """A 2 MiB copy-on-write view of the shared file (as a received batch's bytes), its tensor and the expected bytes."""
    mode("auto")
    _, shared, data = shm_file
    view = sharedmem.private_bytes(shared[MiB:3 * MiB])
    x = torch.from_numpy(view).view(torch.int32).view(64, -1)
    want = data[MiB:3 * MiB].copy()
    return view, x, want, np.frombuffer(shared, dtype=np.uint8).ctypes.data + MiB


def test_pinned_falls_back_without_cuda_and_copies_nothing(received) -> None:
    view, x, want, _ = received
    copies = sharedmem.receive_info()["copies"]
    data = DataProto.from_dict({"x": x})
    target = "cuda" if not torch.cuda.is_available() else "cpu"
    with pinned(data, target) as p:
        assert not p.pinned and p.nbytes == 0
        assert p.why_not in ("CUDA is not available in this process", "the target is cpu, not a CUDA device")
        assert x.data_ptr() == view.ctypes.data  # not re-pointed: nothing to read faster
    moved = to_device(data, "cpu", pin=True)
    assert np.array_equal(moved.batch["x"].numpy().view(np.uint8).reshape(-1), want)
    assert sharedmem.receive_info()["copies"] == copies
    assert copied_kib(view.ctypes.data, view.nbytes) == 0


def test_an_unwritten_view_reads_from_the_shared_pages_and_is_pointed_back(received) -> None:
    view, x, want, shared_addr = received
    y = x[8:16, 4:]  # a strided view of the same storage
    originals = shared_originals([x, y])
    assert list(originals) == [view.ctypes.data]  # one storage, once
    assert originals[view.ctypes.data].ctypes.data == shared_addr
    with reading_shared([x, y], originals) as n:
        assert n == 2
        assert x.data_ptr() == shared_addr and y.data_ptr() == shared_addr + (8 * x.shape[1] + 4) * 4
        assert np.array_equal(x.numpy().view(np.uint8).reshape(-1), want)
        assert np.array_equal(y.numpy(), want.view(np.int32).reshape(64, -1)[8:16, 4:])
    assert x.data_ptr() == view.ctypes.data and y.data_ptr() == view.ctypes.data + (8 * x.shape[1] + 4) * 4
    assert copied_kib(view.ctypes.data, view.nbytes) == 0  # no page of the view was made private


def test_a_written_view_is_not_read_from_the_shared_pages(received) -> None:
    view, x, _, _ = received
    x[0, 0] = 7  # its first page now lives in the view alone
    assert shared_originals([x]) == {}
    private = torch.arange(8, dtype=torch.int32)  # plain process memory: no shared original
    assert shared_originals([private]) == {}
