"""One rank per GPU under nccl: the rule on hand-made placements, and its gather on a real gloo group.

NCCL refuses (or hangs on) two ranks of one group on one GPU; ``MegatronWorker`` refuses such a
group when it starts (docs/megatron.md, "Several ranks on one GPU").  The rule is pure, so it is
checked here without a GPU on placements written by hand; the gather and the refusal run on a
real torch.distributed group of forked processes, with the records each rank would read from its
driver given by the test.  ``scripts/check_gpu_megatron.py`` checks the whole path on a GPU.
"""

from __future__ import annotations

import pytest

from rankmesh.devices import RankDevice, check_one_rank_per_gpu, ranks_sharing_gpus
from rankmesh.errors import RendezvousError


def dev(rank: int, gpu: str, index: int = 0, node: str = "n0") -> RankDevice:
    return RankDevice(rank=rank, node=node, gpu=gpu, index=index)


def test_distinct_gpus_pass_even_with_equal_indices_on_other_nodes():
    # Every rank's cuda:0 on a node of its own (Ray's CUDA_VISIBLE_DEVICES per rank), and two GPUs of one node.
    placements = [dev(0, "GPU-a", 0, "n0"), dev(1, "GPU-b", 1, "n0"), dev(2, "GPU-c", 0, "n1"), dev(3, "GPU-d", 0, "n2")]
    assert ranks_sharing_gpus(placements) == []
    check_one_rank_per_gpu("nccl", placements)


def test_two_ranks_on_one_gpu_are_named_with_the_gpu_and_the_fix():
    with pytest.raises(RendezvousError) as info:
        check_one_rank_per_gpu("nccl", [dev(0, "GPU-a"), dev(1, "GPU-a")])
    text = str(info.value)
    assert "ranks [0, 1] all use GPU GPU-a (cuda:0) on node n0" in text
    assert "own GPU" in text and "use_gpu=True" in text and 'backend="gloo"' in text


def test_every_shared_set_is_named_in_rank_order_and_no_other_rank():
    placements = [dev(3, "GPU-b", 1), dev(0, "GPU-a", 0), dev(2, "GPU-a", 0), dev(1, "GPU-b", 1), dev(4, "GPU-c", 2)]
    assert [[d.rank for d in s] for s in ranks_sharing_gpus(placements)] == [[0, 2], [1, 3]]
    with pytest.raises(RendezvousError) as info:
        check_one_rank_per_gpu("nccl", placements)
    text = str(info.value)
    assert text.index("ranks [0, 2] all use GPU GPU-a (cuda:0)") < text.index("ranks [1, 3] all use GPU GPU-b (cuda:1)")
    assert "4" not in text.replace("GPU-", "")


def test_one_gpu_seen_under_two_indices_is_still_one_gpu():
    # Rank 0 sees all GPUs (cuda:1 is the second), rank 1 only that one (cuda:0): same device, other indices.
    with pytest.raises(RendezvousError, match=r"ranks \[0, 1\] all use GPU GPU-b \(cuda:0, cuda:1\)"):
        check_one_rank_per_gpu("nccl", [dev(0, "GPU-b", 1), dev(1, "GPU-b", 0)])


def test_other_backends_may_share_a_device():
    check_one_rank_per_gpu("gloo", [dev(0, "GPU-a"), dev(1, "GPU-a")])


def _gather_and_refuse(rank: int, world: int):
    """Rank ``rank`` of a real gloo group: gather the records (ranks 0 and 2 on GPU-a), then refuse."""
    import torch.distributed as dist

    from rankmesh.megatron.worker import gather_rank_devices, refuse_shared_gpus
    from rankmesh.rendezvous import init_torch_distributed

    init_torch_distributed("gloo", timeout=60)
    mine = dev(rank, "GPU-b" if rank == 1 else "GPU-a", index=rank, node=f"n{rank}")
    gathered = gather_rank_devices(mine)
    try:
        refuse_shared_gpus(mine)
    except RendezvousError as exc:
        return gathered, str(exc), dist.is_initialized()
    return gathered, None, dist.is_initialized()


def test_every_rank_gathers_every_record_and_refuses_leaving_torch_distributed():
    from tests.megatron_workers import run_forked

    results = run_forked(_gather_and_refuse, 3, timeout=60)
    want = [dev(0, "GPU-a", 0, "n0"), dev(1, "GPU-b", 1, "n1"), dev(2, "GPU-a", 2, "n2")]
    for gathered, error, still_joined in results:
        assert gathered == want
        assert error is not None and "ranks [0, 2] all use GPU GPU-a (cuda:0, cuda:2) on node n0" in error
        assert not still_joined  # the refusing rank left the default group: nothing waits on it
