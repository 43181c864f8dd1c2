"""RayWorkerGroup: environment, rank order, rendezvous, errors, dead workers, shutdown, split pools."""

from __future__ import annotations

import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from rankmesh.backends.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    init_torch_distributed,
    split_resource_pool,
)
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.errors import BackendError, DispatchError, WorkerDiedError, WorkerEnvError, WorkerError  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402

ENV_KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA_FLAG"]


@ray.remote(num_gpus=3)  # decorator options are ignored: the pool decides resources
class EnvWorker(Worker):
    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.seen_in_init = {
            "rank": self.rank,
            "tp": self.rank_info.tp_rank,
            "env": {k: os.environ.get(k) for k in ENV_KEYS},
        }

    @register(Dispatch.ONE_TO_ALL)
    def report(self) -> dict:
        return {**self.seen_in_init, "pid": os.getpid(), "tag": self.tag, "local_rank": self.local_rank}

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self) -> dict:
        import psutil
        import torch.distributed as dist

        init_torch_distributed()
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        port = int(os.environ["MASTER_PORT"])
        listening = sorted(
            {c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == "LISTEN" and c.laddr.port == port}
        )
        return {"sum": float(t[0]), "backend": dist.get_backend(), "listening": listening}

    @register(Dispatch.ONE_TO_ALL)
    def fail_with_trace(self) -> None:
        if self.rank == 2:
            raise KeyError("missing-key-on-rank-2")

    @register(Dispatch.DP_COMPUTE)
    def sleep_or_fail(self, plan: str) -> str:
        if plan == "fail":
            raise RuntimeError("failed fast")
        time.sleep(float(plan))
        return plan


class PlainInitWorker(Worker):
    """verl style: torch.distributed.init_process_group(env://) in __init__, nothing else."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.tensordict_at_init = "tensordict" in sys.modules  # it takes batches (rows): imported as it starts
        dist.init_process_group("gloo")
        self.dist_rank = dist.get_rank()

    @register(Dispatch.ONE_TO_ALL)
    def imported_at_init(self) -> bool:
        return self.tensordict_at_init

    @register(Dispatch.DP_COMPUTE_PROTO)
    def rows(self, data):
        return data

    @register(Dispatch.ONE_TO_ALL)
    def ranks(self) -> tuple[int, int]:
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return self.dist_rank, int(t[0])

    @register(Dispatch.RANK_ZERO)
    def ping(self) -> int:
        return os.getpid()

    @register(Dispatch.DP_COMPUTE)
    def die_on(self, rank: int) -> int:
        if self.rank == rank:
            os._exit(1)
        return self.rank


class FailingInit(Worker):
    def __init__(self) -> None:
        if self.rank == 1:
            raise RuntimeError("no accelerator here")


def _cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


def _wait_cpus(target: float, timeout: float = 15.0) -> float:
    deadline = time.monotonic() + timeout
    while _cpus() < target and time.monotonic() < deadline:
        time.sleep(0.1)
    return _cpus()


@pytest.fixture(scope="module")
def env_group(ray_session):
    pool = RayResourcePool([2, 2], use_gpu=False)
    wg = RayWorkerGroup(
        pool,
        RayClassWithInitArgs(EnvWorker, tag="t"),
        mesh=RankMesh(tp=2, dp=2),
        worker_env={"EXTRA_FLAG": 1},
    )
    yield wg
    wg.shutdown()


def test_environment_and_context_in_init(env_group):
    info = env_group.report()
    assert [i["rank"] for i in info] == [0, 1, 2, 3]
    assert [i["tp"] for i in info] == [0, 1, 0, 1]
    envs = [i["env"] for i in info]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    # Both placement groups landed on the one node: local ranks count the node's processes.
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["EXTRA_FLAG"] for e in envs} == {"1"}
    assert len({i["pid"] for i in info}) == 4 and {i["tag"] for i in info} == {"t"}


def test_placement_is_visible(env_group):
    places = env_group.placements
    assert [(p.rank, p.node, p.local_rank, p.local_world_size) for p in places] == [(r, 0, r, 4) for r in range(4)]
    assert [i["node_ip"] for i in env_group.node_info] == ["127.0.0.1"] * 4
    assert env_group.node_of(3) == ray.nodes()[0]["NodeID"]
    assert env_group.spanning_groups() == []
    assert env_group.world_size == 4 and len(env_group.workers) == 4
    assert env_group.worker_names == [f"{env_group.name_prefix}_{r}" for r in range(4)]


def test_torch_distributed_gloo_all_reduce(env_group):
    out = env_group.all_reduce()
    assert [o["sum"] for o in out] == [10.0] * 4
    assert {o["backend"] for o in out} == {"gloo"}
    # Rank 0's store listens on the reserved port, on loopback only.
    assert out[0]["listening"] == ["127.0.0.1"]


def test_worker_error_carries_rank_coords_method_and_remote_traceback(env_group):
    with pytest.raises(WorkerError) as info:
        env_group.fail_with_trace()
    err = info.value
    assert err.rank == 2 and err.coords.to_dict() == {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    assert "fail_with_trace" in err.method and "missing-key-on-rank-2" in str(err)
    assert "raise KeyError" in str(err.__cause__)  # the worker's traceback text
    assert env_group.report()[0]["rank"] == 0  # the group still works


def test_failure_is_raised_without_waiting_for_blocked_ranks(env_group):
    start = time.monotonic()
    with pytest.raises(WorkerError, match="failed fast"):
        env_group.sleep_or_fail(["4", "fail", "0", "0"])
    assert time.monotonic() - start < 3.5
    time.sleep(max(0.0, 4.2 - (time.monotonic() - start)))  # let rank 0 finish its sleep


def test_worker_env_may_not_override_group_variables(ray_session):
    pool = RayResourcePool([1], use_gpu=False)
    with pytest.raises(WorkerEnvError, match="MASTER_PORT"):
        RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), worker_env={"MASTER_PORT": "1"})
    with pytest.raises(DispatchError, match="covers 2 ranks"):
        RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), mesh=RankMesh(dp=2))
    with pytest.raises(BackendError, match="detached pool"):
        RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker), detached=True)
    assert pool._slots is None  # nothing was started or reserved


def test_constructor_failure_names_the_rank_and_cleans_up(ray_session):
    total = ray.cluster_resources()["CPU"]
    before = _wait_cpus(total - 12)
    with pytest.raises(WorkerError, match=r"rank 1 .*FailingInit.__init__.*no accelerator"):
        RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(FailingInit))
    assert _wait_cpus(before) >= before


def test_plain_env_init_dead_worker_and_shutdown(ray_session):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(PlainInitWorker))
    assert wg.ranks() == [(0, 2), (1, 2)]
    # A group with a proto method imports tensordict while it starts, not on its first batch.
    assert wg.imported_at_init() == [True, True]
    assert wg.name_prefix == wg.trace_name == "PlainInitWorker"  # unnamed: its worker class, everywhere
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 .*died during die_on") as info:
        wg.die_on([1, 1])
    assert info.value.rank == 1 and time.monotonic() - start < 30
    with pytest.raises(WorkerDiedError, match="rank 1"):
        wg.die_on([5, 5])  # the dead rank fails at once on later calls too
    wg.shutdown()
    assert wg.closed
    with pytest.raises(BackendError, match="shut down"):
        wg.ping()
    # The same pool places again; a new group on it works.
    again = RayWorkerGroup(pool, RayClassWithInitArgs(PlainInitWorker))
    assert again.ranks() == [(0, 2), (1, 2)]
    again.shutdown()


def test_split_pool_groups(ray_session):
    pool = RayResourcePool([4], use_gpu=False)
    first, second = split_resource_pool(pool, 2)
    a = RayWorkerGroup(first, RayClassWithInitArgs(EnvWorker, tag="a"))
    b = RayWorkerGroup(second, RayClassWithInitArgs(EnvWorker, tag="b"))
    try:
        ra, rb = a.report(), b.report()
        assert [r["rank"] for r in ra] == [0, 1] == [r["rank"] for r in rb]
        assert [r["env"]["LOCAL_RANK"] for r in rb] == ["0", "1"]
        assert {r["tag"] for r in ra} == {"a"} and {r["tag"] for r in rb} == {"b"}
        assert not {r["pid"] for r in ra} & {r["pid"] for r in rb}
        assert ra[0]["env"]["MASTER_PORT"] != rb[0]["env"]["MASTER_PORT"]
        pgs = {i["placement_group_id"] for i in a.node_info + b.node_info}
        assert len(pgs) == 1  # both halves sit in the parent's one placement group
    finally:
        a.shutdown()
        assert pool._slots is not None  # b still uses the placement group
        b.shutdown()
    assert pool._slots is None


def test_two_groups_share_a_pool_with_max_colocate_count(ray_session):
    pool = RayResourcePool([1], use_gpu=False, max_colocate_count=2)
    first = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker, tag="first"))
    second = RayWorkerGroup(pool, RayClassWithInitArgs(EnvWorker, tag="second"))
    try:
        a, b = first.report()[0], second.report()[0]
        assert (a["tag"], b["tag"]) == ("first", "second") and a["pid"] != b["pid"]
        assert first.node_info[0]["placement_group_id"] == second.node_info[0]["placement_group_id"]
    finally:
        first.shutdown()
        second.shutdown()
    assert pool._slots is None


def test_bin_pack_false_is_refused_before_anything_starts():
    # verl's bin_pack=False means PACK placement groups; a pool places each entry on one node
    # (STRICT_PACK), so the group refuses it, naming the argument and the per-node alternative.
    with pytest.raises(BackendError, match=r"bin_pack=False .*STRICT_PACK.*RayResourcePool\(\[4, 4\]\)"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(EnvWorker), bin_pack=False)


def test_a_worker_finds_its_nodes_raylet(ray_session):
    # The tracer a reshard source declares (rankmesh.peermem.allow_peer_reads): the raylet that
    # started the worker, checked against the process tree and the driver's own record of the
    # raylet it started (Ray's node object).
    from rankmesh.backends.ray.runtime import raylet_pids, worker_raylet_pid

    @ray.remote(num_cpus=0)
    def probe():
        ppid = os.getppid()
        with open(f"/proc/{ppid}/comm") as f:
            return worker_raylet_pid(), ppid, f.read().strip(), os.environ.get("RAY_RAYLET_PID")

    found, ppid, parent_name, told = ray.get(probe.remote())
    assert parent_name == "raylet" and found == ppid
    assert told is None or int(told) == found
    if ray_session.started_here:
        assert raylet_pids() == [found]
    assert worker_raylet_pid() is None  # the driver was not started by a raylet


def test_ctrl_c_mid_call_stops_the_ranks_in_one_line_and_a_short_exception(ray_session, caplog):
    # A terminal's Ctrl-C reaches the caller's main thread as SIGINT while it waits on the ranks, and
    # Python's own handler raises KeyboardInterrupt.  A test run earlier in this process may have set
    # another handler: a script's default is put back for this test.
    import signal
    import threading
    import traceback

    import psutil

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        wg = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(EnvWorker))
        pid = wg.report()[0]["pid"]
        timer = threading.Timer(1.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="rankmesh"), \
                pytest.raises(KeyboardInterrupt, match="sleep_or_fail interrupted") as info:
            wg.sleep_or_fail(["60"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 10
    # One line says what happens; the exception's traceback ends in the group method, not the wait loop.
    assert [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()] == [
        "interrupted: stopping 1 worker process of EnvWorker"
    ]
    frames = traceback.extract_tb(info.value.__traceback__)
    assert [f.name for f in frames] == ["test_ctrl_c_mid_call_stops_the_ranks_in_one_line_and_a_short_exception", "__call__"]
    assert info.value.__suppress_context__
    assert wg.closed
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_start_up_bar_shows_no_rate_or_time_left(monkeypatch):
    # The stages are not alike (placing: a second; importing megatron-core: a minute), so a bar
    # must not extrapolate from the first ones: no "<mm:ss" left and no "s/stage" rate.
    import io

    from rankmesh.backends.ray.startup import StartupProgress

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    progress = StartupProgress("actor", 2, show=True)
    progress.controller_stage("placed")
    progress.controller_stage("processes")
    shown = err.getvalue()
    progress.close()
    assert "actor: placed: stage " in shown and "/4 [00:00]" in shown
    assert "<" not in shown and "/stage" not in shown and "it/s" not in shown
