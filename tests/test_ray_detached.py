"""Detached groups: started by one driver, found by name prefix and used from another."""

from __future__ import annotations

import os
import textwrap
import time
import uuid

import pytest

ray = pytest.importorskip("ray")

from rankmesh.backends.ray import RayWorkerGroup  # noqa: E402
from rankmesh.backends.ray.hosts import actor_name, rank_of_name  # noqa: E402
from rankmesh.backends.ray.runtime import DETACHED_NAMESPACE  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.errors import BackendError  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402
from tests.drivers import run_code  # noqa: E402


class DetachedWorker(Worker):
    def __init__(self, base: int) -> None:
        self.base = base

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x: int) -> tuple[int, int, int]:
        return self.rank, self.rank_info.tp_rank, self.base + x

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


DRIVER = textwrap.dedent(
    """
    import sys
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, ensure_ray
    from rankmesh.mesh import RankMesh
    from tests.drivers import print_report
    from tests.test_ray_detached import DetachedWorker

    address, prefix = sys.argv[1], sys.argv[2]
    ensure_ray(address=address)
    pool = RayResourcePool([2], use_gpu=False, detached=True, name_prefix=prefix + "-pool")
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(DetachedWorker, 40), mesh=RankMesh(tp=2),
                        name_prefix=prefix, detached=True)
    print_report({"add": wg.add(2), "pids": wg.pid(), "names": wg.worker_names})
    # exit without shutdown: the group must outlive this driver
    """
)


def _named(prefix: str) -> list[str]:
    names = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == DETACHED_NAMESPACE]
    return sorted(n for n in names if rank_of_name(n, prefix) is not None)


def test_actor_names_are_prefix_plus_rank():
    assert actor_name("grp", 3) == "grp_3"
    assert rank_of_name("grp_3", "grp") == 3
    assert rank_of_name("grp_1_0", "grp") is None  # a group named "grp_1", not rank "1_0"
    assert rank_of_name("grp_10", "grp_1") is None
    assert rank_of_name("other_0", "grp") is None


def test_attach_to_a_group_started_by_another_driver(ray_session):
    prefix = f"det-{uuid.uuid4().hex[:6]}"
    cpus = ray.available_resources().get("CPU", 0.0)
    started = run_code(DRIVER, ray_session.address, prefix, timeout=180)
    assert started["add"] == [[0, 0, 42], [1, 1, 42]]
    assert _named(prefix) == [f"{prefix}_0", f"{prefix}_1"]

    wg = RayWorkerGroup.from_detached(name_prefix=prefix)
    try:
        assert wg.world_size == 2 and wg.mesh == RankMesh(tp=2)
        assert wg.worker_cls is DetachedWorker
        assert wg.add(5) == [(0, 0, 45), (1, 1, 45)]
        assert wg.pid() == started["pids"]  # the very processes the other driver started
        assert wg.worker_names == started["names"]
        # attached, not started here: no start-up record, and a recovery state of its own
        assert wg.startup_report() is None and wg.on_rank_death == "fail" and wg.replacements == []
        wg.record_startup("cross-checked")  # nothing to record into: a no-op, not an AttributeError
        with pytest.raises(BackendError, match="was built with"):
            RayWorkerGroup.from_detached(name_prefix=prefix, mesh=RankMesh(dp=2))
        # An explicit class and the matching mesh are accepted.
        again = RayWorkerGroup.from_detached(name_prefix=prefix, worker_cls=DetachedWorker, mesh=RankMesh(tp=2))
        assert again.add(0) == [(0, 0, 40), (1, 1, 40)]
    finally:
        wg.shutdown()
    deadline = time.monotonic() + 15
    while _named(prefix) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _named(prefix) == []
    while ray.available_resources().get("CPU", 0.0) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0.0) >= cpus  # detached placement groups removed


def test_unknown_prefix_is_a_clear_error(ray_session):
    with pytest.raises(BackendError, match="no detached worker group named 'nobody-here'"):
        RayWorkerGroup.from_detached(name_prefix="nobody-here")
