"""verl 0.9.1's worker and group behaviour under rankmesh.compat.verl, on a real local Ray.

Each group has 2 ranks on one node; the expected values follow from that placement by hand
(LOCAL_RANK = RANK, LOCAL_WORLD_SIZE = 2, dp piece = rank).
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from tensordict import TensorDict

from rankmesh.compat.verl import DataProto, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, parallel_put
from rankmesh.errors import FetchTimeoutError
from tests.compat.workers import EnvWorker, HybridWorker, SlowStartWorker

pytestmark = pytest.mark.usefixtures("ray_session")

ENV = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "RAY_LOCAL_RANK", "RAY_LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]


@pytest.fixture(scope="module")
def wg():
    group = RayWorkerGroup(
        RayResourcePool([2], use_gpu=False, max_colocate_count=1), RayClassWithInitArgs(cls=EnvWorker), worker_env={"HIP_VISIBLE_DEVICES": "0,1"}
    )
    yield group
    group.shutdown()


def test_workers_see_verls_variables(wg):
    envs = wg.env(ENV)
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == env["RAY_LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["RAY_LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == wg.master_address == "127.0.0.1"
        assert env["MASTER_PORT"] == wg.master_port
    assert wg.master() == [("127.0.0.1", wg.master_port)] * 2


def test_hip_visible_devices_becomes_cuda_visible_devices(wg):
    assert wg.visible() == ["0,1", "0,1"]
    assert wg.env(["HIP_VISIBLE_DEVICES"]) == [{"HIP_VISIBLE_DEVICES": None}] * 2


def test_verl_group_names(wg):
    assert wg.world_size == 2 and len(wg.workers) == 2 and len(wg.worker_names) == 2
    assert wg.execute_all_sync("visible") == ["0,1", "0,1"]
    assert wg.execute_rank_zero_sync("visible") == "0,1"
    assert ray.get(wg.execute_rank_zero_async("visible")) == "0,1"


def test_async_calls_return_verls_object_refs(wg):
    # verl: execute_all_async is one ObjectRef per rank, execute_rank_zero_async one ObjectRef
    refs = wg.execute_all_async("env", ["RANK"])
    assert isinstance(refs, list) and all(isinstance(r, ray.ObjectRef) for r in refs)
    assert ray.get(refs) == [{"RANK": "0"}, {"RANK": "1"}]
    # arguments that are all world-size lists go rank by rank, as in verl
    assert ray.get(wg.execute_all_async("env", [["RANK"], ["WORLD_SIZE"]])) == [{"RANK": "0"}, {"WORLD_SIZE": "2"}]
    ref = wg.execute_rank_zero_async("visible")
    assert isinstance(ref, ray.ObjectRef) and ray.get(ref) == "0,1"
    # and verl's execute_all / execute_rank_zero are their aliases: ObjectRefs, not values
    refs = wg.execute_all("env", ["RANK"])
    assert all(isinstance(r, ray.ObjectRef) for r in refs) and ray.get(refs) == [{"RANK": "0"}, {"RANK": "1"}]
    assert ray.get(wg.execute_rank_zero("visible")) == "0,1"
    assert [i["control"] for i in wg.transport_info()] == wg.executor.control_paths()  # rankmesh's own use waits
    # refs never fetched through the group: later calls still run in order
    unread = wg.execute_all_async("env", ["RANK"])
    assert wg.execute_all_sync("visible") == ["0,1", "0,1"]
    assert ray.get(unread) == [{"RANK": "0"}, {"RANK": "1"}]


def test_get_placement_groups_takes_verls_device_names(wg):
    pool = wg.resource_pool
    pgs = pool.get_placement_groups(device_name="cuda")
    assert len(pgs) == 1 and pgs == pool.get_placement_groups()
    # verl's get_device_name() is "cpu" on a machine without CUDA; verl's placement code passes it
    assert pool.get_placement_groups(strategy="STRICT_PACK", device_name="cpu") == pgs


def test_parallel_put_returns_object_refs_in_order():
    data = [1, "hello", {"a": 2}, [3, 4]]
    refs = parallel_put(data)
    assert all(isinstance(r, ray.ObjectRef) for r in refs) and ray.get(refs) == data
    many = list(range(20))
    assert ray.get(parallel_put(many, max_workers=4)) == many


def test_functions_ship_to_ranks(wg):
    data = DataProto.from_dict(tensors={"x": torch.arange(4.0)})

    def shift(worker, piece):
        return DataProto.from_dict(tensors={"x": piece.batch["x"] + 10 * worker.rank})

    out = wg.execute_with_func_generator(shift, data)
    assert out.batch["x"].tolist() == [0.0, 1.0, 12.0, 13.0] and type(out) is DataProto
    assert wg.execute_func_rank_zero(lambda a, b: a * b, 6, 7) == 42


def test_set_dispatch_collect_with_verls_signature(wg):
    got = wg.copy_dispatch_info()
    assert [g[:2] for g in got] == [(0, True), (1, True)]
    assert all("already registered" in g[2] for g in got)
    assert [g[3] for g in got] == ["ValueError", "ValueError"]


def test_tensordict_batches_split_by_rows_and_come_back_as_a_tensordict(wg):
    td = TensorDict({"x": torch.arange(6.0)}, batch_size=[6])
    out = wg.double(td)
    assert isinstance(out, TensorDict) and out["y"].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert out["rank"].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert td["x"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_worker_groups_return_compat_batches_with_verls_semantics(wg):
    out = wg.double(DataProto.from_dict(tensors={"x": torch.arange(4.0)}))
    assert type(out) is DataProto
    with pytest.raises(AssertionError):
        out.chunk(3)


def test_worker_env_overriding_a_reserved_variable_is_a_value_error():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False, max_colocate_count=1), RayClassWithInitArgs(cls=EnvWorker), worker_env={"WORLD_SIZE": "9"})


def test_fused_workers_reach_roles_as_attributes():
    cls = RayClassWithInitArgs(cls=HybridWorker)
    cls.fused_worker_used = True
    group = RayWorkerGroup(RayResourcePool([2], use_gpu=False, max_colocate_count=1), cls)
    try:
        assert group.fused_worker_used
        group.fuse(["actor", "critic"])
        assert group.actor.add(1) == [101, 102]  # base 100 + x + rank
        assert group.critic.sub(5) == [5, 4]
        assert group.both(1) == [(101, 1, ["actor", "critic"]), (102, 0, ["actor", "critic"])]
    finally:
        group.shutdown()


def test_the_register_center_timeout_bounds_the_start():
    # verl's ray_wait_register_center_timeout is how long the workers may take to come up
    # (rankmesh's start_timeout): a worker that builds for 45 s fails after ~3 s, not after 300 s.
    start = time.monotonic()
    with pytest.raises(FetchTimeoutError):
        RayWorkerGroup(
            RayResourcePool([1], use_gpu=False, max_colocate_count=1),
            RayClassWithInitArgs(cls=SlowStartWorker, seconds=45.0),
            ray_wait_register_center_timeout=3,
        )
    assert time.monotonic() - start < 40
