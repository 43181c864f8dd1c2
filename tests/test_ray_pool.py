"""Ray resource pools, the loopback-only runtime and the rendezvous port reservation."""

from __future__ import annotations

import datetime
import errno
import os
import socket
import time

import pytest

ray = pytest.importorskip("ray")

from rankmesh import rendezvous  # noqa: E402
from rankmesh.backends.ray.pool import RayResourcePool, merge_resource_pool, node_sort_key, split_resource_pool  # noqa: E402
from rankmesh.errors import ResourcePoolError  # noqa: E402
from tests.drivers import run_code  # noqa: E402

LOOPBACK_ADDRS = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _cpus_available() -> float:
    return ray.available_resources().get("CPU", 0.0)


def _wait_cpus(expected: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _cpus_available() < expected:
        time.sleep(0.1)
    return _cpus_available()


# ----- runtime -----------------------------------------------------------------------------------


def test_local_ray_listens_on_loopback_only(ray_session):
    psutil = pytest.importorskip("psutil")
    node = ray.nodes()[0]
    assert node["NodeManagerAddress"] == "127.0.0.1"
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    raylet_pids = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if ray_session.address and ray_session.address.split(":")[-1] in cmd:
            raylet_pids.add(proc.pid)
    assert raylet_pids, "no Ray process found for this session"
    # Every Ray process of this session (gcs, raylet, agents, workers) and their children.
    pids = set()
    for pid in raylet_pids:
        try:
            p = psutil.Process(pid)
            pids.add(pid)
            pids.update(c.pid for c in p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    listening = [
        c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    assert listening
    exposed = [(c.pid, c.laddr) for c in listening if c.laddr.ip not in LOOPBACK_ADDRS]
    assert not exposed, f"Ray processes listening beyond loopback: {exposed}"


def test_loopback_addresses_get_the_loopback_settings():
    from rankmesh.backends.ray.runtime import _is_loopback_address

    assert _is_loopback_address("127.0.0.1:6379") and _is_loopback_address("localhost:1")
    assert _is_loopback_address("[::1]:6379")
    assert not _is_loopback_address("10.0.0.1:6379") and not _is_loopback_address("auto")
    assert not _is_loopback_address("ray://127.0.0.1:10001")


def test_node_sort_key_is_numeric_then_node_id():
    ips = ["10.0.0.10", "10.0.0.9", "9.255.0.1", "10.0.0.9"]
    ids = ["a", "c", "z", "b"]
    order = sorted(zip(ips, ids), key=lambda p: node_sort_key(*p))
    assert order == [("9.255.0.1", "z"), ("10.0.0.9", "b"), ("10.0.0.9", "c"), ("10.0.0.10", "a")]
    assert node_sort_key("10.0.0.1", "x") < node_sort_key("::1", "x")  # v4 before v6
    assert node_sort_key("not-an-ip", "x") > node_sort_key("::1", "x")


# ----- pools -------------------------------------------------------------------------------------


def test_pool_places_ranks_in_order_and_merges_same_node(ray_session):
    pool = RayResourcePool([2, 3], use_gpu=False)
    try:
        slots = pool.slots()
        assert len(slots) == 5 == pool.world_size
        # One physical node here: both entries count as one node for LOCAL_RANK purposes.
        assert pool.placement.process_on_nodes == (5,)
        assert [p.local_rank for p in pool.places()] == [0, 1, 2, 3, 4]
        assert {s.node_ip for s in slots} == {"127.0.0.1"}
        # Entries keep their order on a tie, bundles run in order inside an entry.
        assert [(s.entry, s.bundle_index) for s in slots] == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
        assert len(pool.get_placement_groups()) == 2
        assert "rank 4: node 0" in pool.describe()
    finally:
        pool.remove()


def test_split_pool_shares_placement_groups(ray_session):
    pool = RayResourcePool([4], use_gpu=False)
    try:
        a, b = split_resource_pool(pool, [1, 3])
        assert (a.world_size, b.world_size) == (1, 3)
        assert b.process_on_nodes == [3]
        assert b.slots()[0].bundle_index == 1
        assert [p.local_rank for p in b.places()] == [0, 1, 2]
        assert a.slots()[0].pg is b.slots()[0].pg
        halves = split_resource_pool(pool, 2)
        assert [h.world_size for h in halves] == [2, 2]
        with pytest.raises(ResourcePoolError, match="does not divide"):
            split_resource_pool(pool, 3)
        with pytest.raises(ResourcePoolError, match="sum to"):
            split_resource_pool(pool, [1, 1])
    finally:
        pool.remove()


def test_merged_pool_runs_on_both_pools_bundles_and_holds_their_groups(ray_session):
    first, second = RayResourcePool([2, 1], use_gpu=False, name_prefix="a"), RayResourcePool([1], use_gpu=False, name_prefix="b")
    try:
        merged = merge_resource_pool(first, second)
        assert (merged.name_prefix, merged.world_size, merged.process_on_nodes) == ("a_b", 4, [2, 1, 1])
        assert merged.reserved_cpus == 4  # the two pools' bundles, nothing of its own
        slots, own = merged.slots(), first.slots() + second.slots()
        assert [(s.pg, s.bundle_index) for s in slots] == [(s.pg, s.bundle_index) for s in own]
        # a view of a merged pool keeps its order; its second half is exactly pool b plus a's last bundle
        tail = split_resource_pool(merged, [2, 2])[1]
        assert [(s.pg, s.bundle_index) for s in tail.slots()] == [(s.pg, s.bundle_index) for s in own[2:]]
        assert tail.process_on_nodes == [1, 1]
        # a group on the merged pool fills b's only bundle (max_colocate_count=1): b refuses another
        merged.acquire()
        with pytest.raises(ResourcePoolError, match="'b': its bundles already hold 1 worker group"):
            second.admit()
        merged.release()
        second.admit()
        assert first._slots is None and second._slots is None  # the last user out removed both pools' groups
    finally:
        first.remove()
        second.remove()


def test_merging_pools_that_disagree_or_overlap_is_refused_by_name():
    one, ten = RayResourcePool([1], use_gpu=False), RayResourcePool([1], use_gpu=False, max_colocate_count=10)
    with pytest.raises(ResourcePoolError, match="differ in max_colocate_count"):
        merge_resource_pool(one, ten)
    with pytest.raises(ResourcePoolError, match="differ in use_gpu"):
        merge_resource_pool(one, RayResourcePool([1], use_gpu=True))
    with pytest.raises(ResourcePoolError, match="share 1 bundle"):
        merge_resource_pool(one, one)
    halves = split_resource_pool(RayResourcePool([2], use_gpu=False), 1)
    assert merge_resource_pool(halves[1], halves[0]).world_size == 2  # disjoint views of one pool merge


def test_pool_refcount_removes_placement_groups_on_last_release(ray_session):
    before = _wait_cpus(ray.cluster_resources()["CPU"] - 0.5, timeout=5)
    pool = RayResourcePool([3], use_gpu=False)
    pool.slots()
    pool.acquire()
    pool.acquire()
    pool.release()
    assert pool._slots is not None
    pool.release()
    assert pool._slots is None
    assert _wait_cpus(before) >= before
    # Placed again on next use.
    assert len(pool.slots()) == 3
    pool.remove()


def test_pool_that_cannot_fit_fails_fast_with_details(ray_session):
    before = _wait_cpus(ray.cluster_resources()["CPU"] - 0.5, timeout=5)
    pool = RayResourcePool([2, 64], use_gpu=False, ready_timeout=1.5)
    start = time.monotonic()
    with pytest.raises(ResourcePoolError) as info:
        pool.slots()
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "entry 1: 64 x {'CPU': 1.0} NOT placed" in text
    assert "needs {'CPU': 64.0} on one node" in text
    assert "127.0.0.1" in text and "CPU" in text and f"/{int(ray.cluster_resources()['CPU'])}" in text
    # Nothing stays reserved after the failure.
    assert _wait_cpus(before) >= before


#: Run in a fresh process (Ray allows one connection per process, and the session's Ray is up):
#: a worker group on part of a pool of ``n`` CPU processes, ``n`` more than the machine's cores,
#: starts the embedded Ray itself.  Were it started with one CPU per core, the pool could not be
#: placed.  Once Ray runs it is never resized, so a later pool that does not fit still fails.
EMBEDDED_RAY_SCRIPT = """
import os
import ray
from rankmesh import Dispatch, RankMesh, Worker, register
from rankmesh import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rankmesh.errors import ResourcePoolError
from rankmesh.backends.ray import split_resource_pool
from tests.drivers import print_report

class Echo(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def whoami(self):
        return self.rank

n = max(8, (os.cpu_count() or 1) + 1)
pool = RayResourcePool([n], use_gpu=False)
two, rest = split_resource_pool(pool, [2, n - 2])
assert not ray.is_initialized()
wg = RayWorkerGroup(two, RayClassWithInitArgs(Echo), mesh=RankMesh(dp=2))
report = {"n": n, "ranks": wg.whoami(), "slots": len(pool.slots()), "cpus": ray.cluster_resources()["CPU"]}
import time
started = time.monotonic()
try:
    RayResourcePool([1], use_gpu=False).slots()  # the default 60 s ready_timeout
except ResourcePoolError as exc:
    report["error"] = str(exc)
report["failed_after_s"] = time.monotonic() - started
wg.shutdown()
ray.shutdown()
print_report(report)
"""


def test_pool_starts_the_embedded_ray_with_enough_cpus_for_itself():
    report = run_code(EMBEDDED_RAY_SCRIPT, timeout=300)
    n = report["n"]
    assert n > (os.cpu_count() or 1) and report["ranks"] == [0, 1]
    assert report["slots"] == n  # the whole pool is placed, not only the group's share
    assert report["cpus"] == n  # max(cores, n): exactly what the pool reserves
    # The running Ray is not resized for a later pool: the clear error, with how to fix it.
    assert "entry 0: 1 x {'CPU': 1.0} NOT placed (needs {'CPU': 1.0} on one node)" in report["error"]
    assert f"CPU 0/{n}" in report["error"]
    assert "ensure_ray(num_cpus=N)" in report["error"]
    # ... at once: a Ray this process started gets no node and frees nothing while the pool waits.
    assert "does not fit the free resources of the Ray this process started" in report["error"]
    assert report["failed_after_s"] < 2.0, report["failed_after_s"]


def test_embedded_ray_is_sized_for_the_whole_pool():
    assert RayResourcePool([8], use_gpu=False).reserved_cpus == 8
    assert RayResourcePool([2, 3], use_gpu=True, max_colocate_count=2).reserved_cpus == 10
    halves = split_resource_pool(RayResourcePool([4, 4], use_gpu=False), 4)
    assert halves[1].reserved_cpus == 8  # a view places its root's bundles


def test_gpu_pool_on_cpu_cluster_names_missing_gpu(ray_session):
    with pytest.raises(ResourcePoolError, match="GPU 0/0"):
        RayResourcePool([1], use_gpu=True, ready_timeout=1.0).slots()


@pytest.mark.parametrize("bad", [[], [0], [2, -1], "4", [1.5]])
def test_pool_rejects_bad_counts(bad):
    with pytest.raises(ResourcePoolError):
        RayResourcePool(bad, use_gpu=False)


def test_pool_bundle_and_actor_share():
    pool = RayResourcePool([2], use_gpu=True, max_colocate_count=3)
    assert pool.bundle == {"CPU": 3.0, "GPU": 1.0}
    assert pool.actor_resources == {"num_cpus": 1.0, "num_gpus": pytest.approx(1 / 3)}
    assert RayResourcePool([1], use_gpu=False).bundle == {"CPU": 1.0}


# ----- rendezvous --------------------------------------------------------------------------------


def test_gloo_binds_the_interface_that_holds_the_nodes_address():
    # By hand: 127.0.0.1 is lo's address on every Linux machine; 203.0.113.7 (TEST-NET-3) is nobody's.
    assert rendezvous.interface_of("127.0.0.1") == "lo"
    assert rendezvous.interface_of("203.0.113.7") is None


def test_reserved_port_is_held_until_the_store_takes_it():
    port = rendezvous.reserve_port("127.0.0.1")
    try:
        assert rendezvous.is_reserved("127.0.0.1", port)
        intruder = socket.socket()
        with pytest.raises(OSError) as info:
            intruder.bind(("127.0.0.1", port))
        intruder.close()
        assert info.value.errno == errno.EADDRINUSE
        env = rendezvous.DistEnv(0, 1, 0, 1, "127.0.0.1", port)
        store = rendezvous.create_store(env, datetime.timedelta(seconds=10))
        assert not rendezvous.is_reserved("127.0.0.1", port)
        store.set("k", "v")
        client = rendezvous.create_store(rendezvous.DistEnv(1, 2, 1, 2, "127.0.0.1", port), datetime.timedelta(seconds=10))
        assert client.get("k") == b"v"
        del client, store
    finally:
        rendezvous.release_port("127.0.0.1", port)


def test_plain_env_init_can_bind_a_reserved_port():
    """User code calling init_process_group(env://) itself rebinds the port (SO_REUSEADDR)."""
    import torch.distributed as dist

    port = rendezvous.reserve_port("127.0.0.1")
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
        store.set("a", "b")
        # A second process's view: a client on the same port reads what the master wrote.
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=10))
        assert client.get("a") == b"b" and store.get("a") == b"b"
        del client, store
    finally:
        rendezvous.release_port("127.0.0.1", port)


def test_dist_env_requires_every_variable():
    with pytest.raises(rendezvous.RendezvousError, match="MASTER_PORT"):
        rendezvous.DistEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "x"})
    env = rendezvous.DistEnv(1, 2, 1, 2, "127.0.0.1", 1234)
    assert rendezvous.DistEnv.from_environ(env.as_env()) == env


def test_a_group_more_than_the_bundles_hold_is_refused_at_once(ray_session):
    from rankmesh import RayClassWithInitArgs, RayWorkerGroup
    from tests.dispatch_workers import RecordingWorker

    pool = RayResourcePool([2], use_gpu=False)  # max_colocate_count=1: one group per bundle
    first = RayWorkerGroup(pool, RayClassWithInitArgs(RecordingWorker))
    try:
        start = time.monotonic()
        with pytest.raises(ResourcePoolError) as info:
            RayWorkerGroup(pool, RayClassWithInitArgs(RecordingWorker))
        assert time.monotonic() - start < 2.0  # not after start_timeout: its actors could never be placed
        text = str(info.value)
        assert "already hold 1 worker group(s), as many as max_colocate_count=1 allows" in text
        assert "max_colocate_count=2 or more" in text
        assert len(first.one_to_all("still here")) == 2  # the running group is untouched
    finally:
        first.shutdown()
