"""Ranks forked from a node's warm process (``process_model="fork"``): what they see, their children, their deaths.

Expected values come from a rank spawned by Ray in the same pool (``process_model="ray"``), from
``/proc`` and from the operating system, never from rankmesh's own account of its processes.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
import importlib.util

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from rankmesh.backends.ray.forked import KEEPER_NAME  # noqa: E402
from rankmesh.backends.ray.runtime import DETACHED_NAMESPACE  # noqa: E402
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.errors import BackendError, ForkRefused, WorkerDiedError, WorkerError  # noqa: E402
from tests.fork_workers import ForkProbe  # noqa: E402

#: Variables Ray gives each worker process of its own (ids, the log files): a forked rank has its holder's.
PER_PROCESS = ("RAY_WORKER_", "RAY_LOG", "RAY_RAYLET_PID", "RAY_JOB_", "RAY_ACTOR", "RAY_RUNTIME_ENV",
               "RAY_NODE", "RAY_CLIENT", "RAY_ADDRESS", "RAY_SESSION")


def _shared_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith(PER_PROCESS)}


def _keeper_processes() -> list:
    node_id = ray.get_runtime_context().get_node_id()
    keeper = ray.get_actor(KEEPER_NAME.format(node_id=node_id), namespace=DETACHED_NAMESPACE)
    return ray.get(keeper.processes.remote())


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.fixture(scope="module")
def groups(ray_session):
    """A 4-rank forked group and a 1-rank spawned one of the same worker."""
    forked = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="fork")
    spawned = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="ray")
    yield forked, spawned
    forked.shutdown()
    spawned.shutdown()


def test_a_forked_rank_is_a_child_of_its_nodes_warm_process_and_its_holder_imports_no_torch(groups):
    forked, _ = groups
    facts = forked.facts()
    warm = {pid for _, pid in _keeper_processes()}
    assert {f["ppid"] for f in facts} <= warm and len(warm) >= 1
    holders = {info["ray_pid"] for info in forked.executor.hosts.info}
    assert len(holders) == 1 and not holders & {f["pid"] for f in facts}  # one Ray worker for the node's 4 ranks
    for holder in holders:  # a call's small arguments go through the session ring, not the holder
        with open(f"/proc/{holder}/cmdline", "rb") as f:
            assert b"ForkedRanks" in f.read()  # the process title Ray gives the actor
        assert "libtorch" not in _maps(holder), f"holder {holder} loaded torch"
    for f in facts:
        assert "libtorch" in _maps(f["pid"]) and not f["cuda_initialized"]


def test_an_answer_passes_through_the_holder_unread(groups):
    forked, _ = groups
    x = torch.arange(32, dtype=torch.float32)
    out = forked.double_later(DataProto.from_dict({"x": x})).get()  # small: its input rides inside the call
    assert torch.equal(out.batch["y"], x * 2)
    for info in forked.executor.hosts.info:  # the tensors came back sealed: no holder unpickled them
        assert "libtorch" not in _maps(info["ray_pid"]), f"holder {info['ray_pid']} loaded torch"


def test_an_argument_stored_in_rays_store_passes_through_the_holder_unread(groups):
    """Calls on Ray's tasks store a large argument in Ray's store; Ray reads a task's stored
    arguments before the holder's method runs, so it is stored sealed and only the rank opens it."""
    forked, _ = groups
    x = torch.arange(4 * 70_000, dtype=torch.float32).reshape(4 * 1000, 70)  # over the inline limit per rank
    batch = DataProto.from_dict({"x": x})
    puts = forked.executor.stats.puts
    forked.set_control("ray")
    try:
        out = forked.double(batch)
    finally:
        forked.set_control("auto")
    assert forked.executor.stats.puts > puts  # it did go through the store
    assert torch.equal(out.batch["y"], x * 2) and torch.equal(batch.batch["x"], x)
    for info in forked.executor.hosts.info:
        assert "libtorch" not in _maps(info["ray_pid"]), f"holder {info['ray_pid']} loaded torch"


def test_a_future_passed_to_forked_ranks_is_read_by_them_part_by_part_not_by_their_holders(groups):
    """A future passed along reaches a forked rank as a future, so each rank fetches only the parts
    its rows are in (a rank in its own actor does the same); between forked ranks the holders open
    neither the future nor its parts.  Expected by hand: ``y`` is twice ``x``, two rows per rank of four."""
    forked, spawned = groups
    x = torch.arange(8, dtype=torch.float32)
    quarters = forked.double_later(DataProto.from_dict({"x": x}))  # four parts of 2 rows, from forked ranks
    assert forked.read_future(quarters) == [{"type": "DataProtoFuture", "parts": 1, "y": [4.0 * r, 4.0 * r + 2]}
                                            for r in range(4)]
    for info in forked.executor.hosts.info:
        assert "libtorch" not in _maps(info["ray_pid"]), f"holder {info['ray_pid']} loaded torch"
    assert spawned.read_future(quarters) == [{"type": "DataProtoFuture", "parts": 4, "y": (x * 2).tolist()}]
    whole = spawned.double_later(DataProto.from_dict({"x": x}))  # one part of 8 rows, from a Ray actor
    assert forked.read_future(whole) == [{"type": "DataProtoFuture", "parts": 1, "y": [4.0 * r, 4.0 * r + 2]}
                                         for r in range(4)]


def test_a_forked_rank_sees_what_a_rank_spawned_in_the_same_pool_does(groups):
    forked, spawned = groups
    mine = forked.facts()
    theirs = spawned.facts()[0]
    for f in mine:
        assert f["cwd"] == theirs["cwd"]
        assert f["sys_path"] == theirs["sys_path"]
        assert f["threads"] == theirs["threads"]
        env, expected = _shared_env(f["env"]), _shared_env(theirs["env"])
        rank_vars = {"RANK", "LOCAL_RANK", "RAY_LOCAL_RANK", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                     "RAY_LOCAL_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "MASTER_ADDR"}
        differ = {k for k in env.keys() | expected.keys() if env.get(k) != expected.get(k)} - rank_vars
        assert not differ, {k: (env.get(k), expected.get(k)) for k in sorted(differ)}
        assert env["RANK"] == str(mine.index(f)) and env["WORLD_SIZE"] == "4"


def test_forked_ranks_draw_random_numbers_of_their_own(groups):
    """Python's, numpy's and torch's CPU generators seed from the OS in a spawned process (a
    spawned rank draws its own numbers): each forked rank too, none the spawned rank's."""
    forked, spawned = groups
    draws = [f["draws"] for f in forked.facts()]
    theirs = spawned.facts()[0]["draws"]
    for k in range(3):  # python's random, numpy's, torch's
        values = [d[k] for d in draws] + [theirs[k]]
        assert len(set(values)) == len(values), f"generator {k} gave ranks the same numbers: {values}"


def test_ray_used_inside_a_forked_rank_fails_and_connects_nothing(groups):
    """A forked rank has no Ray worker: Ray's automatic ray.init() would make it a driver of its own."""
    import psutil

    forked, _ = groups
    with pytest.raises(WorkerError, match="Ray has not been started|not initialized|ray.init"):
        forked.ray_put()
    gcs_port = int(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1])
    for f in forked.facts():  # the ranks live on, with no connection to the cluster's GCS
        remote = {c.raddr.port for c in psutil.Process(f["pid"]).net_connections(kind="inet") if c.raddr}
        assert gcs_port not in remote


def test_what_a_forked_rank_prints_reaches_the_driver_as_its_holders_output(groups, capsys):
    forked, _ = groups
    token = f"forked-rank-says-{os.getpid()}-{time.monotonic_ns()}"
    forked.say(token)
    out, deadline = "", time.monotonic() + 20
    while not all(f"{token} from rank {r}" in out for r in range(4)) and time.monotonic() < deadline:
        time.sleep(0.2)
        out += capsys.readouterr().out
    for r in range(4):
        assert f"{token} from rank {r}" in out
    assert "ForkedRanks" in next(line for line in out.splitlines() if token in line)  # Ray's prefix: the holder


def test_a_forked_rank_forks_its_own_children(groups):
    forked, _ = groups
    for got in forked.fork_children():
        assert got == {"loaded": list(range(8)), "squares": [0, 1, 4, 9]}


def test_data_through_a_forked_ranks_holder_comes_back_whole(groups):
    forked, _ = groups
    x = torch.arange(4 * 70_000, dtype=torch.float32).reshape(4 * 1000, 70)  # over the inline limit per rank
    batch = DataProto.from_dict({"x": x})
    out = forked.double(batch)
    assert torch.equal(out.batch["y"], x * 2)
    assert torch.equal(batch.batch["x"], x)  # the caller's batch is untouched


def test_groups_of_different_worker_modules_get_different_warm_processes(groups):
    from tests.hosts import ProcessReset

    before = _keeper_processes()
    other = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ProcessReset), process_model="fork")
    try:
        assert other.reset() == [True]
        after = _keeper_processes()
        assert any("tests.fork_workers" in m for m, _ in after) and any(m == ("tests.hosts",) for m, _ in after)
        assert len({pid for _, pid in after}) == len(after) > len(before)
        # Both forked from the node's base warm process (which imported torch and rankmesh once),
        # itself started by the keeper.
        bases = {_parent(pid) for _, pid in after}
        assert len(bases) == 1 and b"rankmesh.backends.ray.warm" in _cmdline(bases.pop())
    finally:
        other.shutdown()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


KEEPER_SCRIPT = """
import json, sys
from rankmesh.backends.ray.forked import WarmKeeper
keeper = WarmKeeper()
print(json.dumps(keeper.address(["json"], sys.path)), flush=True)
sys.stdin.read()
"""


def _start_keeper():
    """A keeper in a process of its own, with its base and one import set's warm process up; the socket's name."""
    import json
    import subprocess

    keeper = subprocess.Popen([sys.executable, "-c", KEEPER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return keeper, json.loads(keeper.stdout.readline())


def _descendants(pid: int) -> list:
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    return [d for c in children for d in (c, *_descendants(c))]


def test_a_keeper_and_its_warm_processes_leave_nothing_on_disk():
    """Ray kills a worker's whole process tree when the worker goes (the keeper's too): whatever
    they wrote on disk would stay there, one more entry per node and cluster."""
    import tempfile

    def ours() -> set:
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("rankmesh")}

    before = ours()
    keeper, _ = _start_keeper()
    tree = [keeper.pid, *_descendants(keeper.pid)]
    for pid in tree:
        os.kill(pid, signal.SIGKILL)
    keeper.wait()
    for pid in tree[1:]:
        _wait_exited(pid)
    assert ours() == before
    assert len(tree) == 3  # the keeper, its base, one warm process


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_a_warm_process_takes_requests_from_its_own_user_only():
    """Its socket is abstract (no file permissions): another user who asks the node's base warm
    process for a warm process of its own is turned away unanswered, and nothing is forked."""
    from rankmesh.backends.ray.warm import start_warm

    keeper, _ = _start_keeper()
    try:
        (base, _warm) = _descendants(keeper.pid)
        with open(f"/proc/{base}/cmdline", "rb") as f:
            base_address = f.read().split(b"\0")[3].decode()  # python -m rankmesh.backends.ray.warm ADDRESS SYS_PATH
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a process of user nobody
            said = b"answered"
            try:
                os.setuid(65534)
                start_warm(base_address, "rankmesh-intruder", ["json"], 10)
            except (EOFError, ConnectionError):  # closed unanswered (reset or broken pipe: closed before it read)
                said = b"unanswered"
            except BaseException as exc:  # noqa: BLE001 - told to the test
                said = repr(exc).encode()
            finally:
                os.write(write, said)
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 256) == b"unanswered"
        assert len(_descendants(keeper.pid)) == 2  # the base and the one warm process: nothing forked for nobody
    finally:
        keeper.kill()
        keeper.wait()


def test_a_worker_module_that_starts_a_thread_when_imported_is_not_forked(ray_session):
    """A fork copies one thread: the rank would lack the module's thread, and any lock it held."""
    from tests.fork_threaded_worker import StartsAThread

    with pytest.raises(WorkerError) as err:
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(StartsAThread), process_model="fork")
    text = str(err.value)
    assert text.startswith("rank 0 failed in start: ForkRefused: ranks cannot be forked for worker modules "
                           "['tests.fork_threaded_worker']"), text
    assert "started-at-import" in text and "process_model='ray'" in text
    assert err.value.raised(ForkRefused)  # asked for, the model is refused: no fall-back
    group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(StartsAThread), process_model="ray")
    try:
        assert group.alive() == [True]
    finally:
        group.shutdown()


def test_a_dead_rank_is_told_at_once_and_replaced_by_a_fork(groups):
    """Replaced by a fork even when the node's warm process died meanwhile: the holder asks the
    keeper at each fork, which starts the warm process again."""
    group = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="fork",
                           on_rank_death="keep")
    try:
        pids = group.pid()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            group.pid()
        assert err.value.rank == 1 and time.monotonic() - start < 10
        (warm,) = [pid for modules, pid in _keeper_processes() if "tests.fork_workers" in modules]
        os.kill(warm, signal.SIGKILL)
        _wait_exited(warm)
        start = time.monotonic()
        group.replace_dead_ranks()
        replaced = time.monotonic() - start
        now = group.pid()
        assert now[0] == pids[0] and now[1] != pids[1]
        assert os.getpgid(now[1]) >= 0 and replaced < 30
        (again,) = [pid for modules, pid in _keeper_processes() if "tests.fork_workers" in modules]
        assert again != warm and group.facts()[1]["ppid"] == again
    finally:
        group.shutdown()


def _wait_exited(pid: int, timeout: float = 10.0) -> None:
    """Until process ``pid`` has exited (a zombie its parent has not reaped yet counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {pid} still runs {timeout:g} s after SIGKILL")


def test_a_warm_process_that_died_is_started_again(groups):
    forked, _ = groups
    warm = [pid for modules, pid in _keeper_processes() if "tests.fork_workers" in modules]
    os.kill(warm[0], signal.SIGKILL)
    assert forked.pid()  # ranks forked before live on without it
    group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="fork")
    try:
        again = [pid for modules, pid in _keeper_processes() if "tests.fork_workers" in modules]
        assert again and again != warm
        assert group.facts()[0]["ppid"] == again[0]
    finally:
        group.shutdown()


CHANGING = '''
from rankmesh.dispatch import Dispatch, register
from rankmesh.worker import Worker

class Changing(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def version(self):
        return {version!r}
'''


def _load_changing(path: str):
    spec = importlib.util.spec_from_file_location("rankmesh_fork_changing", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Changing


def test_a_worker_module_changed_on_disk_reaches_the_next_group(groups, tmp_path):
    path = tmp_path / "rankmesh_fork_changing.py"
    seen = []
    try:
        for version in ("one", "a second one"):
            path.write_text(textwrap.dedent(CHANGING.format(version=version)))
            cls = RayClassWithInitArgs(_load_changing(str(path)))
            cls.update_options({"runtime_env": {"env_vars": {"PYTHONPATH": str(tmp_path)}}})
            group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), cls, process_model="fork")
            try:
                seen.append((group.version()[0], [p for m, p in _keeper_processes() if "rankmesh_fork_changing" in m]))
            finally:
                group.shutdown()
    finally:
        sys.modules.pop("rankmesh_fork_changing", None)
    assert [v for v, _ in seen] == ["one", "a second one"]
    assert len(seen[1][1]) == 1 and seen[0][1] != seen[1][1]


def test_a_process_model_that_does_not_exist_is_refused_before_anything_starts(ray_session):
    with pytest.raises(BackendError, match="process_model must be one of"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="spawn")


def test_rankmeshs_own_workers_fork_by_default_and_any_other_class_keeps_a_ray_actor():
    """By hand, from the rule: a group that names no model and has no RANKMESH_PROCESS_MODEL forks
    when every class is rankmesh's own (falling back to Ray actors if refused), else keeps Ray actors;
    a model named, or set in the environment, is what the group gets, with no fall-back."""
    from rankmesh.backends.ray.forked import ProcessChoice, choose_process_model
    from rankmesh.megatron.roles import CriticWorker
    from rankmesh.reshard.worker import ReshardWorker

    unset: dict = {}
    assert choose_process_model(None, [ReshardWorker], unset) == ProcessChoice("fork", fall_back=True)
    assert choose_process_model(None, [ReshardWorker, CriticWorker], unset) == ProcessChoice("fork", fall_back=True)
    assert choose_process_model(None, [ForkProbe], unset) == ProcessChoice("ray")
    assert choose_process_model(None, [ReshardWorker, ForkProbe], unset) == ProcessChoice("ray")
    assert choose_process_model("ray", [ReshardWorker], unset) == ProcessChoice("ray")
    assert choose_process_model("fork", [ForkProbe], unset) == ProcessChoice("fork")
    assert choose_process_model(None, [ReshardWorker], {"RANKMESH_PROCESS_MODEL": "ray"}) == ProcessChoice("ray")
    assert choose_process_model(None, [ForkProbe], {"RANKMESH_PROCESS_MODEL": "fork"}) == ProcessChoice("fork")


def test_a_group_of_rankmeshs_own_workers_forks_when_nothing_says_otherwise(ray_session, monkeypatch):
    from rankmesh.reshard.worker import ReshardWorker

    monkeypatch.delenv("RANKMESH_PROCESS_MODEL", raising=False)
    group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ReshardWorker))
    try:
        (info,) = group.executor.hosts.info
        with open(f"/proc/{info['ray_pid']}/cmdline", "rb") as f:
            assert b"ForkedRanks" in f.read()  # the rank's Ray process is its holder
        assert info["pid"] != info["ray_pid"]
    finally:
        group.shutdown()


def test_a_default_fork_that_is_refused_starts_ray_actors_and_says_why(ray_session, caplog):
    """What a group whose model was the default gets when its modules may not be forked."""
    from rankmesh.backends.ray.forked import ProcessChoice
    from rankmesh.backends.ray.hosts import start_hosts
    from rankmesh.mesh import RankMesh
    from tests.fork_threaded_worker import StartsAThread

    pool = RayResourcePool([1], use_gpu=False)
    pool.connect()
    roles = RayClassWithInitArgs(StartsAThread).roles
    with caplog.at_level("WARNING", logger="rankmesh.backends.ray.hosts"):
        hosts = start_hosts(pool, roles, RankMesh(), {}, "refused", False, {}, {}, 120.0,
                            process=ProcessChoice("fork", fall_back=True))
    try:
        assert hosts.forking is None
        (info,) = hosts.info
        assert info["pid"] == info["ray_pid"]  # a Ray actor of its own
        (warning,) = [r.getMessage() for r in caplog.records if "start as Ray actors" in r.getMessage()]
        assert "tests.fork_threaded_worker" in warning and "started-at-import" in warning
    finally:
        hosts.shutdown()


def test_the_holder_runs_every_method_of_the_host_on_the_lane_of_its_thread():
    """The names a route sends (hostapi) are the host's remote methods, each on the lane of the host's
    concurrency group (control calls answer while a call blocks); other names are refused."""
    from rankmesh.backends.ray.forked import DEFAULT_LANE, RankRoute, lane_of
    from rankmesh.backends.ray.host import WorkerHost
    from rankmesh.backends.ray.hostapi import BARE_SLOT_METHODS, CONTROL_GROUP, HOST_METHODS, SLOT_METHODS

    slots = set(SLOT_METHODS) | set(BARE_SLOT_METHODS)
    host = {name: getattr(getattr(WorkerHost, name), "__ray_concurrency_group__", None)
            for name in dir(WorkerHost) if not name.startswith("_") and callable(getattr(WorkerHost, name))
            and name not in slots}
    assert host == dict(HOST_METHODS)
    for name in [*host, *slots]:
        assert lane_of(name) == (CONTROL_GROUP if host.get(name) == CONTROL_GROUP else DEFAULT_LANE), name
    with pytest.raises(AttributeError, match="no remote method 'exceute'"):
        RankRoute(None, "k").exceute


def test_one_callers_calls_reach_a_forked_rank_in_the_order_sent(groups):
    """Ray runs the calls of the node's holder (an async actor) in any order; each caller's calls of
    one rank still run in the order it sent them, non-blocking ones on Ray's tasks included."""
    forked, _ = groups
    forked.set_control("ray")
    try:
        waits = [forked.nap_later(0.3), *(forked.note_later(i) for i in range(60))]
        counts = [w.get() for w in waits[1:]]
    finally:
        forked.set_control("auto")
    for i, per_rank in enumerate(counts):
        assert per_rank == [i + 1] * 4, (i, per_rank)


def test_a_rank_killed_while_it_is_being_forked_dies_once_forked(groups):
    """A kill that reaches the node's holder before the rank's fork is done is not lost: the rank
    is killed the moment it exists, and its calls say it is gone."""
    from rankmesh.backends.ray.forked import kill_host
    from rankmesh.errors import ForkedRankGone

    forked, _ = groups
    hosts = forked.executor.hosts
    route = hosts.forking.start(hosts.slots[0], None, "killed-early", hosts.pool.actor_resources, hosts.options)
    kill_host(route)  # long before the fork (a process, then a host built in it) is done
    with pytest.raises(ForkedRankGone):
        ray.get(route.node_info.remote(), timeout=60)


def test_a_stopped_forked_rank_dies_with_its_holder(groups):
    """A rank that cannot run (SIGSTOP) never reads its closed channels: its warm process kills it."""
    group = RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="fork")
    try:
        pid = group.pid()[0]
        os.kill(pid, signal.SIGSTOP)
        ray.kill(group.executor.hosts.actors[0].node, no_restart=True)  # the node's holder of its forked ranks
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state == "Z":  # dead, not yet reaped
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"rank process {pid} still lives 15 s after its holder was killed")
    finally:
        group.shutdown()


def _refit_layouts():
    """Weights for the refit tests: tp-split along each dim, with a stride, and replicated; the big
    one (1.3 MiB) travels in several pieces."""
    from rankmesh.reshard import ParamLayout

    return [ParamLayout("qkv", (96, 32), tp_dim=0, tp_stride=3), ParamLayout("proj", (32, 32), tp_dim=1),
            ParamLayout("ln", (32,)), ParamLayout("big", (520, 640))]


def _expected_shards(layouts, mesh, seed):
    from tests.reshard_workers import full_tensor, holds, megatron_cut

    return [{p.name: megatron_cut(full_tensor(p, seed), p, mesh, r) for p in layouts if holds(p, mesh, r)}
            for r in range(mesh.world_size)]


def _assert_shards(got, want):
    import numpy as np

    assert len(got) == len(want)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), rank
        for name in w:
            np.testing.assert_array_equal(g[name], w[name], err_msg=f"rank {rank} {name}")


@pytest.fixture(scope="module")
def refit_groups(ray_session, host_bank):
    """A forked tp2 group, a forked dp4 group, and a tp2·dp2 group of Ray actors (from the bank)."""
    from rankmesh.mesh import RankMesh
    from tests.reshard_workers import ShardHolder

    layouts = _refit_layouts()
    trainer = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ShardHolder, layouts, seed=1),
                             mesh=RankMesh(tp=2, dp=2), process_model="fork")
    generator = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(ShardHolder, layouts, seed=None),
                               mesh=RankMesh(dp=4), process_model="fork")
    spawned = host_bank.build(RayClassWithInitArgs(ShardHolder, layouts, seed=None), RankMesh(tp=2, dp=2))
    yield trainer, generator, spawned
    trainer.shutdown()
    generator.shutdown()
    host_bank.give_back(spawned)


@pytest.mark.parametrize("transport", ("store", "auto"))
def test_forked_ranks_refit_each_other_through_their_holders_or_directly(refit_groups, transport):
    from rankmesh.mesh import RankMesh
    from rankmesh.reshard.run import plan_between, reshard

    trainer, generator, _ = refit_groups
    layouts = _refit_layouts()
    trainer.refill(7)
    generator.refill(None)
    plan = plan_between(trainer, generator, dst_mesh=RankMesh(dp=4))
    stats = reshard(trainer, generator, plan, transport=transport)
    _assert_shards(generator.shards(), _expected_shards(layouts, RankMesh(dp=4), seed=7))
    if transport == "store":  # through Ray's store, put and fetched by the holders: each weight put once for
        assert stats.bytes_put == sum(p.nbytes for p in layouts) and stats.bytes_direct == 0  # all 4 replicas
    else:  # one node: every region read straight from the source rank's memory
        assert stats.bytes_direct == plan.bytes_moved and stats.bytes_put == 0 and stats.refused == 0
    for group in (trainer, generator):  # the holders passed puts, fetches and answers on unopened
        for info in group.executor.hosts.info:
            assert "libtorch" not in _maps(info["ray_pid"]), f"holder {info['ray_pid']} loaded torch"


def test_forked_ranks_and_ranks_in_ray_actors_refit_each_other(refit_groups):
    from rankmesh.mesh import RankMesh
    from rankmesh.reshard.run import plan_between, reshard

    trainer, generator, spawned = refit_groups
    layouts = _refit_layouts()
    trainer.refill(3)
    spawned.refill(None)
    reshard(trainer, spawned, plan_between(trainer, spawned, dst_mesh=RankMesh(tp=2, dp=2)), transport="store")
    _assert_shards(spawned.shards(), _expected_shards(layouts, RankMesh(tp=2, dp=2), seed=3))
    spawned.refill(4)
    generator.refill(None)
    reshard(spawned, generator, plan_between(spawned, generator, dst_mesh=RankMesh(dp=4)), transport="store")
    _assert_shards(generator.shards(), _expected_shards(layouts, RankMesh(dp=4), seed=4))


def test_verls_groups_keep_a_ray_actor_per_rank_whatever_the_environment_says(ray_session, monkeypatch):
    from rankmesh.compat import verl

    monkeypatch.setenv("RANKMESH_PROCESS_MODEL", "fork")
    pool = verl.RayResourcePool([1], use_gpu=False, max_colocate_count=1)  # verl's default holds 10 CPUs a bundle
    group = verl.RayWorkerGroup(pool, verl.RayClassWithInitArgs(cls=ForkProbe))
    try:
        (fact,) = group.facts()
        with open(f"/proc/{fact['ppid']}/comm") as f:
            assert f.read().strip() == "raylet"  # Ray spawned it: no warm process in between
    finally:
        group.shutdown()


def test_a_replacement_starts_while_the_survivors_drain(ray_session):
    import psutil

    group = RayWorkerGroup(RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(ForkProbe), process_model="fork",
                           on_rank_death="keep")
    try:
        pids = group.pid()
        sent = time.time()
        busy = group.nap_later(4.0)  # rank 0 stays busy for 4 s: the drain waits for it to leave
        os.kill(pids[1], signal.SIGKILL)
        report = group.replace_dead_ranks()
        new_pid = group.pid()[1]
        assert new_pid != pids[1] and report.ranks == [1]
        # Started while rank 0 was still busy, not after it had left (4 s after the call went out).
        assert psutil.Process(new_pid).create_time() < sent + 2.5, report
        with pytest.raises(WorkerDiedError):
            busy.get()
    finally:
        group.shutdown()
