"""Several worker groups on one GPU pool: verl's hybrid-engine placement, on GPUs a Ray declares.

An actor, a critic and a reference group built one after the other on the same
``RayResourcePool(use_gpu=True, max_colocate_count=3)`` share its bundles, each process taking
1 CPU and 1/3 of its bundle's GPU, so rank r of every group sees the same GPU.  This CPU machine
has no GPU: the driver's Ray *declares* two (``ensure_ray(num_gpus=2)``), so placement and GPU
assignment are Ray's real ones while tensors stay on the CPU.  A group more than the bundles hold
is refused at once.  Then verl's merged pools (its ``test_high_level_scheduling_api`` pattern)
through ``rankmesh.compat.verl``, with verl's default ``max_colocate_count`` (10): a group on
``merge_resource_pool(rm, ref)`` and a group on ``ref`` share ``ref``'s bundle and GPU; verl's
``ray.get(wg.execute_all_async(...))``, ``get_placement_groups(device_name=...)`` and
``parallel_put`` on them.  A forked group on the same pool sees each bundle's GPU as the spawned
ranks do.  Runs its own driver (tests/drivers.py): the session's Ray declares no
GPUs.
"""

from __future__ import annotations

import pytest

from tests.drivers import run_code

pytest.importorskip("ray")

DRIVER = """
import os, time
import ray
from rankmesh import Dispatch, RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker, register
from rankmesh.backends.ray import ensure_ray
from rankmesh.errors import ResourcePoolError
from tests.drivers import print_report

class Role(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self):
        return [ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0), os.environ.get("CUDA_VISIBLE_DEVICES")]

ensure_ray(num_cpus=24, num_gpus=2)  # logical CPUs: verl's pools below reserve 10 per bundle
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=3)
# Role asks Ray's runtime context for its GPU share: Ray actors (a forked rank has no Ray worker).
groups = [RayWorkerGroup(pool, RayClassWithInitArgs(Role), name_prefix=name, process_model="ray")
          for name in ("actor", "critic", "ref")]
report = {"where": [g.where() for g in groups]}
started = time.monotonic()
try:
    RayWorkerGroup(pool, RayClassWithInitArgs(Role), name_prefix="reward", process_model="ray")
except ResourcePoolError as exc:
    report["fourth"] = str(exc)
report["fourth_s"] = time.monotonic() - started
groups.pop().shutdown()  # room for one forked group on the pool's bundles


class Sees(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def devices(self):
        return os.environ.get("CUDA_VISIBLE_DEVICES")


forked = RayWorkerGroup(pool, RayClassWithInitArgs(Sees), name_prefix="forked", process_model="fork")
report["forked"] = forked.devices()
report["forked_gpu_ids"] = [list(i["gpu_ids"]) for i in forked.executor.hosts.info]
forked.shutdown()
for g in groups:
    g.shutdown()

from rankmesh.compat.verl import RayResourcePool as VerlPool, RayWorkerGroup as VerlGroup, merge_resource_pool
from rankmesh.compat.verl import get_device_name, parallel_put
rm, ref = VerlPool([1], name_prefix="rm"), VerlPool([1], name_prefix="ref")  # verl's defaults: use_gpu, 10 per bundle
total = merge_resource_pool(rm, ref)
report["merged"] = [total.name_prefix, total.world_size, total.max_colocate_count]
on_total = VerlGroup(total, RayClassWithInitArgs(Role), name_prefix="on_total")
on_ref = VerlGroup(ref, RayClassWithInitArgs(Role), name_prefix="on_ref")
report["on_total"], report["on_ref"] = on_total.where(), on_ref.where()
# verl's own calls, as its GPU-placed tests make them
report["refs"] = ray.get(on_total.execute_all_async("where"))
report["ref_pgs"] = [pg.bundle_specs for pg in ref.get_placement_groups(device_name=get_device_name())]
report["put"] = ray.get(parallel_put([report["refs"], "x"]))
on_total.shutdown()
on_ref.shutdown()
print_report(report)
"""


@pytest.fixture(scope="module")
def seen():
    """The driver's report (one driver, one Ray, for both tests)."""
    return run_code(DRIVER, timeout=240)


def test_three_groups_share_one_gpu_pool_and_a_fourth_is_refused_at_once(seen):
    where = seen["where"]
    # 1/3 of a GPU per process; rank r of every group on the same bundle, hence the same GPU.
    assert all(abs(share - 1 / 3) < 1e-3 for group in where for share, _ in group), where
    gpus = [device for _, device in where[0]]
    assert sorted(gpus) == ["0", "1"], where
    assert all([device for _, device in group] == gpus for group in where), where
    assert "already hold 3 worker group(s), as many as max_colocate_count=3 allows" in seen["fourth"]
    assert seen["fourth_s"] < 2.0


def test_a_forked_rank_sees_the_gpu_of_its_bundle_as_a_spawned_one_does(seen):
    """A forked rank has no Ray worker: the devices Ray gave its bundle are read by a task in the
    bundle and set before the rank starts.  Expected: the spawned ranks' devices, bundle by bundle."""
    gpus = [device for _, device in seen["where"][0]]
    assert seen["forked"] == gpus, seen
    assert seen["forked_gpu_ids"] == [[g] for g in gpus], seen


def test_merged_verl_pools_put_a_group_on_both_and_share_the_second_pools_bundle(seen):
    assert seen["merged"] == ["rm_ref", 2, 10]
    # verl's default: each process takes 1/10 of its bundle's GPU
    assert all(abs(share - 0.1) < 1e-6 for share, _ in seen["on_total"] + seen["on_ref"]), seen
    (_, gpu_rm), (_, gpu_ref) = seen["on_total"]
    assert sorted([gpu_rm, gpu_ref]) == ["0", "1"], seen  # one bundle of each pool, one GPU each
    assert seen["on_ref"] == [[0.1, gpu_ref]], seen  # ref's group runs on ref's bundle: merged rank 1's GPU


def test_verls_object_ref_calls_placement_groups_and_puts_on_gpu_pools(seen):
    # ray.get(wg.execute_all_async(...)): one ObjectRef per rank, the same values as the blocking call
    assert seen["refs"] == seen["on_total"], seen
    # get_placement_groups(device_name=get_device_name()): "cpu" on this machine, verl's GPU bundles all the same
    assert seen["ref_pgs"] == [[{"CPU": 10.0, "GPU": 1.0}]], seen
    assert seen["put"] == [seen["refs"], "x"], seen
