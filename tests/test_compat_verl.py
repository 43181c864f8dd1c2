"""Porting from verl: the compat names exist, are rankmesh's own objects, and keep verl's call semantics.

Expected rows are computed here by hand from the input (a single-process reference), never by
rankmesh.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import rankmesh
import rankmesh.compat.verl as verl
from rankmesh import LocalWorkerGroup, RankMesh
from tests.verl_workers import VerlStyleActor

VERL_NAMES = [
    "DataProto", "DataProtoConfig", "DataProtoFuture", "pad_dataproto_to_divisor", "unpad_dataproto",
    "union_tensor_dict", "union_numpy_dict", "fold_batch_dim", "unfold_batch_dim", "Worker", "register",
    "Dispatch", "Execute", "make_nd_compute_dataproto_dispatch_fn", "RayResourcePool", "RayClassWithInitArgs",
    "RayWorkerGroup", "create_colocated_worker_cls", "create_colocated_worker_raw_cls",
]


def test_every_verl_name_is_there_and_shared_names_are_the_same_object():
    for name in VERL_NAMES:
        assert hasattr(verl, name), name
    for name in ("DataProtoFuture", "register", "Dispatch", "Execute"):
        assert getattr(verl, name) is getattr(rankmesh, name), name
    # verl's in-place semantics live in thin subclasses of rankmesh's own classes
    for name in ("DataProto", "Worker"):
        assert issubclass(getattr(verl, name), getattr(rankmesh, name)), name
    assert verl.DataProtoConfig is rankmesh.data.DataProtoConfig  # a verl mechanic: not on the front door
    from rankmesh.backends import ray as ray_backend

    assert verl.RayClassWithInitArgs is ray_backend.RayClassWithInitArgs
    for name in ("RayResourcePool", "RayWorkerGroup"):
        assert issubclass(getattr(verl, name), getattr(ray_backend, name)), name
    for method in ("_register_dispatch_collect_info", "_query_dispatch_info", "get_dispatch_collect", "set_dispatch_collect"):
        assert callable(getattr(verl.Worker, method)), method
    assert callable(verl.RayWorkerGroup.spawn) and callable(verl.RayWorkerGroup.fuse)


def test_raw_colocated_class_is_a_worker_holding_its_roles():
    raw = verl.create_colocated_worker_raw_cls({"actor": VerlStyleActor, "ref": VerlStyleActor})
    assert issubclass(raw, verl.Worker) and raw.raw_cls_dict == {"actor": VerlStyleActor, "ref": VerlStyleActor}


@pytest.fixture(scope="module")
def group():
    return LocalWorkerGroup(VerlStyleActor, mesh=RankMesh(dp=4), init_args=(3.0,))


def test_ported_worker_runs_with_verl_semantics(group):
    assert group.init_rank() == [0, 1, 2, 3]
    assert group.hello("verl") == "hello verl from rank 0"
    assert list(inspect.signature(group.scale_values).parameters) == ["data"]

    x = torch.arange(8, dtype=torch.float32)
    batch = verl.DataProto.from_dict(tensors={"x": x.clone()})
    out = group.scale_values(batch)
    # mesh "actor" registered by the workers: dp_rank = rank // 2, collect from even ranks
    assert torch.equal(out.batch["x"], x * 3.0)
    assert out.batch["rank"].tolist() == [0.0] * 4 + [2.0] * 4
    assert torch.equal(batch.batch["x"], x), "the caller's batch must not change"


def test_global_auto_padding_pads_internally_and_returns_exactly_the_rows(group):
    x = torch.arange(6, dtype=torch.float32)
    batch = verl.DataProto.from_dict(tensors={"x": x.clone()})
    with pytest.raises(rankmesh.errors.PaddingError, match="6"):
        group.add_rank(batch)
    previous = verl.DataProtoConfig.auto_padding
    verl.DataProtoConfig.auto_padding = True
    try:
        out = group.add_rank(batch)
        metrics = group.metric(batch)
    finally:
        verl.DataProtoConfig.auto_padding = previous
    assert len(batch) == 6 and torch.equal(batch.batch["x"], x)
    # 6 rows padded to 8, two per rank: rows 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 2
    assert out.batch["x"].tolist() == [0.0, 1.0, 3.0, 4.0, 6.0, 7.0]
    # verl trimmed DP_COMPUTE_METRIC by the pad count and lost ranks; every rank reports here
    assert [m["rank"] for m in metrics] == [0, 1, 2, 3]
    assert [m["rows"] for m in metrics] == [2, 2, 2, 2]


# --- verl's constructor arguments: honoured with verl's meaning or refused, never dropped ------------
# Every refusal happens before a process starts (no Ray is needed here).


def _verl_group(pool=None, **kwargs):
    pool = pool if pool is not None else verl.RayResourcePool([1], use_gpu=False)
    return verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(cls=VerlStyleActor), **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, names",
    [
        ({"bin_pack": False}, rankmesh.errors.BackendError, ["bin_pack=False", "STRICT_PACK", "RayResourcePool([4, 4])"]),
        ({"use_gpu": True}, rankmesh.errors.BackendError, ["use_gpu is True", "use_gpu=True"]),
        ({"device_name": "npu"}, rankmesh.errors.BackendError, ["device_name='npu'", "cuda"]),
        ({"profile_steps": [1, 2]}, rankmesh.errors.BackendError, ["profile_steps=[1, 2]", "wg.trace("]),
        ({"worker_nsight_options": {"capture-range-end": None}}, rankmesh.errors.BackendError, ["worker_nsight_options", "wg.trace("]),
        ({"master_port_range": [20000, 20100]}, rankmesh.errors.BackendError, ["master_port_range", "wg.master_port"]),
        ({"master_addr": "10.0.0.1", "master_port": "29500"}, rankmesh.errors.BackendError, ["master_addr", "wg.master_address"]),
        ({"worker_names": ["a_0"]}, rankmesh.errors.DispatchAssertionError, ["worker_names", "from_detached"]),
        ({"worker_handles": [object()]}, rankmesh.errors.DispatchAssertionError, ["worker_handles", "from_detached"]),
        ({"ray_wait_register_center_timeout": 0}, rankmesh.errors.BackendError, ["ray_wait_register_center_timeout", "positive"]),
        ({"ray_wait_register_center_timeout": 60, "start_timeout": 90}, TypeError, ["ray_wait_register_center_timeout=60", "start_timeout=90"]),
        ({"no_such_argument": 1}, TypeError, ["no_such_argument"]),
    ],
)
def test_verl_constructor_arguments_rankmesh_cannot_honour_are_refused_by_name(kwargs, error, names):
    with pytest.raises(error) as info:
        _verl_group(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_a_cpu_pools_use_gpu_false_and_device_cpu_are_verls_meaning_and_accepted():
    from rankmesh.compat.verl.workers import verl_group_options

    cpu, gpu = verl.RayResourcePool([1], use_gpu=False), verl.RayResourcePool([1], use_gpu=True)
    # verl's defaults and values that say what the pool already does leave rankmesh's options alone
    assert verl_group_options(cpu, None, None, 300, {"use_gpu": False, "device_name": "cpu", "profile_steps": None}) == {}
    assert verl_group_options(gpu, None, None, 300, {"use_gpu": True, "device_name": "cuda", "worker_env": {"A": "1"}}) == {
        "worker_env": {"A": "1"}
    }
    with pytest.raises(rankmesh.errors.BackendError, match="use_gpu=False on a use_gpu=True pool"):
        _verl_group(gpu, use_gpu=False)
    # verl's get_device_name() is "cpu" on a machine without CUDA, and verl's GPU-placed code passes
    # it on a use_gpu=True pool: the pool still reserves Ray's GPU resource (verl only warns)
    assert verl_group_options(gpu, None, None, 300, {"device_name": "cpu"}) == {}
    with pytest.raises(rankmesh.errors.BackendError, match="device_name='npu'"):
        _verl_group(gpu, device_name="npu")


def test_the_register_center_timeout_is_rankmeshs_start_timeout():
    from rankmesh.compat.verl.workers import verl_group_options

    pool = verl.RayResourcePool([1], use_gpu=False)
    assert verl_group_options(pool, None, None, 120, {}) == {"start_timeout": 120.0}
    assert verl_group_options(pool, None, None, 120, {"start_timeout": 120}) == {"start_timeout": 120.0}
    assert verl_group_options(pool, None, None, 300, {"start_timeout": 45}) == {"start_timeout": 45}  # verl's default: rankmesh's wins


def test_split_and_merged_verl_pools_keep_verls_per_process_lists():
    first, second = verl.RayResourcePool([2], use_gpu=False), verl.RayResourcePool([1], use_gpu=False)
    merged = verl.merge_resource_pool(first, second)
    assert isinstance(merged, verl.RayResourcePool)
    assert merged.local_rank_list() == [0, 1, 0] and merged.local_world_size_list() == [2, 2, 1]
    head, tail = verl.split_resource_pool(merged, [1, 2])
    assert head.local_rank_list() == [0] and tail.local_world_size_list() == [1, 1]


# --- verl's RayResourcePool.get_placement_groups(strategy, name, device_name) ----------------------


def test_get_placement_groups_has_verls_signature():
    params = inspect.signature(verl.RayResourcePool.get_placement_groups).parameters
    assert [(p.name, p.default) for p in list(params.values())[1:]] == [
        ("strategy", "STRICT_PACK"), ("name", None), ("device_name", "cuda")
    ]


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"device_name": "npu"}, ["device_name='npu'", "'cuda'", "'cpu'"]),
        ({"device_name": "tpu"}, ["device_name='tpu'", "'cuda'", "'cpu'"]),
        ({"strategy": "PACK"}, ["strategy='PACK'", "STRICT_PACK", "RayResourcePool([4, 4])"]),
        ({"name": "my_pg"}, ["name='my_pg'", "name_prefix"]),
    ],
)
def test_get_placement_groups_refuses_what_rankmesh_cannot_honour_before_placing(kwargs, names):
    # refused before anything is placed: no Ray is needed here
    pool = verl.RayResourcePool([1], use_gpu=True)
    with pytest.raises(rankmesh.errors.BackendError) as info:
        pool.get_placement_groups(**kwargs)
    for name in names:
        assert name in str(info.value)
    assert "not placed" in repr(pool)


# --- verl.utils.ray_utils.parallel_put ---------------------------------------------------------------


def test_parallel_put_of_nothing_fails_verls_assert():
    with pytest.raises(AssertionError, match="data_list"):
        verl.parallel_put([])
