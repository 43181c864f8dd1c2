"""Replacing dead ranks in place on real Ray with a real gloo world (4 ranks).

Expected values are written by hand from the mesh definition (order tp-cp-ep-dp-pp: rank =
tp + 2 * dp for tp2·dp2) and from arithmetic, never read back from the code under test.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time

import psutil
import pytest
import torch

from rankmesh.data import DataProto
from rankmesh.errors import BackendError, RecoveryError, ResourcePoolError, ShardLostError, WorkerDiedError
from rankmesh.mesh import RankMesh

ray = pytest.importorskip("ray")

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, split_resource_pool  # noqa: E402
from rankmesh.backends.ray.pool import Slot  # noqa: E402
from rankmesh.backends.ray.calls import Pending  # noqa: E402
from rankmesh.backends.ray.recovery import ReplacementReport, exit_on_next_call  # noqa: E402
from rankmesh.backends.ray.remesh import RemeshReport, new_groups  # noqa: E402
from rankmesh.backends.ray.spares import Spare, SpareStatus, spare_order  # noqa: E402
from tests.recovery_workers import StateWorker  # noqa: E402

#: tp2·dp2 by hand: rank -> (tp, dp).
COORDS = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}


def start(mesh: RankMesh, policy: str, scale: int = 3) -> RayWorkerGroup:
    return RayWorkerGroup(
        RayResourcePool([mesh.world_size], use_gpu=False),
        RayClassWithInitArgs(StateWorker, scale=scale),
        mesh=mesh,
        worker_env={"EXTRA": "kept"},
        on_rank_death=policy,
        call_timeout_s=120,
    )


def test_replace_keeps_survivors_and_rebuilds_the_dead_rank(ray_session):
    wg = start(RankMesh(tp=2, dp=2), "keep")
    try:
        wg.bump()
        wg.bump()
        # State depends on tp only, so both dp replicas of a shard hold the same values.
        wg.set_state([[10.0 * COORDS[r][0] + k for k in (1, 2, 3)] for r in range(4)])
        before = wg.whoami()
        exit_on_next_call(wg, 1, "world_sum")
        with pytest.raises(WorkerDiedError) as info:
            wg.world_sum([1.0, 2.0, 3.0, 4.0])
        assert info.value.ranks == [1]
        with pytest.raises(WorkerDiedError, match="replace_dead_ranks"):
            wg.whoami()  # survivors are kept, but calls wait for the replacement

        report = wg.replace_dead_ranks(timeout_s=120)

        assert report.ranks == [1] and report.peers == {1: 3}
        after = wg.whoami()
        for r in (0, 2, 3):  # the same processes and the same Python objects
            assert (after[r]["pid"], after[r]["obj"], after[r]["counter"]) == (before[r]["pid"], before[r]["obj"], 2)
        new = after[1]
        assert new["pid"] != before[1]["pid"] and new["pid"] == report.new_pids[1] and new["counter"] == 0
        assert new["scale"] == 3  # the same constructor arguments
        assert new["coords"] == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 0}
        assert new["env"] == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                              "MASTER_ADDR": "127.0.0.1", "EXTRA": "kept"}
        assert [a["dist_rank"] for a in after] == [0, 1, 2, 3] and {a["dist_world"] for a in after} == {4}
        ports = {a["master_port"] for a in after}
        assert len(ports) == 1 and ports != {before[0]["master_port"]}  # one fresh rendezvous
        # restore_from_peer copied rank 3's tensor (tp 1) into the new rank 1.
        assert wg.get_state()[1] == [11.0, 12.0, 13.0]
        # torch.distributed works across old and new ranks: 3 * (1 + 2 + 3 + 4) = 30.
        assert wg.world_sum([1.0, 2.0, 3.0, 4.0]) == [30.0] * 4
        assert wg.replace_dead_ranks() is None  # nothing dead: nothing done
    finally:
        wg.shutdown()


class _Bystander:
    """A Ray actor that is no rank of any group: its death notice is Ray's to print."""

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os._exit(1)


def test_replace_policy_retries_the_failed_call_several_times_in_a_row(ray_session, caplog, capsys):
    wg = start(RankMesh(dp=4), "replace", scale=2)
    try:
        pids = [a["pid"] for a in wg.whoami()]
        for victim, values, want in ((2, [1.0, 2.0, 3.0, 4.0], 20.0), (0, [0.5, 0.5, 1.0, 1.0], 6.0)):
            exit_on_next_call(wg, victim, "world_sum")
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="rankmesh"):
                # The undisturbed result: 2 * sum(values), on every rank.
                assert wg.world_sum(values) == [want] * 4
            report = wg.replacements[-1]
            assert report.ranks == [victim] and report.detected_s is not None
            # A handled failure is one line: what died, what was done, how long it took.
            loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("rankmesh")]
            assert len(loud) == 1, loud
            assert loud[0].startswith(f"world_sum: replaced ranks [{victim}]") and "detected in" in loud[0], loud
            assert loud[0].endswith("retrying the call once"), loud
            # Every output of the failed attempt was read: Ray has no failed object to call unhandled.
            assert wg.executor.unread_outputs == []
            now = [a["pid"] for a in wg.whoami()]
            assert [p for r, p in enumerate(now) if r != victim] == [p for r, p in enumerate(pids) if r != victim]
            assert now[victim] != pids[victim]
            pids = now
        assert len(wg.replacements) == 2
        # A call on a replica view takes the group's policy: dp replica 3 (rank 3) dies inside
        # it, is replaced, and the view's call is retried, answering from the new process.
        exit_on_next_call(wg, 3, "whoami")
        answer = wg.replica(3).whoami()
        assert [a["rank"] for a in answer] == [3] and answer[0]["pid"] != pids[3]
        assert wg.replacements[-1].ranks == [3] and len(wg.replacements) == 3
        assert [a["pid"] for a in wg.whoami()][:3] == pids[:3]
        assert wg.world_sum([1.0, 1.0, 1.0, 1.0]) == [8.0] * 4  # the re-formed world still reduces
        # Ray's own notices of the three deaths stayed out of the output: the group said each in one
        # line.  A bystander actor dies last and its notice prints, a witness that notices reach here.
        bystander = ray.remote(num_cpus=0)(_Bystander).remote()
        witness = ray.get(bystander.pid.remote())
        bystander.die.remote()
        out, deadline = "", time.monotonic() + 30
        while f"Worker PID: {witness}" not in out and time.monotonic() < deadline:
            time.sleep(0.2)
            out += capsys.readouterr().out
        assert re.findall(r"Worker PID: (\d+)", out) == [str(witness)]
    finally:
        wg.shutdown()


def test_dp1_names_the_lost_shard(ray_session):
    wg = start(RankMesh(tp=2), "keep")
    try:
        exit_on_next_call(wg, 1, "world_sum")
        with pytest.raises(WorkerDiedError):
            wg.world_sum([1.0, 2.0])
        # Shrinking cannot help either: no dp replica would be left (refused before anything is touched).
        with pytest.raises(ShardLostError, match=r"no dp replica is left.*dp = 1.*rank 1 \(tp1\).*checkpoint"):
            wg.shrink_dead_replicas(timeout_s=60)
        with pytest.raises(ShardLostError, match=r"shard of rank 1 \(tp1\) \(dp = 1\).*checkpoint") as info:
            wg.replace_dead_ranks(timeout_s=60)
        assert {r: c.to_dict() for r, c in info.value.shards.items()} == {1: {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 0}}
        with pytest.raises(Exception, match="failed earlier"):
            wg.whoami()
    finally:
        wg.shutdown()


def test_default_policy_still_stops_the_group(ray_session):
    wg = start(RankMesh(dp=2), "fail")
    try:
        assert wg.on_rank_death == "fail"
        exit_on_next_call(wg, 0, "world_sum")
        with pytest.raises(WorkerDiedError):
            wg.world_sum([1.0, 2.0])
        with pytest.raises(WorkerDiedError, match="processes were stopped"):
            wg.whoami()
        with pytest.raises(RecoveryError, match="on_rank_death='fail'"):
            wg.replace_dead_ranks()
    finally:
        wg.shutdown()


def wait_for_warm_spare(wg: RayWorkerGroup, exclude: set[int], timeout: float = 90.0) -> SpareStatus:
    """The group's one spare once warm, whose pid is none of ``exclude`` (a refill is a new process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spares = wg.spares
        assert len(spares) <= 1, spares
        if spares and spares[0].warm and spares[0].pid not in exclude:
            return spares[0]
        time.sleep(0.2)
    raise AssertionError(f"no warm spare within {timeout} s: {wg.spares}")


def test_a_warm_spare_takes_the_dead_ranks_place_and_is_refilled(ray_session):
    wg = RayWorkerGroup(
        RayResourcePool([2], use_gpu=False, spares=1),
        RayClassWithInitArgs(StateWorker, scale=2),
        mesh=RankMesh(dp=2),
        worker_env={"EXTRA": "kept"},
        on_rank_death="replace",
        call_timeout_s=120,
    )
    gone: list[int] = []
    try:
        pids = [a["pid"] for a in wg.whoami()]
        spare = wait_for_warm_spare(wg, set(pids))
        # Printed with the node's address and a short id, the record itself exact (issue 45 item 14).
        assert repr(wg.spares) == f"[SpareStatus(node {spare.node_ip} {spare.node_id[:8]}: warm, pid {spare.pid})]"
        assert len(spare.node_id) == 56
        for victim, values in ((1, [1.0, 2.0]), (0, [3.0, 4.0])):
            exit_on_next_call(wg, victim, "world_sum")
            assert wg.world_sum(values) == [2 * sum(values)] * 2  # the retried call, as undisturbed
            report = wg.replacements[-1]
            assert report.ranks == [victim] and report.from_spares == [victim]
            after = wg.whoami()
            # The spare's process took the rank: same pid, the rank's environment and coordinates.
            assert after[victim]["pid"] == spare.pid == report.new_pids[victim]
            assert after[victim]["env"] == {"RANK": str(victim), "WORLD_SIZE": "2", "LOCAL_RANK": str(victim),
                                            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "EXTRA": "kept"}
            assert after[victim]["coords"] == {"tp": 0, "cp": 0, "ep": 0, "dp": victim, "pp": 0}
            assert after[1 - victim]["pid"] == pids[1 - victim]  # the survivor kept its process
            gone.append(pids[victim])
            pids = [a["pid"] for a in after]
            # The dead rank's bundle gets a new spare, in the background: a third process.
            spare = wait_for_warm_spare(wg, set(pids) | set(gone))
    finally:
        wg.shutdown()
    # Shutting the group down stops its spare too.
    deadline = time.monotonic() + 30
    while psutil.pid_exists(spare.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(spare.pid)


def test_spares_are_refused_where_they_cannot_work(ray_session):
    with pytest.raises(ResourcePoolError, match="spares must be a non-negative integer"):
        RayResourcePool([2], use_gpu=False, spares=-1)
    with pytest.raises(BackendError, match="detached group keeps no spares"):
        RayWorkerGroup(RayResourcePool([2], use_gpu=False, detached=True, spares=1), RayClassWithInitArgs(StateWorker),
                       detached=True)
    # A split view of a pool carries none: the standby bundles stay with the pool.
    pool = RayResourcePool([2], use_gpu=False, spares=1)
    assert [v.spares for v in split_resource_pool(pool, 1)] == [0, 0]
    assert pool.reserved_cpus == 3


def test_a_rank_tries_spares_away_from_its_shards_copies_then_on_its_own_node_then_warm_ones():
    def spare(node: str, started: float) -> Spare:
        warm = Pending(f"ref-{node}-{started}", -1, "warm (a spare)")  # a stand-in handle: only its identity matters here
        return Spare(Slot(pg=None, entry=-1, bundle_index=0, node_id=node, node_ip="127.0.0.1"), None, warm, started)

    far_warm, near_cold, near_warm, far_old = spare("b", 2.0), spare("a", 1.0), spare("a", 3.0), spare("b", 0.5)
    warm = {far_warm.warm.handle, near_warm.warm.handle}
    # By hand: node "a" first (warm before cold), then node "b" (warm before cold).
    assert spare_order([far_warm, near_cold, near_warm, far_old], "a", warm) == [near_warm, near_cold, far_warm, far_old]
    assert spare_order([far_warm, near_cold, near_warm, far_old], "c", set()) == [far_old, near_cold, far_warm, near_warm]
    # A node that holds a live copy of the rank's shard comes last, its own node included: node "b"
    # first (warm before cold), then "a".
    assert spare_order([far_warm, near_cold, near_warm, far_old], "a", warm, avoid={"a"}) == [
        far_warm, far_old, near_warm, near_cold]


def test_a_grow_places_whole_replicas_then_what_spares_and_free_bundles_left_of_one():
    """Hand-derived.  Before, a grow whose spares had begun a replica failed ("process(es) short,
    not whole replicas"): one warm spare and grow(1) on tp2 left one process to place."""
    assert new_groups(0, 4) == [] and new_groups(-1, 4) == []  # spares and free bundles covered it all
    assert new_groups(8, 4) == [4, 4]  # two whole replicas, each packed on one node
    assert new_groups(1, 2) == [1]  # one spare began the replica of 2: its other rank
    assert new_groups(7, 4) == [4, 3]  # one whole replica, then the 3 ranks one spare left of the next


def test_spares_and_replacements_print_short_node_ids_and_rounded_seconds():
    # Issue 45 item 14: ``wg.spares`` and ``wg.replacements`` printed 56-hex node ids and 17-digit seconds.
    node_id = "3f2a9c1b" + "0" * 48  # a Ray node id: 56 hex digits
    warm = SpareStatus(node_id, "10.0.0.2", warm=True, pid=4242)
    assert repr(warm) == str(warm) == "SpareStatus(node 10.0.0.2 3f2a9c1b: warm, pid 4242)"
    assert repr([SpareStatus(node_id, "10.0.0.2")]) == "[SpareStatus(node 10.0.0.2 3f2a9c1b: starting)]"
    assert repr(SpareStatus(node_id, "10.0.0.2", error="RayActorError: gone")) == \
        "SpareStatus(node 10.0.0.2 3f2a9c1b: failed: RayActorError: gone)"
    assert (warm.node_id, warm.node_ip, warm.warm, warm.pid, warm.error) == (node_id, "10.0.0.2", True, 4242, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        warm.pid = 1  # type: ignore[misc]

    # tp2·dp2 by hand: rank = tp + 2 * dp, so rank 1 is tp1 dp0 and its live dp peer is rank 3.
    report = ReplacementReport([1], {1: 3}, {1: RankMesh(tp=2, dp=2).rank_coords(1)}, old_nodes={1: "10.0.0.1"},
                               new_nodes={1: "10.0.0.2"}, moved={1: True}, new_pids={1: 42}, detected_s=0.25,
                               drain_s=0.123456789012345, start_s=1 / 3, import_s=0.5, init_s=0.25, restore_s=0.0049,
                               check_s=0.01, total_s=1.2222222222222223)
    text = ("replaced ranks [1] (rank 1 (tp1 dp0): 10.0.0.1 -> 10.0.0.2 (another node) (pid 42, restored from rank 3)): "
            "detected in 0.25s; replaced in 1.22s = drain 0.12 + process start 0.33 + import 0.50 + init 0.25 + "
            "restore 0.00 + check 0.01")
    assert str(report) == text and repr([report]) == f"[ReplacementReport({text})]"
    assert (report.drain_s, report.start_s, report.total_s) == (0.123456789012345, 1 / 3, 1.2222222222222223)
    # A shrink of pp2·dp2 that lost dp replica 1 (ranks 1 and 3, rank = dp + 2 * pp) reads the same way in wg.remeshes.
    shrink = RemeshReport("shrink", RankMesh(pp=2, dp=2), RankMesh(pp=2), lost_replicas=[1], dead=[1], detected_s=0.5,
                          drain_s=0.111111111, reform_s=2 / 3, check_s=0.01, total_s=0.7878787878)
    text = ("shrink RankMesh(tp=1, cp=1, dp=2, pp=2, order='tp-cp-ep-dp-pp') -> RankMesh(tp=1, cp=1, dp=1, pp=2, "
            "order='tp-cp-ep-dp-pp'): dropped dp replicas [1] (dead ranks [1]); detected in 0.50s; done in 0.79s = "
            "drain 0.11 + re-form 0.67 + re-check 0.01")
    assert str(shrink) == text and repr([shrink]) == f"[RemeshReport({text})]"


def test_shrink_drops_the_dead_ranks_replica_and_grow_adds_one_back(ray_session, caplog):
    # pp2·dp2 by hand (order tp-cp-ep-dp-pp): rank = dp + 2 * pp, so ranks 0..3 are
    # (dp0 pp0), (dp1 pp0), (dp0 pp1), (dp1 pp1).  Each rank's state is its shard's: 10 * pp + k.
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(StateWorker, scale=3),
                        mesh=RankMesh(pp=2, dp=2), on_rank_death="shrink", call_timeout_s=120)
    try:
        pp_of = {0: 0, 1: 0, 2: 1, 3: 1}
        wg.set_state([[10.0 * pp_of[r] + k for k in (1, 2, 3)] for r in range(4)])
        wg.bump()
        wg.weight_version = 7
        pids = [a["pid"] for a in wg.whoami()]
        exit_on_next_call(wg, 3, "world_sum")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="rankmesh"):
            # Replica 1 (ranks 1, 3) is dropped; on pp2·dp1 the kept ranks 0, 2 are ranks 0, 1, and the
            # retried call (the caller's unchanged list) sums values[0] and values[1]: 3 * (1 + 2).
            assert wg.world_sum([1.0, 2.0, 3.0, 4.0]) == [9.0, 9.0]
        loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("rankmesh")]
        assert len(loud) == 1 and "dropped dp replicas [1] (dead ranks [3])" in loud[0], loud
        report = wg.remeshes[-1]
        assert (report.kind, report.lost_replicas, report.dead) == ("shrink", [1], [3]) and report.detected_s is not None
        assert wg.mesh == RankMesh(pp=2, dp=1) and wg.world_size == 2 and wg.weight_versions == (7,)
        after = wg.whoami()
        assert [a["pid"] for a in after] == [pids[0], pids[2]] and [a["counter"] for a in after] == [1, 1]
        assert [a["coords"]["pp"] for a in after] == [0, 1] and [a["dist_world"] for a in after] == [2, 2]
        assert [(a["env"]["RANK"], a["env"]["WORLD_SIZE"]) for a in after] == [("0", "2"), ("1", "2")]
        # The lost replica's live rank 1 was stopped: its process is gone.
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not psutil.pid_exists(pids[1])

        grown = wg.grow(1)
        # dp2 again: kept ranks 0, 1 (pp0, pp1) go back to ranks 0, 2; the new replica is ranks 1, 3,
        # restored from the live rank of its shard.
        assert grown.added == [1, 3] and grown.peers == {1: 0, 3: 2}
        assert wg.mesh == RankMesh(pp=2, dp=2) and wg.weight_versions == (7, 7)
        now = wg.whoami()
        assert [now[0]["pid"], now[2]["pid"]] == [pids[0], pids[2]] and {now[1]["pid"], now[3]["pid"]}.isdisjoint(pids)
        assert [a["counter"] for a in now] == [1, 0, 1, 0]  # survivors' objects kept; new ones built
        assert wg.get_state() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [11.0, 12.0, 13.0], [11.0, 12.0, 13.0]]
        assert wg.world_sum([1.0, 2.0, 3.0, 4.0]) == [30.0] * 4  # the grown world reduces: 3 * 10
        assert [r.kind for r in wg.remeshes] == ["shrink", "grow"]
    finally:
        wg.shutdown()


def test_after_a_shrink_the_global_batch_is_split_over_the_replicas_left(ray_session):
    wg = RayWorkerGroup(RayResourcePool([3], use_gpu=False), RayClassWithInitArgs(StateWorker), mesh=RankMesh(dp=3),
                        on_rank_death="shrink", call_timeout_s=120)
    try:
        exit_on_next_call(wg, 1, "tag_rows")
        three = DataProto.from_dict({"x": torch.arange(3.0)})
        # 3 rows cannot be split over the 2 replicas left: the retried call says so, and why.
        with pytest.raises(RecoveryError, match=r"shrank to .*dp=2.*replicas \[1\].*does not divide over the 2 replicas"):
            wg.tag_rows(three)
        assert wg.mesh == RankMesh(dp=2) and torch.equal(three.batch["x"], torch.arange(3.0))  # the caller's batch untouched
        out = wg.tag_rows(DataProto.from_dict({"x": torch.arange(4.0)}))
        # Every row once, in order, 2 per replica: nothing lost with the dead replica.
        assert out.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and out.batch["rank"].tolist() == [0, 0, 1, 1]
        # A death in a non-blocking call fails its future; the next call shrinks first (dp 2 -> 1), then runs.
        exit_on_next_call(wg, 1, "tag_rows_later")
        with pytest.raises(WorkerDiedError):
            wg.tag_rows_later(DataProto.from_dict({"x": torch.arange(4.0)})).get()
        out = wg.tag_rows(DataProto.from_dict({"x": torch.arange(4.0)}))
        assert out.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and out.batch["rank"].tolist() == [0] * 4
        assert wg.mesh == RankMesh(dp=1) and [r.lost_replicas for r in wg.remeshes] == [[1], [1]]
    finally:
        wg.shutdown()
