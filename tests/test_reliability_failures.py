"""Failures on Ray: worker errors, dead workers (also while peers block in gloo), timeouts,
shutdown and reuse.

Groups are small (2-4 ranks).  Tests that kill processes build their own group; the others
share one module group.  Every test that could hang has a timeout.
"""

from __future__ import annotations

import pickle
import time

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.data import DataProto, DataProtoFuture  # noqa: E402
from rankmesh.errors import BackendError, DispatchError, FetchTimeoutError, WorkerDiedError, WorkerError  # noqa: E402
from rankmesh.futures import GroupFuture  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests.reliability_workers import FaultWorker  # noqa: E402

#: What the issue promises for a dead worker; the tests check it.
DEATH_DEADLINE_S = 10.0


def batch(rows: int, **meta) -> DataProto:
    x = torch.arange(rows)
    return DataProto.from_dict({"x": x}, meta_info=dict(meta))


@pytest.fixture(scope="module")
def group(ray_session):
    # Ray actors: these calls run under 0.3-0.5 s timeouts through Ray's tasks, and a forked rank's
    # holder imports torch when the first tensor reaches it (seconds on a loaded machine).
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(FaultWorker), mesh=RankMesh(tp=2, dp=2),
                        process_model="ray")
    yield wg
    wg.shutdown()


def _alive_pids(wg) -> list[int]:
    return wg.pid()


# ----- worker errors ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_worker_error_has_rank_coords_node_traceback_and_others(group):
    with pytest.raises(WorkerError) as info:
        group.act(["ok", "raise", "raise", "raise"])
    err = info.value
    assert err.rank == 1 and err.coords.to_dict() == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 0}
    assert "FaultWorker.act" in err.method and err.node == "127.0.0.1"
    assert "planned failure on rank 1" in str(err)
    assert "ValueError" in err.remote_traceback and "follow" in err.remote_traceback
    assert [o.rank for o in err.others] == [2, 3]
    assert err.others[0].coords.to_dict() == {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    again = pickle.loads(pickle.dumps(err))
    assert (again.rank, again.node, again.remote_traceback, [o.rank for o in again.others]) == (
        1, "127.0.0.1", err.remote_traceback, [2, 3]
    )
    assert group.act(["ok"] * 4) == [0, 1, 2, 3]  # a raising method does not fail the group


@pytest.mark.timeout(60)
def test_worker_error_through_futures(group):
    fut = group.act_nb(["raise", "ok", "ok", "raise"])
    assert isinstance(fut, GroupFuture)
    with pytest.raises(WorkerError) as info:
        fut.get()
    assert info.value.rank == 0 and [o.rank for o in info.value.others] == [3]
    proto = group.echo_nb(batch(8, plan=["ok", "ok", "raise", "ok"]))
    assert isinstance(proto, DataProtoFuture)
    with pytest.raises(WorkerError, match="planned failure on rank 2") as info:
        proto.get()
    assert info.value.coords.dp == 1 and info.value.remote_traceback


# ----- timeouts -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_call_timeout_names_unfinished_ranks(group):
    start = time.monotonic()
    with pytest.raises(FetchTimeoutError) as info:
        group.with_timeout(0.5).act(["ok", "sleep:2", "ok", "sleep:2"])
    assert info.value.ranks == [1, 3] and time.monotonic() - start < 1.8
    fut = group.with_timeout(0.3).echo_nb(batch(4, plan=["sleep:1.5", "ok", "ok", "ok"]))
    with pytest.raises(FetchTimeoutError) as info:
        fut.get()
    assert 0 in info.value.ranks and 2 not in info.value.ranks  # 1 and 3 may still run the sleep above
    # The slow ranks keep running; the next call waits behind them and then works.
    assert group.act(["ok"] * 4) == [0, 1, 2, 3]
    with pytest.raises(DispatchError, match="positive"):
        group.with_timeout(0)


@pytest.mark.timeout(60)
def test_group_call_timeout_and_bad_values(group):
    with pytest.raises(BackendError, match="call_timeout_s"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(FaultWorker), call_timeout_s=-1)
    executor = group.executor
    executor.call_timeout_s = 0.4
    try:
        with pytest.raises(FetchTimeoutError, match=r"ranks \[2\]"):
            group.act(["ok", "ok", "sleep:1.2", "ok"])
        assert group.call_timeout_s == 0.4
    finally:
        executor.call_timeout_s = None
    assert group.act(["ok"] * 4) == [0, 1, 2, 3]


# ----- dead workers (own groups: they kill processes) ---------------------------------------------


def _cpus() -> float:
    return ray.available_resources().get("CPU", 0.0)


@pytest.mark.timeout(120)
def test_killed_worker_while_peer_blocks_in_gloo_fails_the_group(ray_session):
    pool = RayResourcePool([2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(FaultWorker), call_timeout_s=60)
    pids = wg.pid()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        wg.act(["allreduce", "kill"])  # rank 0 waits in all_reduce for rank 1, which dies
    took = time.monotonic() - start
    err = info.value
    assert took < DEATH_DEADLINE_S, took
    assert err.ranks == [1] and {r: c.to_dict() for r, c in err.coords.items()} == {1: {"tp": 0, "cp": 0, "ep": 0, "dp": 1, "pp": 0}} and "act" in err.method
    assert wg.failed is err
    # Later calls fail at once, naming the same rank.
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="failed earlier") as again:
        wg.pid()
    assert again.value.ranks == [1] and time.monotonic() - start < 0.5
    # The blocked peer was stopped, not left hanging in its collective.
    import psutil

    deadline = time.monotonic() + 10
    while psutil.pid_exists(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE
    # Shutdown releases everything; the same pool hosts a working group afterwards.
    wg.shutdown()
    assert pool._slots is None
    fresh = RayWorkerGroup(pool, RayClassWithInitArgs(FaultWorker))
    try:
        assert fresh.act(["ok", "ok"]) == [0, 1]
    finally:
        fresh.shutdown()


@pytest.mark.timeout(120)
def test_dead_worker_through_a_dataproto_future(ray_session):
    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(FaultWorker))
    try:
        # The future's fetcher reaches its group's executor by weak reference, which does not
        # travel: a copy unpickled elsewhere is the same fetcher (futures merge) that only raises.
        fetcher = wg.executor.fetcher()
        moved = pickle.loads(pickle.dumps(fetcher))
        assert moved == fetcher and hash(moved) == hash(fetcher)
        assert fetcher.executor() is wg.executor and moved.executor is None
        fut = wg.echo_nb(batch(4, plan=["sleep:30", "exit"]))
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            fut.get()
        assert time.monotonic() - start < DEATH_DEADLINE_S
        assert info.value.ranks == [1] and "echo_nb" in info.value.method
        assert wg.failed is not None  # the future's fetch failed the group too
        with pytest.raises(WorkerDiedError, match="failed earlier"):
            wg.act(["ok", "ok"])
    finally:
        wg.shutdown()


# ----- data integrity on Ray (the in-process properties: tests/test_reliability_input.py) ---------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rankmesh.errors import PaddingError  # noqa: E402
from tests.test_reliability_input import batches, fingerprint, rows_fingerprint, same_meta  # noqa: E402


@pytest.mark.timeout(120)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=batches(max_rows=9), blocking=st.booleans())
def test_ray_round_trip_is_exact(group, data, blocking):
    before = fingerprint(data)
    try:
        out = group.echo(data) if blocking else group.echo_nb(data).get()
    except PaddingError:
        assert len(data) % 4 != 0  # DP_COMPUTE_PROTO: one piece per rank, no padding asked
    else:
        assert rows_fingerprint(out) == rows_fingerprint(data) and same_meta(out.meta_info, data.meta_info)
    assert fingerprint(data) == before


@pytest.mark.timeout(120)
def test_ray_large_batch_with_nan_round_trips(group):
    big = DataProto.from_dict({"big": torch.full((4, 2_000_000), float("nan")), "zero": torch.zeros(4, 0)})
    big.batch["big"][1, ::7] = 1.5
    before = fingerprint(big)
    assert fingerprint(group.echo(big))[0] == before[0] and fingerprint(big) == before
