"""Replica views and rankmesh.wait on Ray: disjoint replicas run at once, one rank runs its calls in order.

One tp2·dp2 group (4 processes): replica 0 is ranks 0, 1 and replica 1 is ranks 2, 3 (megatron's
order tp-cp-ep-dp-pp); the collect ranks are 0 and 2.  Replica 1 generates 1.5 s slower, which
is what a long-tailed decode looks like to the controller.  Times are each rank's own
``time.monotonic()`` (one machine, one clock), so overlap is read from the ranks, not inferred.
"""

from __future__ import annotations

import time

import pytest
import torch

import rankmesh
from rankmesh import DataProto, RankMesh, RowBuffer
from rankmesh.errors import HangError, WorkerError
from tests.replica_workers import ReplicaWorker

pytest.importorskip("ray")

SLOW_S = 1.5


@pytest.fixture(scope="module")
def wg(host_bank):
    from rankmesh.backends.ray import RayClassWithInitArgs

    group = host_bank.build(RayClassWithInitArgs(ReplicaWorker, delays={1: SLOW_S}), RankMesh(tp=2, dp=2))
    # The first DataProto a process receives imports tensordict (seconds): pay that here, not in a timing.
    group.per_rank_rows(DataProto.from_dict({"x": torch.arange(4, dtype=torch.float32)}))
    yield group
    host_bank.give_back(group)


def test_calls_on_disjoint_replicas_run_at_the_same_time(wg):
    start = time.monotonic()
    first, second = wg.replica(0).nap(1.0, "a"), wg.replica(1).nap(1.0, "b")
    spans = first.get() + second.get()
    elapsed = time.monotonic() - start
    assert [rank for rank, _, _ in spans] == [0, 1, 2, 3]
    assert max(s for _, s, _ in spans) < min(e for _, _, e in spans)  # every rank napped while every other did
    assert elapsed < 1.8, f"two 1 s calls on disjoint replicas took {elapsed:.2f} s"


def test_a_rank_runs_its_calls_in_submission_order_and_a_group_call_waits_for_replica_calls(wg):
    nap = wg.replica(0).nap(0.5, "replica-0-nap")
    start = time.monotonic()
    logs = wg.record("whole-group")  # submitted after the nap: on ranks 0 and 1 it runs after it
    waited = time.monotonic() - start
    assert [log[-2:] for log in logs[:2]] == [["replica-0-nap", "whole-group"]] * 2
    assert all("replica-0-nap" not in log and log[-1] == "whole-group" for log in logs[2:])
    assert waited >= 0.4, f"the whole-group call returned after {waited:.2f} s, before the replica call on its ranks ended"
    assert [rank for rank, _, _ in nap.get()] == [0, 1]


def test_the_first_replicas_rows_are_taken_without_waiting_for_the_slowest(wg):
    batch = DataProto.from_dict({"x": torch.arange(4, dtype=torch.float32)})
    start = time.monotonic()
    parts = wg.generate_later(batch).part_futures()
    done, pending = rankmesh.wait(parts, num_returns=1, timeout=30)
    fast = time.monotonic() - start
    assert done == [parts[0]] and pending == [parts[1]]
    assert fast < SLOW_S - 0.3, f"the fast replica's rows came after {fast:.2f} s"
    rows = done[0].get()
    assert rows.batch["rank"].tolist() == [0, 0] and rows.batch["x"].tolist() == [0.0, 1.0]

    buffer = RowBuffer(capacity_rows=8)
    buffer.put(done[0], version=3)  # a reference: nothing fetched
    done, pending = rankmesh.wait(pending, timeout=30)
    assert time.monotonic() - start >= SLOW_S and pending == []
    buffer.put(done[0], version=4)
    taken = buffer.take(4, min_version=3)
    assert taken.versions == (3, 3, 4, 4)
    got = taken.data.get()
    assert got.batch["rank"].tolist() == [0, 0, 2, 2] and got.batch["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_wait_with_a_timeout_returns_what_is_done_so_far(wg):
    parts = wg.generate_later(DataProto.from_dict({"x": torch.arange(2, dtype=torch.float32)})).part_futures()
    start = time.monotonic()
    done, pending = rankmesh.wait(parts, num_returns=2, timeout=0.5)
    assert 0.4 <= time.monotonic() - start < SLOW_S
    assert done == [parts[0]] and pending == [parts[1]]
    assert rankmesh.wait(pending, timeout=30)[0] == pending


def test_an_error_on_a_replica_call_names_the_rank_and_its_replica(wg):
    with pytest.raises(WorkerError, match=r"rank 2 \(tp0 dp1\)") as info:
        wg.replica(1).fail_on(1)
    assert "replica 1 refuses" in str(info.value)
    assert [rank for rank, _, _ in wg.where()] == [0, 1, 2, 3]  # a worker's exception leaves the group usable


def test_a_replica_call_past_its_timeout_is_reported_on_the_replicas_ranks(wg):
    start = time.monotonic()
    with pytest.raises(HangError) as info:
        wg.replica(1).with_timeout(0.5).linger(1.5)
    err = info.value
    assert err.ranks == [2, 3] and sorted(h.rank for h in err.hangs) == [2, 3]  # the group's numbering
    assert {h.coords["dp"] for h in err.hangs} == {1} and all(h.place.function == "linger" for h in err.hangs)
    assert "ranks 2, 3 (tp0 dp1, tp1 dp1) on node 127.0.0.1: in linger" in str(err)
    assert [rank for rank, _, _ in wg.where()] == [0, 1, 2, 3]  # waits behind the sleep on replica 1, then works
    assert time.monotonic() - start < 10
