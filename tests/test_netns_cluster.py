"""A namespaced cluster (rankmesh.testing.cluster) against real Ray: addresses, partitions, caps, kills, new nodes, cleanup.

One module-scoped cluster of three nodes, each its own network namespace.  The pytest process
stays in the host's namespace; everything that talks to the cluster runs inside it, through the
helper: Ray drivers (tests/netns_scenarios.py) and plain TCP probes (tests/netns_sockets.py).
Expected values come from the setup, written by hand: the addresses below, the health-check
settings' window, the cap's rate.  The tests run in file order and each leaves the cluster as
the next expects (n2 partitioned and healed, then n1 killed, then a node added, then n2 removed,
a node added and another partitioned mid-call, then two fresh nodes and the head cut off, then
closed).

Skips in one line where namespaces cannot be made (no root, no ``ip``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from tests.drivers import REPO, REPORT, DriverError, read_report

logger = logging.getLogger(__name__)

#: The nodes' addresses, by hand: host numbers .9, .10 and .100 of 198.18.0.0/24, in node order.
EXPECTED_ADDRESSES = ["198.18.0.9", "198.18.0.10", "198.18.0.100"]
#: The address add_node gives next (.11: the first number after the three widths).
NEXT_ADDRESS = "198.18.0.11"
#: Seconds within which the GCS must declare a lost node dead, by hand from TEST_HEALTH_CHECKS:
#: 3 failed checks, each up to 1 s timeout plus 1 s period = 6 s, plus 4 s for a loaded 2-core machine.
DEATH_WINDOW_S = 3 * (1.0 + 1.0) + 4.0
#: The cap of test_cap_limits_throughput and the bytes sent through it: 1 MiB at 8 Mbit/s is
#: 1.05 s on the wire; without a cap the same bytes take milliseconds.
CAP_MBIT = 8
CAP_BYTES = 1 << 20
#: How long the partition test watches Ray's entries for the healed node.
OBSERVE_AFTER_HEAL_S = 10.0
#: How long a TCP probe (to the node's raylet port) waits before calling the address unreachable.
PROBE_TIMEOUT_S = 2.0


def driver_env() -> dict[str, str]:
    """What a driver inside the cluster needs besides the cluster's env: this checkout importable."""
    paths = (str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", ""))
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def drive(cluster, module: str, *args: str, node=None, timeout: float = 120.0):
    """``python -m module *args`` inside ``node``'s namespace (the head's by default); its report."""
    proc = cluster.run([sys.executable, "-m", module, *args], node=node, timeout=timeout, cwd=REPO, env=driver_env())
    report = read_report(proc.stdout)
    if proc.returncode != 0 or report is None:
        raise DriverError(f"{module} {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return report


class Lines:
    """A driver's stdout, line by line, each wait with a deadline (a reader thread feeds a queue)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line.startswith(prefix):
                return line
        raise DriverError(f"no line starting {prefix!r} within {timeout:g} s (driver exit {self.proc.poll()})")

    def send(self, cue: str) -> None:
        self.proc.stdin.write(cue + "\n")
        self.proc.stdin.flush()


def start_scenario(cluster, err_path, *args: str) -> tuple[subprocess.Popen, Lines]:
    """``python -m tests.netns_scenarios *args`` in the head's namespace, talked to line by line
    (cues on its stdin, its stdout as :class:`Lines`); its stderr goes to ``err_path``."""
    err = open(err_path, "w")
    proc = cluster.popen([sys.executable, "-m", "tests.netns_scenarios", *args], cwd=REPO, env=driver_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    return proc, Lines(proc)


def watch(cluster, address: str, observe_s: float, tmp_path) -> tuple[subprocess.Popen, Lines]:
    """Start a watcher of ``address`` (tests/netns_scenarios.py ``watch``) and wait until it is ready."""
    proc, lines = start_scenario(cluster, tmp_path / f"watch-{address}.err", "watch", address, str(observe_s))
    lines.wait_for("READY", 120)
    return proc, lines


def _skip_without_namespaces() -> None:
    from rankmesh.testing.cluster import unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no namespaced cluster here: {reason}")


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from rankmesh.testing.cluster import NetnsCluster

    _skip_without_namespaces()
    netns = NetnsCluster(3, cpus=1, lifetime_s=600)
    netns.start()
    logger.info("3-node namespaced cluster started in %.1f s", netns.start_seconds)
    yield netns
    netns.close()


@pytest.fixture(scope="module")
def ray_view(cluster):
    """Ray's nodes as a driver in the head's namespace sees them, with a task pinned to each."""
    return drive(cluster, "tests.netns_scenarios", "nodes")


def test_stale_namespaces_of_a_dead_owner_are_removed_with_their_processes() -> None:
    """A namespace named for an owner pid that is gone, with a process in it, as a crash leaves one."""
    from rankmesh.testing.cluster import PREFIX, ip_binary, namespace_pids, namespaces, pid_alive, remove_stale

    _skip_without_namespaces()
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not pid_alive(gone.pid)
    stale = f"{PREFIX}-{gone.pid}-test-n0"
    subprocess.run([ip_binary(), "netns", "add", stale], check=True)
    sleeper = subprocess.Popen([ip_binary(), "netns", "exec", stale, "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        while not namespace_pids(stale) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert namespace_pids(stale) == [sleeper.pid]
        assert stale in remove_stale()
        assert sleeper.wait(10) == -9
        assert stale not in namespaces()
    finally:
        sleeper.kill()
        subprocess.run([ip_binary(), "netns", "del", stale], capture_output=True)


def test_a_killed_owner_leaves_nothing_behind() -> None:
    """SIGKILL the process that owns a one-node cluster: its watchdog removes namespaces, processes and temp dir."""
    from rankmesh.testing.cluster import namespaces

    pytest.importorskip("ray")
    _skip_without_namespaces()
    code = ("import sys, time; from rankmesh.testing.cluster import NetnsCluster; "
            "c = NetnsCluster(1, lifetime_s=120).start(); print('STEM', c.stem, c.temp_dir, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, **driver_env()},
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        _, stem, temp_dir = Lines(owner).wait_for("STEM", 120).split()
        assert [n for n in namespaces() if n.startswith(stem + "-")]
    finally:
        owner.kill()
        owner.wait(10)
    t0 = time.monotonic()
    while ([n for n in namespaces() if n.startswith(stem + "-")] or os.path.exists(temp_dir)) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    logger.info("killed owner: its cluster was gone %.1f s later", time.monotonic() - t0)
    assert not [n for n in namespaces() if n.startswith(stem + "-")]
    assert not os.path.exists(temp_dir)


def test_a_range_that_is_public_or_in_use_is_refused() -> None:
    """check_network: a public range is refused before anything is asked; loopback (on every host's lo) is in use."""
    from rankmesh.testing.cluster import check_network, ip_binary

    with pytest.raises(ValueError, match="not a private IPv4 range"):
        check_network("8.8.8.0/24")
    if ip_binary() is None:
        pytest.skip("no `ip` command to read the host's addresses with")
    with pytest.raises(ValueError, match=r"127\.0\.0\.0/24 is in use .*address 127\.0\.0\.1/8 on lo"):
        check_network("127.0.0.0/24")


def test_the_expected_addresses_sort_differently_as_strings() -> None:
    """The setup's own premise: string order of the hand-written addresses is not their numeric order."""
    assert sorted(EXPECTED_ADDRESSES) != sorted(EXPECTED_ADDRESSES, key=ipaddress.ip_address)


def test_nodes_have_mixed_width_addresses_and_ray_sees_them_alive(cluster, ray_view) -> None:
    assert [n.address for n in cluster.nodes] == EXPECTED_ADDRESSES
    assert len({n.namespace for n in cluster.nodes}) == 3
    alive = sorted(n["address"] for n in ray_view["nodes"] if n["alive"])
    assert alive == sorted(EXPECTED_ADDRESSES)


def test_a_task_pinned_to_each_node_reports_that_nodes_address(ray_view) -> None:
    assert ray_view["pinned"] == {a: a for a in EXPECTED_ADDRESSES}


@pytest.fixture(scope="module")
def group_driver(cluster, tmp_path_factory):
    """The ``group slow`` driver (tests/netns_scenarios.py): one rank per node, alive across the
    two tests that read it (the group's placement, then the same group over a capped link)."""
    proc, lines = start_scenario(cluster, tmp_path_factory.mktemp("group") / "group.err", "group", "slow")
    yield lines
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def report_of(line: str) -> dict:
    return json.loads(line[len(REPORT):])


def test_a_groups_ranks_follow_the_nodes_numeric_address_order(group_driver, ray_view) -> None:
    # One rank per node.  By hand: numeric order is .9 < .10 < .100; as strings it would be
    # .10 < .100 < .9 (the ordering bug of verl #7160).  Ranks 1 and 2 rendezvous with rank 0
    # over the bridge, so the all-reduce (1 + 2 + 3) crosses real network stacks.
    report = report_of(group_driver.wait_for(REPORT, 180))
    assert report["node_ips"] == ["198.18.0.9", "198.18.0.10", "198.18.0.100"]
    assert report["ranks"] == [0, 1, 2] and report["master"] == "198.18.0.9"
    assert report["sums"] == [6.0, 6.0, 6.0]


def test_a_capped_link_shows_as_the_straggler_and_the_hang_report_names_its_node(cluster, group_driver) -> None:
    """The link of the node with rank 2 (.100) capped at CAP_MBIT: each rank's piece of a data call
    (256 KiB) reaches that node ~0.26 s late, so a trace of three calls names rank 2 the straggler
    (the rank that ended last); a call whose pieces take ~2 s over the cap, past its 1 s timeout,
    is a HangError naming rank 2 alone and its node.  Expected by hand from the cap and the sizes
    (tests/netns_scenarios.py, ``slow_link``)."""
    group_driver.wait_for("READY", 120)
    capped = cluster.node("n2")
    cluster.cap(capped, CAP_MBIT)
    try:
        group_driver.send("capped")
        report = report_of(group_driver.wait_for(REPORT, 120))
    finally:
        cluster.cap(capped, None)
    logger.info("over a %d Mbit/s link:\n%s\n%s", CAP_MBIT, report["summary"], (report["hang"] or {}).get("text"))
    assert report["slowest"] == [2, 2, 2] and report["straggler"] == 2, report["summary"]
    assert "straggler: rank 2 (slowest in 3 of 3 calls)" in report["summary"]
    assert report["hang"] is not None and report["hang"]["ranks"] == [2], report["hang"]
    assert report["hang"]["nodes"] == [capped.address] and capped.address in report["hang"]["text"], report["hang"]


def test_cap_limits_throughput(cluster) -> None:
    """1 MiB from the head to n1, without a cap, at CAP_MBIT, and with the cap lifted (plain TCP)."""
    target = cluster.node("n1")

    def seconds(port: int) -> float:
        server = cluster.popen([sys.executable, "-m", "tests.netns_sockets", "serve", target.address, str(port)],
                               node=target, cwd=REPO, env=driver_env(), stdout=subprocess.PIPE, text=True)
        try:
            Lines(server).wait_for("LISTENING", 30)
            return drive(cluster, "tests.netns_sockets", "send", target.address, str(port), str(CAP_BYTES), timeout=60)
        finally:
            server.wait(30)

    free = seconds(5101)
    cluster.cap(target, CAP_MBIT)
    capped = seconds(5102)
    cluster.cap(target, None)
    lifted = seconds(5103)
    wire_s = CAP_BYTES * 8 / (CAP_MBIT * 1e6)
    logger.info("1 MiB head -> n1: %.3f s free (%.0f Mbit/s), %.3f s capped at %d Mbit/s (%.1f Mbit/s), %.3f s lifted",
                free, CAP_BYTES * 8 / free / 1e6, capped, CAP_MBIT, CAP_BYTES * 8 / capped / 1e6, lifted)
    assert 0.8 * wire_s <= capped <= 3 * wire_s
    assert free < wire_s / 4 and lifted < wire_s / 4


def test_partition_declares_the_node_dead_and_heal_reconnects(cluster, ray_view, tmp_path) -> None:
    from rankmesh.testing.cluster import namespace_pids

    target = cluster.node("n2")
    port = next(n["port"] for n in ray_view["nodes"] if n["address"] == target.address)
    proc, lines = watch(cluster, target.address, OBSERVE_AFTER_HEAL_S, tmp_path)
    try:
        t0 = time.monotonic()
        cluster.partition(target)
        lines.send("go")
        dead_after = read_report(lines.wait_for(REPORT, DEATH_WINDOW_S + 60))["dead_after_s"]
        seen_by_test = time.monotonic() - t0
        cut = drive(cluster, "tests.netns_sockets", "connect", target.address, str(port), str(PROBE_TIMEOUT_S))
        lives_on = namespace_pids(target.namespace)
        cluster.heal(target)
        lines.send("healed")
        healed = drive(cluster, "tests.netns_sockets", "connect", target.address, str(port), str(PROBE_TIMEOUT_S))
        after_heal = read_report(lines.wait_for(REPORT, OBSERVE_AFTER_HEAL_S + 60))["after_heal"]
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = namespace_pids(target.namespace)
    logger.info("partition of n2: dead after %s s (watcher), %.1f s (test); TCP %s while cut, %s after heal; "
                "%d processes lived on while cut, %d %.0f s after heal; Ray's entries after heal: %s",
                dead_after, seen_by_test, cut, healed, len(lives_on), len(left), OBSERVE_AFTER_HEAL_S, after_heal)
    assert dead_after is not None and dead_after <= DEATH_WINDOW_S
    assert cut == "timeout"
    assert lives_on, "a partition must leave the node's processes alive"
    assert healed in ("connected", "refused")  # the address answers again


def test_kill_node_removes_it(cluster, tmp_path) -> None:
    from rankmesh.testing.cluster import namespaces

    target = cluster.node("n1")
    proc, lines = watch(cluster, target.address, 0, tmp_path)
    try:
        cluster.kill_node(target)
        lines.send("go")
        dead_after = read_report(lines.wait_for(REPORT, DEATH_WINDOW_S + 60))["dead_after_s"]
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    logger.info("kill_node(n1): dead after %s s", dead_after)
    assert dead_after is not None and dead_after <= DEATH_WINDOW_S
    assert target.namespace not in namespaces()
    assert [n.name for n in cluster.nodes] == ["n0", "n2"]


def test_add_node_adds_a_live_node(cluster) -> None:
    t0 = time.monotonic()
    node = cluster.add_node()
    took = time.monotonic() - t0
    view = drive(cluster, "tests.netns_scenarios", "nodes")
    logger.info("add_node: %s up in %.1f s", node.address, took)
    assert node.address == NEXT_ADDRESS
    assert any(n["address"] == NEXT_ADDRESS and n["alive"] for n in view["nodes"])
    assert view["pinned"][NEXT_ADDRESS] == NEXT_ADDRESS


def beats_of(beat_dir, pid: int) -> list[float]:
    """The heartbeats process ``pid`` wrote (tests/multinode_worker.py, ``work``)."""
    path = beat_dir / f"beats-{pid}"
    return [float(line) for line in path.read_text().split()] if path.exists() else []


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # one PID namespace: the nodes' namespaces are network ones only
    except ProcessLookupError:
        return False
    return True


def cut_mid_call(cluster, lines, beat_dir, pid: int, node, end_wait_s: float) -> tuple[float, dict, dict, float | None]:
    """Once the ``partition`` driver says ``CALLING`` and process ``pid`` beats, cut ``node`` off;
    then heal it and cue ``healed``.  Returns when the cut came (wall clock), the driver's report of
    the call and its report after the heal, and how long after the heal ``pid`` ended (``None``:
    it still ran ``end_wait_s`` later)."""
    from tests.netns_scenarios import WORK_S

    lines.wait_for("CALLING", 60)
    end = time.monotonic() + 30
    while not beats_of(beat_dir, pid) and time.monotonic() < end:
        time.sleep(0.1)
    cut_at = time.time()
    cluster.partition(node)
    answered = report_of(lines.wait_for(REPORT, WORK_S + DEATH_WINDOW_S + 120))
    cluster.heal(node)
    healed_at = time.monotonic()
    lines.send("healed")
    after = report_of(lines.wait_for(REPORT, 120))
    end = time.monotonic() + end_wait_s
    while pid_alive(pid) and time.monotonic() < end:
        time.sleep(0.5)
    return cut_at, answered, after, None if pid_alive(pid) else time.monotonic() - healed_at


def test_a_node_cut_off_mid_call_is_replaced_from_a_spare_or_shrunk_and_its_rank_fenced_after_heal(cluster, tmp_path) -> None:
    """A rank's node cut off while every rank computes for WORK_S (tests/netns_scenarios.py,
    ``partition``, ``on_rank_death="replace_or_shrink"``): within the health window the call fails
    there, a warm spare on another node takes its place, and the call's retry gives the
    undisturbed answer [1, 2].  The cut-off process keeps computing through it all (its
    heartbeats).  After the heal nothing of it is taken (the group's answers come from the new
    process) and it ends, with its node's raylet.  Then the node of the rank not on the head is cut off mid-call:
    no spare is left and no node has room, so the group shrinks to the head's replica, whose
    retry answers [1] and takes every row of a data call; after the heal that process ends too."""
    from tests.netns_scenarios import WORK_S

    # Three live nodes, one process each: the two ranks and the spare.  The earlier tests left the
    # head, n2 (dead since its partition) and the node they added.
    cluster.kill_node("n2")
    cluster.add_node()
    beat_dir = tmp_path / "beats"
    beat_dir.mkdir()
    proc, lines = start_scenario(cluster, tmp_path / "partition.err", "partition", str(beat_dir))
    try:
        placed = report_of(lines.wait_for(REPORT, 240))
        # The rank not on the head (whose node is the controller's): cut its node off.
        rank = 1 if placed["node_ips"][1] != cluster.head.address else 0
        old_pid, victim = placed["pids"][rank], cluster.node(placed["node_ips"][rank])
        cut_at, answered, after, ended = cut_mid_call(cluster, lines, beat_dir, old_pid, victim, 60)
        # The second cut: the node of the rank not on the head now (the spare may have been there).
        cut = 1 if after["node_ips"][1] != cluster.head.address else 0
        second_pid, second = after["pids"][cut], cluster.node(after["node_ips"][cut])
        lines.send("again")
        # 6-36 s here until it ends: its raylet ends once the GCS tells it it was declared dead.
        second_cut_at, shrunk, last, second_ended = cut_mid_call(cluster, lines, beat_dir, second_pid, second, 90)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    beats = beats_of(beat_dir, old_pid)
    logger.info("partition of %s mid-call: %s\nanswer %s after %.1f s; %d heartbeats of the cut-off process after the "
                "cut, last %.1f s after it; after the heal %s; the old process ended %s s after the heal", victim.address,
                answered["format"], answered["values"], answered["seconds"], sum(b > cut_at for b in beats),
                (max(beats) - cut_at) if beats else -1, after, ended)
    assert placed["undisturbed"] == [1, 2] and placed["sums"] == [3.0, 3.0] and placed["spares"] == 1
    assert answered["values"] == [1, 2] and answered["sums"] == [3.0, 3.0]  # the retry's answer is the undisturbed one
    # The survivor, waiting in the all-reduce on the cut-off rank, was freed at once by cutting its
    # connections to the dead node (before: until gloo's 10-minute timeout, or the heal).
    # (The drain waits for the survivor's own WORK_S, then its all-reduce fails at once.)
    assert answered["seconds"] < WORK_S + 15, answered
    assert answered["replaced"] == [rank] and answered["from_spares"] == [rank], answered
    assert answered["old_nodes"][str(rank)] == victim.address and answered["new_nodes"][str(rank)] != victim.address
    assert answered["detected_s"] is not None and answered["detected_s"] <= DEATH_WINDOW_S + 5, answered
    assert answered["pids"][1 - rank] == placed["pids"][1 - rank] and answered["pids"][rank] != old_pid
    # It kept computing through the partition, well past the moment it was declared dead.
    assert any(b > cut_at + DEATH_WINDOW_S for b in beats), (cut_at, beats[-3:])
    # Fenced: after the heal the group answers from its new process only, and the old one ends.
    assert after["values"] == [1, 2] and old_pid not in after["pids"] and after["sums"] == [3.0, 3.0]
    assert ended is not None, f"the cut-off process {old_pid} still runs 60 s after the heal"
    # The second cut, with nothing to replace it from: the policy shrinks to the survivor's replica.
    logger.info("second partition (%s) mid-call: %s; answer %s after %.1f s; %d heartbeats after the cut; "
                "the old process ended %s s after the heal", second.address, (shrunk["shrink"] or {}).get("format"),
                shrunk["values"], shrunk["seconds"], sum(b > second_cut_at for b in beats_of(beat_dir, second_pid)),
                second_ended)
    assert shrunk["shrink"] is not None and shrunk["shrink"]["kind"] == "shrink", shrunk
    assert shrunk["shrink"]["dead"] == [cut] and shrunk["shrink"]["lost_replicas"] == [cut], shrunk
    assert shrunk["shrink"]["detected_s"] is not None and shrunk["shrink"]["detected_s"] <= DEATH_WINDOW_S + 5, shrunk
    assert shrunk["replacements"] == 1 and shrunk["world"] == 1
    survivor = 1 - cut
    assert shrunk["values"] == [1] and shrunk["sums"] == [1.0] and shrunk["pids"] == [after["pids"][survivor]]  # renumbered rank 0
    assert shrunk["seconds"] < WORK_S + 15, shrunk  # the survivor's all-reduce on the cut-off rank ended at once
    assert shrunk["rows"] == [0, 0, 0, 0]  # every row of the data call, on the one replica left
    assert any(b > second_cut_at + DEATH_WINDOW_S for b in beats_of(beat_dir, second_pid))  # it kept computing
    assert last["values"] == [1] and last["pids"] == [after["pids"][survivor]]
    assert second_ended is not None, f"the cut-off process {second_pid} still runs 90 s after the heal"


def test_the_controllers_own_node_cut_off_is_reported_as_such_not_as_dead_ranks(cluster, tmp_path) -> None:
    """The head, where the driver (the controller) and the GCS run, cut off mid-call from the two
    other nodes of a one-rank-per-node group: the GCS declares both dead, and the call raises one
    ControllerCutOffError naming the head's address, the two lost nodes and their ranks, within
    the health window plus the ping's bound; no replacement is tried, and later calls say the
    group failed.  Leaves the cluster cut (the last test before close)."""
    # Two fresh live worker nodes (the earlier tests left one dead and one with its old spare).
    for node in list(cluster.nodes[1:]):
        cluster.kill_node(node)
    cluster.add_node()
    cluster.add_node()
    proc, lines = start_scenario(cluster, tmp_path / "cut_head.err", "cut_head", str(tmp_path))
    try:
        placed = report_of(lines.wait_for(REPORT, 240))
        lines.wait_for("CALLING", 60)
        time.sleep(1.0)  # the call is running on every rank
        cut = time.monotonic()
        cluster.partition(cluster.head)
        got = report_of(lines.wait_for(REPORT, 120))
        told_after = time.monotonic() - cut
        cluster.heal(cluster.head)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    others = [a for a in placed["node_ips"] if a != cluster.head.address]
    logger.info("head cut off: %s after %.1f s (call %.1f s); later: %s", got["error"], told_after, got["seconds"],
                got["later"])
    assert len(others) == 2
    error = got["error"]
    assert error is not None and error["type"] == "ControllerCutOffError", error
    assert error["node"] == cluster.head.address and sorted(error["lost_nodes"]) == sorted(others)
    assert error["ranks"] == [i for i, a in enumerate(placed["node_ips"]) if a != cluster.head.address]
    assert "cut off" in error["text"] and cluster.head.address in error["text"]
    # Within the health window (declared dead), one more window for the second node, and the ping's bound.
    assert got["seconds"] <= 1.0 + DEATH_WINDOW_S + 2 * (1.0 + 1.0) + 2.0 + 4.0, got["seconds"]
    assert got["replacements"] == 0
    assert got["later"] is not None and "failed earlier" in got["later"] and "cut off" in got["later"]


def test_close_leaves_no_namespace_and_no_process(cluster) -> None:
    from rankmesh.testing.cluster import namespace_pids, namespaces, pid_alive

    mine = [n for n in namespaces() if n.startswith(cluster.stem + "-")]
    pids = [p for n in mine for p in namespace_pids(n)]
    assert mine and pids
    cluster.close()
    assert not [n for n in namespaces() if n.startswith(cluster.stem + "-")]
    time.sleep(0.2)  # SIGKILLed processes are reaped by their parents
    assert not [p for p in pids if pid_alive(p) and not _zombie(p)]
    assert not cluster.temp_dir.exists()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
