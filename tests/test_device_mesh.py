"""RankMesh.to_device_mesh inside a real gloo process group (4 spawned processes)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from rankmesh import RankMesh


def _worker(rank: int, world: int, store_path: str, mesh: RankMesh, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        device_mesh = mesh.to_device_mesh("cpu")
        found = {
            name: dist.get_process_group_ranks(device_mesh.get_group(name))
            for name in device_mesh.mesh_dim_names
        }
        queue.put((rank, device_mesh.mesh_dim_names, found))
    finally:
        dist.destroy_process_group()


def test_device_mesh_dimensions_are_the_mesh_groups(tmp_path):
    mesh = RankMesh(tp=2, dp=2, order="tp-cp-ep-dp-pp")
    world = mesh.world_size
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, str(tmp_path / "store"), mesh, queue), nprocs=world, start_method="spawn")
    results = sorted(queue.get() for _ in range(world))
    # Hand-derived: rank = tp + 2*dp, so tp groups are [0,1],[2,3] and dp groups [0,2],[1,3].
    expected_tp = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    expected_dp = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    for rank, names, found in results:
        assert names == ("pp", "dp", "cp", "tp")
        assert found["tp"] == expected_tp[rank]
        assert found["dp"] == expected_dp[rank]
        assert found["pp"] == [rank] and found["cp"] == [rank]


def test_device_mesh_without_a_process_group_says_how_to_get_one():
    import torch.distributed as dist

    from rankmesh.errors import MeshError

    assert not dist.is_initialized()  # the controller process: no default group
    with pytest.raises(MeshError, match=r"after torch.distributed.init_process_group"):
        RankMesh(tp=2, dp=2).to_device_mesh()
