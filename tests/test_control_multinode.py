"""Node agents on a simulated multi-node cluster: one Ray task per node per call, both control paths.

The scenarios run in the shared simulated cluster's driver process (``simulated_cluster``,
tests/drivers.py), which returns one JSON report.  A 6-rank group spans ``node_a`` (4 ranks)
and ``node_c`` (2 ranks); the driver sits on the CPU-less head, so no rank shares its node and
every rank is served by its node's agent.  The same scenarios run with ``RANKMESH_CONTROL=ray``.
Which path a call took is read from the workers (the thread that ran it), not from the group.
"""

from __future__ import annotations

import pytest

PATHS = ("agent", "ray")


def scenarios(cluster) -> dict:
    """Runs inside the driver process: every scenario on both paths, one report."""
    import os
    import time

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.errors import WorkerDiedError, WorkerError
    from tests.control_workers import ControlWorker, kill_after

    report: dict = {}
    for path in PATHS:
        os.environ["RANKMESH_CONTROL"] = "auto" if path == "agent" else "ray"
        wg = RayWorkerGroup(RayResourcePool([4, 2], use_gpu=False), RayClassWithInitArgs(ControlWorker))
        got: dict = {}
        got["echo"] = wg.echo("x")
        got["threads"] = [sorted({t for _, _, t in log}) for log in wg.history()]
        got["paths"] = wg._executor.control_paths()
        got["agents"] = len(getattr(wg._executor.session, "agents", {}))
        got["nodes"] = len({i["node_id"] for i in wg._hosts.info})
        got["per_rank"] = wg.per_rank([1, 2, 3, 4, 5, 6])
        future = wg.slow_append("first", 0.3)
        wg.echo("second")
        future.get()
        got["order"] = [[(m, v) for m, v, _ in log] for log in wg.history()]
        try:
            wg.fail_on(4)
        except WorkerError as exc:
            got["error"] = {"rank": exc.rank, "text": str(exc)}
        got["after_error"] = wg.echo(1)
        killed = kill_after(wg._hosts.info[5]["pid"], 0.5)
        try:
            wg.sleep(20.0)
        except WorkerDiedError as exc:
            got["died"] = {"ranks": exc.ranks, "after_s": time.monotonic() - killed["at"]}
        wg.shutdown()
        report[path] = got
    os.environ.pop("RANKMESH_CONTROL", None)
    return report


@pytest.fixture(scope="module")
def report(simulated_cluster) -> dict:
    return simulated_cluster.run("tests.test_control_multinode:scenarios")


@pytest.mark.parametrize("path", PATHS)
def test_a_group_across_nodes_runs_every_call_on_both_paths(report, path):
    got = report[path]
    assert got["echo"] == ["x"] * 6
    assert got["nodes"] == 2
    assert got["paths"] == [path] * 6
    assert got["agents"] == (2 if path == "agent" else 0)
    session_thread = [["rankmesh-session"]] * 6
    assert (got["threads"] == session_thread) == (path == "agent")
    assert got["per_rank"] == [10, 21, 32, 43, 54, 65]  # value * 10 + rank, by hand
    assert got["order"] == [[["slow", "first"], ["echo", "second"]]] * 6  # JSON turns tuples into lists
    assert got["error"]["rank"] == 4 and "rank 4 refuses" in got["error"]["text"]
    assert got["after_error"] == [1] * 6


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_killed_on_another_node_is_named_within_two_seconds(report, path):
    """The agent sees the rank's pidfd at once; Ray's own detection (the fallback) may take longer."""
    died = report[path]["died"]
    assert died["ranks"] == [5]
    assert died["after_s"] < (2.0 if path == "agent" else 10.0)
