"""Several worker groups on one GPU pool: verl's hybrid-engine placement, on GPUs a Ray declares.

An actor, a critic and a reference group built one after the other on the same
``RayResourcePool(use_gpu=True, max_colocate_count=3)`` share its bundles, each process taking
1 CPU and 1/3 of its bundle's GPU, so rank r of every group sees the same GPU.  This CPU machine
has no GPU: the driver's Ray *declares* two (``ensure_ray(num_gpus=2)``), so placement and GPU
assignment are Ray's real ones while tensors stay on the CPU.  A group more than the bundles hold
is refused at once.  Runs its own driver (tests/drivers.py): the session's Ray declares no GPUs.
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

ensure_ray(num_cpus=16, num_gpus=2)
pool = RayResourcePool([2], use_gpu=True, max_colocate_count=3)
groups = [RayWorkerGroup(pool, RayClassWithInitArgs(Role), name_prefix=name) for name in ("actor", "critic", "ref")]
report = {"where": [g.where() for g in groups]}
started = time.monotonic()
try:
    RayWorkerGroup(pool, RayClassWithInitArgs(Role), name_prefix="reward")
except ResourcePoolError as exc:
    report["fourth"] = str(exc)
report["fourth_s"] = time.monotonic() - started
for g in groups:
    g.shutdown()
print_report(report)
"""


def test_three_groups_share_one_gpu_pool_and_a_fourth_is_refused_at_once():
    seen = run_code(DRIVER, timeout=240)
    where = seen["where"]
    # 1/3 of a GPU per process; rank r of every group on the same bundle, hence the same GPU.
    assert all(abs(share - 1 / 3) < 1e-3 for group in where for share, _ in group), where
    gpus = [device for _, device in where[0]]
    assert sorted(gpus) == ["0", "1"], where
    assert all([device for _, device in group] == gpus for group in where), where
    assert "already hold 3 worker group(s), as many as max_colocate_count=3 allows" in seen["fourth"]
    assert seen["fourth_s"] < 2.0
