"""Hang localization on Ray: a call past its timeout or its stall threshold says where each rank is.

Real Ray (the session's), real worker processes, real gloo groups on a tp2·dp2 mesh.  Expected
groups are derived by hand from megatron's order (``tp-cp-ep-dp-pp``: tp varies fastest, so
rank = tp + 2·dp): the dp group of a rank keeps its tp coordinate (ranks {tp, tp + 2}), the tp
group keeps its dp coordinate (ranks {2·dp, 2·dp + 1}).  A test that leaves ranks blocked in a
collective unblocks them by sending the missing peer into the same collective, so the module's
group stays usable (and calls stay ordered: each rank's next call runs after its stuck one).
"""

from __future__ import annotations

import logging
import pickle
import time

import pytest

ray = pytest.importorskip("ray")

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.backends.ray.hangs import GATHER_BUDGET_S, gather_hangs  # noqa: E402
from rankmesh.backends.ray.calls import Pending  # noqa: E402
from rankmesh.errors import FetchTimeoutError, HangError, WorkerDiedError  # noqa: E402
from rankmesh.hangs.report import DEAD, STUCK  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests.hang_workers import HangWorker  # noqa: E402

#: The issue's target: the report is ready at most this long after the timeout.
REPORT_DEADLINE_S = 2.0
#: Hand-derived coordinates of the tp2·dp2 ranks (rank = tp + 2·dp).
COORDS = {0: {"tp": 0, "dp": 0}, 1: {"tp": 1, "dp": 0}, 2: {"tp": 0, "dp": 1}, 3: {"tp": 1, "dp": 1}}
DP_GROUP = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
TP_GROUP = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
WAITING_LOGGER = "rankmesh.backends.ray.waiting"


@pytest.fixture(scope="module")
def group(ray_session):
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(HangWorker), mesh=RankMesh(tp=2, dp=2))
    assert wg.setup_groups() == [list(DP_GROUP[r]) for r in range(4)]
    yield wg
    wg.shutdown()


def timed_hang(call, timeout_s: float) -> tuple[HangError, float]:
    """Run ``call`` (which must time out after ``timeout_s``); the error and seconds past the timeout."""
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        call()
    return info.value, time.monotonic() - start - timeout_s


def coords_of(hang) -> dict[str, int]:
    return {a: hang.coords[a] for a in ("tp", "dp")}


@pytest.mark.timeout(60)
def test_stuck_in_user_code_names_the_function(group):
    err, late = timed_hang(lambda: group.with_timeout(1.0).act(["ok", "ok", "sleep:2.5", "ok"]), 1.0)
    assert isinstance(err, FetchTimeoutError) and err.ranks == [2]  # still catchable as before
    assert late <= REPORT_DEADLINE_S and err.report.gather_s <= GATHER_BUDGET_S
    assert err.finished == [0, 1, 3]
    (hang,) = err.hangs
    assert (hang.rank, hang.state, coords_of(hang), hang.node) == (2, STUCK, COORDS[2], "127.0.0.1")
    assert hang.place.function == "stuck_in_user_code" and hang.place.file.endswith("hang_workers.py")
    assert hang.collective is None
    names = [f.function for f in hang.call_frames]
    assert names.index("stuck_in_user_code") < names.index("_follow") < names.index("_run")  # innermost first (the host runs both paths through _run)
    assert len(hang.stacks.threads) > 1  # every thread of the process, the call's first
    text = str(err)
    assert text.startswith("act: ranks [2] did not finish within 1 s")
    assert "rank 2 (tp0 dp1) on node 127.0.0.1: in stuck_in_user_code" in text and "finished: ranks 0, 1, 3" in text
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, HangError) and again.hangs == err.hangs and str(again) == text
    assert group.act(["ok"] * 4) == [0, 1, 2, 3]  # waits behind the sleep, then works


@pytest.mark.timeout(60)
def test_stuck_in_a_collective_names_op_and_axis_group(group):
    # Rank 0 skips the all_reduce: rank 2 waits for it on their dp group; 1 and 3 complete theirs.
    err, late = timed_hang(lambda: group.with_timeout(1.0).act(["skip", "allreduce:dp", "allreduce:dp", "allreduce:dp"]), 1.0)
    assert late <= REPORT_DEADLINE_S
    assert err.ranks == [2] and err.finished == [0, 1, 3]
    (hang,) = err.hangs
    c = hang.collective
    assert (c.op, c.group, c.ranks) == ("all_reduce", "dp", DP_GROUP[2])
    assert hang.place.function == "_follow"  # the user frame that called all_reduce
    assert "rank 2 (tp0 dp1) on node 127.0.0.1: all_reduce on dp group [0, 2] in _follow" in str(err)
    # Rank 0 joins: rank 2's stuck call completes, then its next call runs.
    assert group.act(["allreduce:dp", "ok", "ok", "ok"]) == [2, 1, 2, 3]


@pytest.mark.timeout(60)
def test_ranks_stuck_at_one_place_share_one_entry(group):
    # Ranks 0 and 2 skip: 1 and 3 wait in their tp groups [0, 1] and [2, 3].
    err, late = timed_hang(lambda: group.with_timeout(1.0).act(["skip", "allreduce:tp", "skip", "allreduce:tp"]), 1.0)
    assert late <= REPORT_DEADLINE_S and err.ranks == [1, 3] and err.finished == [0, 2]
    assert [(h.collective.op, h.collective.group, h.collective.ranks) for h in err.hangs] == [
        ("all_reduce", "tp", TP_GROUP[1]),
        ("all_reduce", "tp", TP_GROUP[3]),
    ]
    (place,) = err.report.places()
    assert [h.rank for h in place] == [1, 3]
    assert "ranks 1, 3 (tp1 dp0, tp1 dp1) on node 127.0.0.1: all_reduce on tp groups [0, 1], [2, 3]" in str(err)
    assert group.act(["allreduce:tp", "ok", "allreduce:tp", "ok"]) == [2, 1, 2, 3]


@pytest.mark.timeout(60)
def test_timeout_of_a_future_reports_too(group):
    fut = group.with_timeout(0.8).act_nb(["ok", "sleep:2", "ok", "ok"])
    err, late = timed_hang(fut.get, 0.8)
    assert late <= REPORT_DEADLINE_S + 0.5  # the clock started before submit here
    assert err.ranks == [1] and err.hangs[0].place.function == "stuck_in_user_code"
    assert group.act(["ok"] * 4) == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_stall_warning_logs_once_and_the_call_returns(group, caplog):
    caplog.set_level(logging.WARNING, logger=WAITING_LOGGER)
    assert group.with_timeout(stall_warn_s=0.4).act(["ok", "ok", "sleep:1.5", "ok"]) == [0, 1, 2, 3]
    warnings = [r for r in caplog.records if r.name == WAITING_LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    text = warnings[0].getMessage()
    assert "ranks [2] still running after 0.4 s" in text and "rank 2 (tp0 dp1)" in text and "in stuck_in_user_code" in text
    assert "finished: ranks 0, 1, 3" in text
    # Per group: the executor's setting applies to every call; off again, no warning.
    caplog.clear()
    group.executor.stall_warn_s = 0.4
    try:
        assert group.act(["sleep:1", "ok", "ok", "ok"]) == [0, 1, 2, 3]
    finally:
        group.executor.stall_warn_s = None
    assert group.act(["sleep:1", "ok", "ok", "ok"]) == [0, 1, 2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.name == WAITING_LOGGER]
    assert len(warnings) == 1 and "rank 0 (tp0 dp0)" in warnings[0]


@pytest.mark.timeout(120)
def test_dead_rank_is_reported_dead_not_stuck(ray_session):
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(HangWorker), mesh=RankMesh(tp=2, dp=2))
    try:
        wg.setup_groups()
        # Rank 3 ends its process while rank 1 waits for it in their dp group.
        with pytest.raises(WorkerDiedError) as info:
            wg.with_timeout(5).act(["allreduce:dp", "allreduce:dp", "allreduce:dp", "exit"])
        assert not isinstance(info.value, HangError) and info.value.ranks == [3]
        # Asking processes that are gone (the failed group killed them all) says dead, at once.
        actors = wg.executor.hosts.actors
        deadline = time.monotonic() + 30
        for rank, actor in enumerate(actors):  # wait until Ray knows every process is gone: the kill is
            while True:  # asynchronous, and a ping sent before it lands is still answered
                try:
                    ray.get(actor.ping.remote(), timeout=30)
                except ray.exceptions.RayActorError:
                    break
                assert time.monotonic() < deadline, f"rank {rank} still answers 30 s after the group failed"
                time.sleep(0.1)
        pending = [Pending(None, r, "act", "127.0.0.1", RankMesh(tp=2, dp=2).rank_coords(r)) for r in range(4)]
        start = time.monotonic()
        report, died = gather_hangs(actors, pending, [], after_s=5.0)
        assert time.monotonic() - start <= GATHER_BUDGET_S + 0.5
        assert [h.state for h in report.hangs] == [DEAD] * 4 and sorted(died) == [0, 1, 2, 3]
        assert report.dead == [0, 1, 2, 3] and "process dead" in report.text()
    finally:
        wg.shutdown()


@pytest.mark.timeout(60)
def test_calls_stay_one_at_a_time_and_in_order(group):
    # The control group answers beside a call; calls themselves still queue on each rank.
    start = time.monotonic()
    first = group.act_nb(["sleep:0.8"] * 4)
    assert group.act(["ok"] * 4) == [0, 1, 2, 3]
    assert time.monotonic() - start >= 0.8  # the second call waited for the first on every rank
    assert first.get() == [0, 1, 2, 3]


@pytest.mark.timeout(60)
def test_bad_limits_are_named(group):
    from rankmesh.errors import BackendError, DispatchError

    with pytest.raises(DispatchError, match="stall_warn_s"):
        group.with_timeout(stall_warn_s=0)
    with pytest.raises(DispatchError, match="needs timeout_s, stall_warn_s or both"):
        group.with_timeout()
    with pytest.raises(BackendError, match="stall_warn_s"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(HangWorker), stall_warn_s=-1)
