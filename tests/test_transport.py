"""One transport under every call: bounded waits, calls that fail early or are abandoned, threads, views.

Real Ray, real worker processes, real gloo.  Each test names the promise of the transport it
checks (``docs/control_plane.md``, "What the transport promises", T1-T8); what happened is read
from the ranks themselves (their own logs, pids and thread names), not from what the group
says of itself.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from rankmesh import DataProto  # noqa: E402
from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.errors import BackendError, HangError, StaleViewError, WorkerDiedError, WorkerError  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from tests.transport_workers import Explodes, TransportWorker  # noqa: E402

SESSION_THREAD = "rankmesh-session"


def threads(wg) -> list[set[str]]:
    return [{thread for _, _, thread in log} for log in wg.history()]


@pytest.fixture(scope="module")
def wg(host_bank):
    """A 4-rank group on the default path (the controller's call session), in the bank's processes."""
    group = host_bank.build(RayClassWithInitArgs(TransportWorker), RankMesh(dp=4))
    yield group
    host_bank.give_back(group)


def run_in_thread(fn, *args):
    """``fn(*args)`` on a daemon thread; the dict gets ``"value"`` or ``"error"`` and ``"took"``."""
    out: dict = {}

    def body() -> None:
        start = time.monotonic()
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc
        out["took"] = time.monotonic() - start

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def test_an_argument_that_does_not_unpickle_leaves_later_calls_alone(wg):
    """T2: a call that fails before its method runs on a rank cannot hold that rank's next call."""
    with pytest.raises(WorkerError):
        wg.take(Explodes())  # an object argument: it travels through the object store, one Ray task per rank
    wg.history()
    assert wg.with_timeout(10).echo("after") == ["after"] * 4
    assert threads(wg) == [{SESSION_THREAD}] * 4  # the next call took the session, and ran


def test_two_threads_calling_one_group_get_their_own_answers(wg):
    """T6: a group may be called from several threads; each call gets its own outputs."""
    wg.history()
    calls = 60
    results: dict[int, list] = {0: [], 1: [], 2: []}

    def blocking(tid: int) -> None:
        for i in range(calls):
            results[tid].append((i, wg.echo((tid, i))))

    def non_blocking(tid: int) -> None:
        for i in range(calls):
            results[tid].append((i, wg.echo_later((tid, i)).get()))

    workers = [threading.Thread(target=blocking, args=(0,)), threading.Thread(target=blocking, args=(1,)),
               threading.Thread(target=non_blocking, args=(2,))]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    assert not any(t.is_alive() for t in workers)
    for tid in (0, 1, 2):
        assert results[tid] == [(i, [(tid, i)] * 4) for i in range(calls)]
    logs = wg.history()
    for log in logs:  # every rank ran every call once, and each thread's calls in the order it sent them
        values = [value for _, value, _ in log]
        assert sorted(values) == sorted((tid, i) for tid in (0, 1, 2) for i in range(calls))
        for tid in (0, 1, 2):
            assert [v for v in values if v[0] == tid] == [(tid, i) for i in range(calls)]


def test_an_answer_read_by_another_callers_wait_is_taken_at_once(wg):
    """T6: two calls are in, each rank's doorbell rung once for both.  The wait for the first
    drains the doorbells; the wait for the second (another caller's, in a real program) finds its
    answers at once instead of sleeping out its slice for a doorbell that will not ring again.
    Before, each such call waited one slice (0.5 s in the loop), and three threads calling one
    group took 7-14 s for 180 calls of under 3 ms each."""
    from rankmesh.backend import RankCall

    wg.echo("open")  # the session opens at the first call
    session = wg.executor.session
    first, second = (wg.executor.submit(None, "echo", [RankCall(r, (i,)) for r in range(4)]) for i in (1, 2))
    assert all(p.carrier == session.name for p in [*first, *second])
    time.sleep(1.0)  # both calls' answers are in by now (4 ranks echo in well under a millisecond)
    assert len(session.poll(first, 5.0)) == 4  # woken by the doorbells, which it drains
    start = time.monotonic()
    got = session.poll(second, 5.0)
    took = time.monotonic() - start
    assert sorted(got) == [0, 1, 2, 3] and all(o.error is None for o in got.values()), got
    assert took < 2.5, f"the second call's answers were in, yet its wait took {took:.2f} s"


def test_a_caller_waiting_on_the_doorbells_holds_up_no_other_caller(wg):
    """T6: one caller waits 4 s for rank 0's slow call; meanwhile another sends a call to ranks 1-3
    and takes its answers at once.  Before, the first caller slept on the doorbells holding the
    lock that sending and reading take, so the second waited out its sleep (in the wait loop up
    to a 0.5 s slice per look: three threads calling one group took 7-14 s for 180 calls)."""
    from rankmesh.backend import RankCall

    wg.echo("open")  # the session opens at the first call
    executor, session = wg.executor, wg.executor.session
    slow = executor.submit(None, "nap", [RankCall(0, (0, 4.0))])
    thread, sleeper = run_in_thread(session.poll, slow, 10.0)
    time.sleep(0.5)  # the sleeper is on the doorbells by now
    start = time.monotonic()
    got = session.poll(executor.submit(None, "echo", [RankCall(r, (r,)) for r in (1, 2, 3)]), 10.0)
    took = time.monotonic() - start
    thread.join(30)
    assert [o.value for _, o in sorted(got.items())] == [1, 2, 3], got
    assert took < 2.0, f"a call to ranks 1-3 took {took:.2f} s while another caller waited for rank 0"
    assert [o.value for o in sleeper["value"].values()] == [0], sleeper  # the nap's answer: its rank


def test_a_producer_thread_feeds_a_row_buffer_while_the_trainer_takes(host_bank):
    """T6, the pattern of docs/async.md: a rollout group's non-blocking calls on one thread, put into a
    RowBuffer as futures; the trainer group's blocking calls on the main thread, on what it takes.

    By hand: step s puts prompts 4s..4s+3; the rollout (dp=2) makes prompt * 10 + its rank (rows 0, 1 on
    rank 0, rows 2, 3 on rank 1); the trainer (dp=2) adds 1000 times its rank, in the same split."""
    import torch

    from rankmesh import RowBuffer

    rollout = host_bank.build(RayClassWithInitArgs(TransportWorker), RankMesh(dp=2))
    trainer = host_bank.build(RayClassWithInitArgs(TransportWorker), RankMesh(dp=2))
    try:
        buffer = RowBuffer(capacity_rows=8)
        steps = 6
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                for step in range(steps):
                    prompts = DataProto.from_dict({"prompt": torch.arange(4) + 4 * step})
                    buffer.put(rollout.generate(prompts), version=step, timeout=60)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                errors.append(exc)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        got = [trainer.train(buffer.take(4, timeout=60).data).batch["tokens"].tolist() for _ in range(steps)]
        producer.join(60)
        assert not errors and not producer.is_alive()
        want = [[40 * s + 0, 40 * s + 10, 40 * s + 20 + 1 + 1000, 40 * s + 30 + 1 + 1000] for s in range(steps)]
        assert got == want
        assert (buffer.put_rows, buffer.taken_rows, buffer.dropped_rows) == (4 * steps, 4 * steps, 0)
    finally:
        host_bank.give_back(trainer)
        host_bank.give_back(rollout)


def test_a_stuck_rank_never_holds_calls_to_the_other_ranks(wg):
    """T3: a rank that stopped reading (it runs an abandoned call) holds no call that does not name it,
    and a call that names it ends at its deadline, saying why."""
    wg.history()
    with pytest.raises(HangError):
        wg.with_timeout(0.5).nap(1, 6.0)  # rank 1 runs on; the call is abandoned
    t0 = time.monotonic()
    for i in range(12):  # more calls than the command ring has slots
        thread, out = run_in_thread(lambda i=i: wg.call_ranks("echo", [(i,)] * 3, ranks=[0, 2, 3], timeout_s=3))
        thread.join(10)
        assert not thread.is_alive(), f"call {i} to ranks 0, 2, 3 still waits"
        assert out.get("value") == [i] * 3, out
    assert time.monotonic() - t0 < 5.0  # none of them waited for rank 1
    with pytest.raises(HangError) as info:
        wg.with_timeout(1).echo("all")  # rank 1 takes it after the abandoned call: past 1 s it names rank 1
    assert info.value.ranks == [1] and "nap" in str(info.value)
    time.sleep(max(0.0, 6.5 - (time.monotonic() - t0)))  # rank 1's nap is over
    assert wg.with_timeout(5).echo("after") == ["after"] * 4
    logs = wg.history()
    # Rank 1: the abandoned call first, then what it was sent after it, in order ("all" only if it ended in
    # time for it: the HangError came at 1 s, the host gives a queued call up 5 s past the deadline).
    assert [(m, v) for m, v, _ in logs[1]] in ([("nap", 1), ("echo", "after")], [("nap", 1), ("echo", "all"), ("echo", "after")])
    assert [v for m, v, _ in logs[0] if m == "echo"] == [*range(12), "all", "after"]  # the free ranks ran "all" at once


def test_parked_outputs_of_an_abandoned_call_are_dropped(wg):
    """T5: an output too big for a reply slot, of a call nobody reads any more, does not stay in the worker."""
    with pytest.raises(HangError):
        wg.with_timeout(0.3).big_after(1.0, 3 << 20)
    assert wg.with_timeout(10).echo("next") == ["next"] * 4  # waits for the abandoned call, then runs
    parked = ray.get([actor.parked_outputs.remote() for actor in wg.workers])
    assert parked == [0] * 4


def object_refs(future) -> list:
    """The ObjectRefs a future's handles hold (whatever the handle type)."""
    refs = []
    for handle in future.handles:
        values = [handle] if isinstance(handle, ray.ObjectRef) else list(vars(handle).values())
        refs += [v for v in values if isinstance(v, ray.ObjectRef)]
    return refs


def spilled_bytes() -> int:
    """Bytes the object store has spilled to disk and still keeps there (Ray deletes an object's spill
    file once the object is freed): the spill folders in the session's folder, where this Ray spills."""
    session = ray._private.worker._global_node.get_session_dir_path()
    return sum(entry.stat().st_size for folder in os.scandir(session) if folder.name.startswith("ray_spilled_objects")
               for entry in os.scandir(folder.path) if entry.is_file())


def test_futures_passed_along_free_their_references(host_bank):
    """T4: a future handed to another group's call is not pinned once caller and callee dropped it:
    neither its reference nor its bytes.  The 40 outputs are sized so that together they are 4/3 of the
    store: were they pinned, Ray would have to spill a quarter of them to disk and keep them there."""
    import torch

    producer = host_bank.build(RayClassWithInitArgs(TransportWorker), RankMesh(dp=1))
    consumer = host_bank.build(RayClassWithInitArgs(TransportWorker), RankMesh(dp=1))
    core = ray._private.worker.global_worker.core_worker
    mib = int(ray.cluster_resources()["object_store_memory"]) // 30 >> 20
    seed = DataProto.from_dict({"i": torch.arange(1), "mib": torch.tensor([mib])})
    before = spilled_bytes()  # what earlier tests left, if anything
    try:
        ids = set()
        for _ in range(40):
            future = producer.make(seed)  # mib MiB into the store, a future on the controller
            ids |= {ref.hex().encode() for ref in object_refs(future)}
            assert consumer.take(future) == ["DataProto"]  # the consumer's rank fetches it itself
            del future
        assert len(ids) == 40
        gc.collect()
        deadline = time.monotonic() + 10
        while (on_disk := spilled_bytes()) > before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert on_disk <= before, f"{(on_disk - before) >> 20} MiB of the 40 outputs ({40 * mib} MiB) stay spilled on disk"
        while True:  # and the controller holds no reference to any of them
            left = ids & set(core.get_all_reference_counts())  # keys: hex ids, as bytes
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"{len(left)} of the 40 outputs are still referenced (pinned) by the controller"
    finally:
        host_bank.give_back(consumer)
        host_bank.give_back(producer)


def test_a_rank_with_1100_open_files_answers(host_bank):
    """T7: a rank whose session fds are numbered above 1023 still serves calls."""
    group = host_bank.build(RayClassWithInitArgs(TransportWorker, 1100), RankMesh(dp=2))
    try:
        assert group.with_timeout(15).echo("hi") == ["hi"] * 2
        assert threads(group) == [{SESSION_THREAD}] * 2
        assert min(group.highest_fd()) >= 1100
    finally:
        host_bank.give_back(group)


def test_a_grow_that_cannot_be_placed_keeps_no_placement_group(host_bank):
    """T5: a grow refused for want of room leaves no placement group behind."""
    from ray.util import placement_group_table

    from rankmesh.errors import RecoveryError

    group = host_bank.build(RayClassWithInitArgs(TransportWorker), RankMesh(dp=2))
    try:
        before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
        with pytest.raises(RecoveryError, match="no node has room"):
            group.grow(replicas=64, timeout_s=1.0)
        after = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
        assert after - before == set()
        assert group.echo(1) == [1, 1]  # the group is unchanged and usable
    finally:
        host_bank.give_back(group)


# ----- groups of their own: kills, replacements, shrinks -------------------------------------------------


def test_after_a_hang_error_the_next_call_warns_at_once_and_ends_at_its_bound(ray_session, caplog):
    """T3: ranks still in an abandoned call make a later call warn at once and end at the default bound,
    never wait silently (it queues behind the abandoned call there); the HangError's advice (kill and
    replace them) brings them back."""
    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(TransportWorker, distributed=True),
                        on_rank_death="keep", abandoned_wait_s=3.0)
    try:
        with pytest.raises(HangError) as info:
            wg.call_ranks("act", [("world",), ("skip",)], timeout_s=2)  # rank 0 waits in an all_reduce rank 1 skips
        hang = info.value
        assert hang.ranks == [0]
        assert "kill_ranks" in str(hang) and "shutdown" in str(hang)  # what happens next, and how to get rank 0 back
        caplog.set_level(logging.WARNING)
        thread, out = run_in_thread(wg.noop)
        time.sleep(1.0)
        warned = [r.getMessage() for r in caplog.records if "act" in r.getMessage() and "still" in r.getMessage()]
        assert warned, "no warning within 1 s that rank 0 still runs the abandoned call"
        thread.join(15)
        assert not thread.is_alive(), "the call after the HangError still waits"
        assert isinstance(out.get("error"), HangError) and 2.5 < out["took"] < 8.0, out
        assert out["error"].ranks == [0] and "keep running" in str(out["error"])  # rank 1 answered; rank 0 still runs act
        wg.kill_ranks([0])
        report = wg.replace_dead_ranks()
        assert report.ranks == [0]
        assert wg.echo("back") == ["back", "back"]
        assert wg.call_ranks("act", [("world",)] * 2, timeout_s=10) == [2.0, 2.0]
    finally:
        wg.shutdown()


def test_on_hang_kill_replaces_a_stopped_rank_and_retries_and_frees_its_peer(ray_session):
    """T3b: with on_hang="kill", a rank SIGSTOPped (frozen, not dead) mid-collective is killed at the call's
    timeout, its peer blocked in the all_reduce with it is freed and kept, and the blocking call is retried
    once on the replaced rank: the caller gets the undisturbed answer.  A non-blocking call's future raises
    the HangError (saying the rank was killed), and the next call recovers first.  A rank holding the
    last live copy of its shard is never killed."""
    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(TransportWorker, distributed=True),
                        on_rank_death="replace", on_hang="kill")
    try:
        pids = dict(wg.whoami())
        os.kill(pids[1], signal.SIGSTOP)  # rank 1 freezes: rank 0 will wait for it in the all_reduce
        t0 = time.monotonic()
        assert wg.call_ranks("act", [("world",)] * 2, timeout_s=3) == [2.0, 2.0]  # replaced, then retried
        took = time.monotonic() - t0
        (report,) = wg.replacements
        assert report.ranks == [1] and report.stuck == [] and took < 30, (report, took)
        after = dict(wg.whoami())
        assert after[0] == pids[0] and after[1] != pids[1]  # the peer kept its process; the frozen one is gone
        assert not os.path.exists(f"/proc/{pids[1]}") or open(f"/proc/{pids[1]}/stat").read().split()[2] == "Z"
        os.kill(after[0], signal.SIGSTOP)
        later = wg.with_timeout(3).echo_later("x")
        with pytest.raises(HangError, match=r"Ranks \[0\] were killed \(on_hang='kill'\)"):
            later.get()
        assert wg.echo("back") == ["back", "back"] and len(wg.replacements) == 2  # recovered before this call
        now = dict(wg.whoami())
        assert now[0] != after[0]
        # Both copies of the one shard frozen: killing either would lose it, so nothing is killed.
        for pid in now.values():
            os.kill(pid, signal.SIGSTOP)
        with pytest.raises(HangError, match=r"ranks \[0, 1\] hold the last live copy of their shard, so nothing was killed"):
            wg.call_ranks("act", [("world",)] * 2, timeout_s=3)
        for pid in now.values():
            os.kill(pid, signal.SIGCONT)
        assert dict(wg.whoami()) == now and len(wg.replacements) == 2  # they run on, the same processes
    finally:
        wg.shutdown()


def test_on_hang_kill_is_refused_where_it_would_stop_the_group(ray_session):
    with pytest.raises(BackendError, match="on_rank_death='fail'"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(TransportWorker), on_hang="kill")
    with pytest.raises(BackendError, match="on_hang must be one of 'raise', 'kill'"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(TransportWorker),
                       on_rank_death="replace", on_hang="restart")


def test_a_survivor_blocked_on_a_live_peer_finishes_its_call_before_the_replacement(ray_session):
    """T8: recovery steps wait for the call a survivor runs (one lock on the host): a survivor blocked in
    a collective on a live peer finishes it, and only then leaves torch.distributed."""
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(TransportWorker, distributed=True),
                        mesh=RankMesh(tp=2, dp=2), on_rank_death="keep")
    try:
        wg.echo("on the session")
        assert threads(wg) == [{SESSION_THREAD}] * 4
        # Rank 0 waits in its tp group for rank 1, which joins after 3 s; rank 2's tp peer, rank 3, dies.
        with pytest.raises(WorkerDiedError) as info:
            wg.call_ranks("act", [("tp",), ("late:3",), ("tp",), ("exit",)])
        assert info.value.ranks == [3]
        report = wg.replace_dead_ranks()
        assert report.ranks == [3] and report.stuck == []
        assert wg.last()[:2] == [2.0, 2.0]  # ranks 0 and 1 finished their all_reduce (1 + 1), untouched
        assert wg.call_ranks("act", [("tp",)] * 4, timeout_s=20) == [2.0] * 4
    finally:
        wg.shutdown()


def test_a_view_taken_before_a_shrink_is_refused(ray_session):
    """T8 (generations): a replica view of an older mesh never reaches another replica's processes."""
    wg = RayWorkerGroup(RayResourcePool([3], use_gpu=False), RayClassWithInitArgs(TransportWorker),
                        mesh=RankMesh(dp=3), on_rank_death="keep")
    try:
        held = wg.replica(1)
        pid_of = dict(wg.whoami())
        assert held.whoami() == [(1, pid_of[1])]
        os.kill(pid_of[0], signal.SIGKILL)
        with pytest.raises(WorkerDiedError):
            wg.echo(0)
        wg.shrink_dead_replicas()
        with pytest.raises(StaleViewError) as info:
            held.whoami()
        text = str(info.value)
        assert "shrank" in text and "wg.replica(" in text
        with pytest.raises(StaleViewError):
            held.weight_version = 3
        assert wg.weight_versions == (0, 0)
        assert wg.replica(1).whoami() == [(1, pid_of[2])]  # a fresh view: replica 1 is the old replica 2
    finally:
        wg.shutdown()


def test_where_a_joined_calls_outputs_are_is_read_within_its_bound(ray_session):
    """T2 (every wait bounded), for a non-blocking call its node agents joined: reading where each
    rank's output is (``JoinedCall.each``, what ``handles`` and a failed ``get()`` do) gives up on
    an agent that does not answer within the bound, naming its ranks, and never waits on it for
    longer.  Before, one unanswered agent held the reader for 120 s (a partitioned node in the
    chaos soak).  Expected by hand: the top's own rank 0 and its live child's rank 2 are found;
    the silent child's ranks 4 and 5 are unreached; a dead agent's ranks read its lost reference."""
    from rankmesh.backends.ray.agent import SubtreeOutputs, _find_outputs

    @ray.remote(num_cpus=0)
    class Silent:
        def where(self) -> None:
            time.sleep(30)  # an agent that never says (a partitioned node): its answer is not in within the bound

    silent, dead = Silent.remote(), Silent.remote()
    try:
        child = ray.put(SubtreeOutputs({2: "rank 2's output ref"}))
        never = silent.where.remote()
        lost = dead.where.remote()
        ray.kill(dead)  # its answer reads as its death, at once
        top = ray.put(SubtreeOutputs({0: "rank 0's output ref"}, (((2,), child), ((4, 5), never), ((6,), lost))))
        start = time.monotonic()
        found, unreached = _find_outputs([(top, [0, 2, 4, 5, 6])], 1.0)
        took = time.monotonic() - start
        assert found == {0: "rank 0's output ref", 2: "rank 2's output ref", 6: lost}
        assert unreached == {4: "no answer", 5: "no answer"}
        assert took < 5.0, took
    finally:
        ray.kill(silent)
