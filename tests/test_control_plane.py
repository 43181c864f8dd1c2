"""Both control paths of a Ray group: the call session (shared-memory ring) and one Ray task per rank.

Real Ray (the session's), real worker processes.  Each scenario runs on both paths: ``session``
(the default: blocking calls with inline arguments to ranks on this node go through the group's
call session) and ``ray`` (``RANKMESH_CONTROL=ray``).  Which path a call took is read from the
worker, not from the group: a session call runs on the host's ``rankmesh-session`` thread, a
Ray call on one of Ray's.  The dispatch modes whose calls may take the session (inline
arguments) run from the backend-neutral matrix on the Ray path in ``tests/test_control_dispatch.py``;
``tests/test_ray_dispatch.py`` runs the whole matrix on the default path.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import pytest

ray = pytest.importorskip("ray")

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.backends.ray.executor import CONTROL_ENV  # noqa: E402
from rankmesh.backends.ray.wire import REPLY_BYTES  # noqa: E402
from rankmesh.errors import BackendError, HangError, WorkerDiedError, WorkerError  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests.control_workers import ControlWorker, kill_after  # noqa: E402
from tests.ring_workers import ring_fds  # noqa: E402

PATHS = ("session", "ray")
SESSION_THREAD = "rankmesh-session"


@contextmanager
def control_path(path: str):
    """Groups built inside take ``path`` (the environment is read when a group is built)."""
    before = os.environ.get(CONTROL_ENV)
    os.environ[CONTROL_ENV] = "auto" if path == "session" else "ray"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONTROL_ENV, None)
        else:
            os.environ[CONTROL_ENV] = before


def make_group(path: str, world: int = 4, **kwargs) -> RayWorkerGroup:
    """A group of new processes whose calls take ``path``."""
    with control_path(path):
        return RayWorkerGroup(RayResourcePool([world], use_gpu=False), RayClassWithInitArgs(ControlWorker), **kwargs)


@pytest.fixture(scope="module")
def groups(host_bank):
    """One 4-rank group per path, in the host bank's running processes."""
    made = {}
    for path in PATHS:
        with control_path(path):
            made[path] = host_bank.build(RayClassWithInitArgs(ControlWorker), RankMesh(dp=4))
    yield made
    for wg in made.values():
        host_bank.give_back(wg)


def threads_of(log) -> set[str]:
    return {thread for _, _, thread in log}


@pytest.mark.parametrize("path", PATHS)
def test_calls_take_the_path_the_group_reports(groups, path):
    wg = groups[path]
    wg.history()
    assert wg.echo("x") == ["x"] * 4
    logs = wg.history()
    assert [[(m, v) for m, v, _ in log] for log in logs] == [[("echo", "x")]] * 4
    on_session = [threads_of(log) == {SESSION_THREAD} for log in logs]
    assert on_session == [path == "session"] * 4
    assert [info["control"] for info in wg.transport_info()] == [path] * 4
    # A call with an argument stored in the object store takes Ray's path on both groups.
    blob = b"z" * (1 << 17)
    assert wg.echo(blob) == [blob] * 4
    assert all(SESSION_THREAD not in threads_of(log) for log in wg.history())


@pytest.mark.parametrize("path", PATHS)
def test_calls_run_in_the_order_they_were_sent_whichever_path(groups, path):
    """A session call sent after a non-blocking Ray call runs after it on every rank."""
    wg = groups[path]
    wg.history()
    future = wg.slow_append("first", 0.4)
    assert wg.echo("second") == ["second"] * 4
    future.get()
    assert [[(m, v) for m, v, _ in log] for log in wg.history()] == [[("slow", "first"), ("echo", "second")]] * 4


@pytest.mark.parametrize("path", PATHS)
def test_a_ranks_error_names_the_rank_with_its_traceback(groups, path):
    wg = groups[path]
    with pytest.raises(WorkerError) as info:
        wg.fail_on(2)
    err = info.value
    assert err.rank == 2 and err.method == "ControlWorker.fail_on"
    assert "rank 2 refuses" in str(err) and "ValueError" in err.remote_traceback
    assert wg.echo(7) == [7] * 4  # the group goes on


@pytest.mark.parametrize("path", PATHS)
def test_outputs_bigger_than_an_answer_slot_arrive_whole(groups, path):
    wg = groups[path]
    size = REPLY_BYTES + 4096
    out = wg.big(size)
    assert [len(b) for b in out] == [size] * 4 and [b[:1] for b in out] == [bytes([r]) for r in range(4)]
    parked = ray.get([actor.parked_outputs.remote() for actor in wg.workers])
    assert parked == [0] * 4  # each output taken once, nothing kept in the workers


@pytest.mark.parametrize("path", PATHS)
def test_a_call_past_its_timeout_says_where_each_rank_is(groups, path, caplog):
    wg = groups[path]
    wg.history()
    with pytest.raises(HangError) as info:
        wg.with_timeout(0.5).sleep(2.0)
    err = info.value
    assert err.ranks == [0, 1, 2, 3]
    assert {h.place.function for h in err.hangs} == {"sleep"}
    assert "keep running" in str(err) and "kill_ranks" in str(err)
    # Right after the timeout, the next call waits for the ranks to end the abandoned one (saying so at
    # once), then runs after it on every rank.
    with caplog.at_level("WARNING", logger="rankmesh"):
        assert wg.with_timeout(10).echo("after") == ["after"] * 4
    assert any("still run sleep" in r.getMessage() for r in caplog.records)
    assert [[m for m, _, _ in log] for log in wg.history()] == [["echo"]] * 4


@pytest.mark.parametrize("path", PATHS)
def test_futures_chain_across_paths(groups, path):
    """A non-blocking call's future handed to the other group's call, whose ranks fetch it themselves.

    Expected values by hand: rows_later gives x * 10 + rank for each row (dp=4: one row per rank),
    and every rank of the consumer sees the whole column.  A future is an object-store argument,
    so the consumer's call takes Ray's tasks on either group, and its ranks run it after the
    producer's call."""
    import torch

    from rankmesh import DataProto

    wg, other = groups[path], groups["ray" if path == "session" else "session"]
    wg.history()
    other.history()
    batch = DataProto.from_dict({"x": torch.tensor([1, 2, 3, 4])})
    future = wg.rows_later(batch)  # non-blocking: Ray's tasks on both groups
    assert other.total(future) == [[10, 21, 32, 43]] * 4
    # ... and the other way round, from a blocking call's output, through the store again.
    out = other.rows_now(batch)
    assert wg.total(out) == [[10, 21, 32, 43]] * 4
    assert [[m for m, _, _ in log] for log in wg.history()] == [["rows_later", "total"]] * 4
    assert [[m for m, _, _ in log] for log in other.history()] == [["total", "rows_now"]] * 4


@pytest.mark.parametrize("path", PATHS)
def test_an_inline_argument_written_by_one_call_is_sent_afresh_to_the_next(groups, path):
    """A rank decodes each call's arguments afresh: a method that writes its (inline) argument
    changes nothing a later call with the same argument receives.  Expected by hand: ``append_rank``
    appends the rank to the list it was sent, so every call returns ``[7, rank]``."""
    wg = groups[path]
    for _ in range(3):
        assert wg.append_rank([7]) == [[7, r] for r in range(4)]


@pytest.mark.parametrize("path", PATHS)
def test_a_small_batch_rides_inside_the_call_and_each_rank_writes_its_own_copy(groups, path):
    """A DataProto that pickles to at most Ray's inline size (100 KiB) travels inside the call's
    header, not through the object store: no put, and on the default path the call takes the
    session (read from the thread that ran it).  Each rank unpickles its own copy: ``scribble``
    adds ``rank + 1`` in place and reads back only its own write (expected by hand), and the
    caller's batch is unchanged.  A small batch whose ``meta_info`` holds an ObjectRef (pickled
    outside Ray's serialization it would stay pinned) takes the store (one put) and Ray's tasks."""
    import torch

    from rankmesh import DataProto

    wg = groups[path]
    stats = wg.executor.stats
    wg.history()
    small = DataProto.from_dict({"x": torch.tensor([100, 200])})
    puts = stats.puts
    assert wg.scribble(small) == [[100 + r + 1, 200 + r + 1] for r in range(4)]
    assert small.batch["x"].tolist() == [100, 200]
    assert wg.rows_nap(DataProto.from_dict({"x": torch.tensor([0.0, 0.0])})) == [0, 1, 2, 3]
    assert stats.puts == puts
    logs = wg.history()
    assert [[m for m, _, _ in log] for log in logs] == [["rows_nap"]] * 4
    assert [threads_of(log) == {SESSION_THREAD} for log in logs] == [path == "session"] * 4

    holds_ref = DataProto.from_dict({"x": torch.zeros(2)}, meta_info={"ref": ray.put(1)})
    puts = stats.puts
    assert wg.rows_nap(holds_ref) == [0, 1, 2, 3]
    assert stats.puts == puts + 1
    logs = wg.history()
    assert [[m for m, _, _ in log] for log in logs] == [["rows_nap"]] * 4
    assert all(SESSION_THREAD not in threads_of(log) for log in logs)


def memory_files() -> list[str]:
    """This process's open fds that are memory files of call arguments (``rankmesh.sharedmem.write_file``)."""
    found = []
    for n in os.listdir("/proc/self/fd"):
        try:
            if "rankmesh-shared" in os.readlink(f"/proc/self/fd/{n}"):
                found.append(n)
        except OSError:
            continue
    return found


@pytest.mark.parametrize("path", PATHS)
def test_a_large_batch_is_mapped_by_each_rank_on_the_node_and_written_in_its_own_copy(groups, path):
    """A batch over the inline size, to a group on the caller's node: on the default path it is
    written into a memory file that each rank maps copy-on-write (no put, and the call takes the
    session: read from the thread that ran it); on the Ray path it is put once and each rank gets
    a Ray task.  Either way each rank writes only its own copy (``scribble_ends`` adds
    ``rank + 1`` in place, waits for the others, and reads back its first and last values:
    expected by hand), the caller's batch is unchanged, and each call reads its own batch (the
    values differ from call to call).  On the default path the files are reused once every rank
    let its views go (``scribble_ends`` keeps none), so the caller holds at most two more open
    than before, however many calls."""
    import torch

    from rankmesh import DataProto

    wg = groups[path]
    stats = wg.executor.stats
    wg.history()
    n = 256 << 10  # 1 MiB of float32: over the inline size (100 KiB)
    before = set(memory_files())  # the in-process backend's store keeps such files too
    for start in (0, 1000, 2000, 3000):
        big = torch.arange(start, start + n, dtype=torch.float32)
        puts, maps = stats.puts, stats.maps
        assert wg.scribble_ends(DataProto.from_dict({"x": big})) == [[start + r + 1, start + n - 1 + r + 1]
                                                                     for r in range(4)]
        assert (float(big[0]), float(big[-1])) == (start, start + n - 1)
        assert (stats.puts - puts, stats.maps - maps) == ((0, 1) if path == "session" else (1, 0))
        logs = wg.history()
        assert [[m for m, _, _ in log] for log in logs] == [["scribble_ends"]] * 4
        assert [threads_of(log) == {SESSION_THREAD} for log in logs] == [path == "session"] * 4
        assert len(set(memory_files()) - before) <= 2
    if path == "session":
        assert wg.executor.session.files.reused >= 2


@pytest.mark.parametrize("path", PATHS)
def test_a_large_batch_given_up_mid_call_leaves_later_calls_their_own_bytes(groups, path):
    """A data call with a large batch runs past its deadline (``rows_nap`` sleeps its first value,
    1.5 s) and is given up while its ranks still hold their input; the calls after it, queued
    behind it, each get their own bytes (``scribble_ends``: expected by hand), and the caller keeps
    at most two more memory files open than before (the given-up call's is let go once its ranks
    end it)."""
    import torch

    from rankmesh import DataProto

    wg = groups[path]
    n = 256 << 10  # 1 MiB of float32
    before = set(memory_files())
    slow = torch.zeros(n)
    slow[0] = 1.5
    with pytest.raises(HangError):
        wg.with_timeout(0.5).rows_nap(DataProto.from_dict({"x": slow}))
    for start in (5000, 6000, 7000):
        big = torch.arange(start, start + n, dtype=torch.float32)
        assert wg.with_timeout(30).scribble_ends(DataProto.from_dict({"x": big})) == [
            [start + r + 1, start + n - 1 + r + 1] for r in range(4)]
    assert len(set(memory_files()) - before) <= 2
    wg.history()


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_killed_mid_call_is_named_within_two_seconds(ray_session, path):
    before = ring_fds()
    wg = make_group(path)
    try:
        wg.echo(0)
        killed = kill_after(wg._hosts.info[1]["pid"], 0.5)
        with pytest.raises(WorkerDiedError) as info:
            wg.sleep(20.0)
        assert time.monotonic() - killed["at"] < 2.0
        assert info.value.ranks == [1]
        with pytest.raises(WorkerDiedError):  # the group failed: later calls refuse at once
            wg.echo(1)
    finally:
        wg.shutdown()
    assert ring_fds() == before  # the session's rings were closed with it: no memfd or eventfd left


@pytest.mark.parametrize("path", PATHS)
def test_a_replaced_rank_joins_the_group_on_its_path(ray_session, path):
    """After a replacement the session path opens a new session with the new process."""
    wg = make_group(path, world=2, on_rank_death="replace")
    try:
        wg.echo(0)
        old = wg._hosts.info[1]["pid"]
        os.kill(old, signal.SIGKILL)
        assert wg.echo("retried") == ["retried"] * 2  # replaced, then retried once
        assert wg._hosts.info[1]["pid"] != old
        wg.history()
        assert wg.echo("next") == ["next"] * 2
        threads = [threads_of(log) for log in wg.history()]
        assert (threads == [{SESSION_THREAD}] * 2) == (path == "session"), threads
    finally:
        wg.shutdown()


def test_set_control_switches_paths_and_keeps_order(groups):
    wg = groups["session"]
    wg.history()
    try:
        wg.set_control("ray")
        assert wg.echo("on ray") == ["on ray"] * 4
        wg.set_control("auto")
        assert wg.echo("on session") == ["on session"] * 4
        logs = wg.history()
        assert [[(m, v) for m, v, _ in log] for log in logs] == [[("echo", "on ray"), ("echo", "on session")]] * 4
        assert all(log[0][2] != SESSION_THREAD and log[1][2] == SESSION_THREAD for log in logs)
        with pytest.raises(BackendError, match="set_control"):
            wg.set_control("fast")
    finally:
        wg.set_control("auto")


def test_control_setting_is_checked_before_ray_starts(monkeypatch):
    """A typo in RANKMESH_CONTROL fails at construction, before Ray or any process starts (no Ray needed here)."""
    monkeypatch.setenv(CONTROL_ENV, "sesion")
    ray_was_up = ray.is_initialized()
    started = time.perf_counter()
    with pytest.raises(BackendError) as info:
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ControlWorker))
    assert time.perf_counter() - started < 2 and ray.is_initialized() == ray_was_up
    text = str(info.value)
    assert "RANKMESH_CONTROL='sesion' is not a control mode" in text and "'auto'" in text and "'ray'" in text, text


def test_a_rank_task_of_an_agent_answers_small_outputs_inline_and_large_ones_by_reference(groups):
    """The agent's carrier for its node's data-call tasks (``agent.RankTasks``), run here against a
    real host's ``execute_for``: an output Ray returned inside the task's reply (``echo``, a few
    bytes) comes back as its value; one left in the store (``big``, 2 MiB, over Ray's 100 KiB
    direct-call size) as a ``Stored`` reference to it; a rank that runs nothing back (``noop``)
    as ``None``.  Expected by hand from the methods' outputs."""
    from rankmesh.backend import RankCall
    from rankmesh.backends.ray.agent import RankTasks, Stored
    from rankmesh.backends.ray.calls import Pending
    from rankmesh.backends.ray.wire import encode_rank_call

    host = groups["ray"].executor.hosts.actors[0]
    calls = [("echo", ("tiny",)), ("big", (2 << 20,)), ("noop", ())]
    pending = []
    for method, args in calls:
        header = encode_rank_call(None, method, RankCall(0, args))[0]
        handle = tuple(host.execute_for.options(num_returns=2).remote(0, 0, None, header))  # call 0: no session to tell
        pending.append(Pending(handle, 0, method, carrier=RankTasks.name))
    got = {}
    end = time.monotonic() + 30
    while len(got) < len(pending) and time.monotonic() < end:
        left = [i for i in range(len(pending)) if i not in got]
        got.update((left[k], outcome) for k, outcome in RankTasks().poll([pending[i] for i in left], 1.0).items())
    assert all(o.error is None for o in got.values()), got
    assert got[0].value == "tiny"
    assert isinstance(got[1].value, Stored) and ray.get(got[1].value.ref) == bytes([0]) * (2 << 20)
    assert got[2].value is None
