"""The backend-neutral dispatch matrix on RayWorkerGroup, plus the Ray transport's own promises.

Actors are processes, and starting one costs 2-3 s of CPU here (``import torch``/``tensordict``),
so this module reuses processes: :class:`HostCache` keeps one group per world size and, when a
test asks for a different worker class or mesh of that size, gives its processes back to the
session's host bank (``tests/hosts.py``) and builds the new group in running processes
(``RayWorkerGroup.on_hosts``).  Starting groups from scratch is covered by
``test_ray_group.py``.  The matrix drains worker logs before use, so reusing a group across tests
is safe; ``conftest.py`` orders this module's tests by mesh so that rebuilds stay rare.  Meshes above :data:`MAX_RAY_RANKS` ranks run on the
in-process backend only (``test_dispatch_local.py``).
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rankmesh.backends.ray import RayClassWithInitArgs, RayWorkerGroup  # noqa: E402
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402
from tests.dispatch_matrix import *  # noqa: E402,F401,F403  (the backend-neutral suite)
from tests.hosts import HostBank  # noqa: E402

MAX_RAY_RANKS = 8


class HostCache:
    """One group per world size, on processes from the session's :class:`tests.hosts.HostBank`.

    ``key_extra``: whatever else the group depends on (e.g. the control path read from the
    environment when the group is built); a group is reused only for the same key.
    """

    def __init__(self, bank: HostBank) -> None:
        self.bank = bank
        self.groups: dict[int, tuple[tuple, RayWorkerGroup]] = {}

    def get(self, worker_cls, mesh, meshes=None, init_args=(), init_kwargs=None, key_extra=()) -> RayWorkerGroup:
        key = (
            worker_cls,
            mesh,
            tuple(sorted((meshes or {}).items())),
            tuple(init_args),
            tuple(sorted((init_kwargs or {}).items())),
            key_extra,
        )
        world = mesh.world_size
        held = self.groups.pop(world, None)
        if held is not None:
            if held[0] == key:
                self.groups[world] = held
                return held[1]
            self.bank.give_back(held[1])
        init = RayClassWithInitArgs(worker_cls, *init_args, **(init_kwargs or {}))
        group = self.bank.build(init, mesh, meshes)
        self.groups[world] = (key, group)
        return group

    def close(self) -> None:
        for _, group in self.groups.values():
            self.bank.give_back(group)
        self.groups.clear()


@pytest.fixture(scope="module")
def group_cache(host_bank):
    cache = HostCache(host_bank)
    yield cache
    cache.close()


@pytest.fixture
def group_factory(group_cache):
    def make(worker_cls, mesh=None, *, meshes=None, init_args=(), init_kwargs=None):
        mesh = mesh if mesh is not None else RankMesh(dp=1)
        if mesh.world_size > MAX_RAY_RANKS:
            pytest.skip(f"{mesh.world_size}-rank meshes run on the in-process backend only (actors cost a process each)")
        group = group_cache.get(worker_cls, mesh, meshes, init_args, init_kwargs)
        # The matrix runs on the default carrier: the group's call session must be open and take its calls.
        assert [info["control"] for info in group.transport_info()] == ["session"] * mesh.world_size
        return group

    return make


# ----- transport: puts, collect-only fetches, private copies -----------------------------------


class Holder(Worker):
    """Keeps what it received so tests can mutate it in one rank and look at it in another."""

    def __init__(self) -> None:
        self.kept = None

    @register(Dispatch.ONE_TO_ALL)
    def keep(self, data: DataProto) -> dict:
        self.kept = data
        x = data.batch["x"]
        return {"writable": bool(x.numpy().flags.writeable), "first": float(x[0, 0])}

    @register(Dispatch.RANK_ZERO)
    def bump(self, value: float) -> float:
        self.kept.batch["x"][0, 0] = value
        return float(self.kept.batch["x"][0, 0])

    @register(Dispatch.ONE_TO_ALL)
    def first(self) -> float:
        return float(self.kept.batch["x"][0, 0])

    @register(Dispatch.ONE_TO_ALL)
    def kept_range(self) -> tuple[float, float]:
        x = self.kept.batch["x"]
        return float(x.min()), float(x.max())

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.ONE_TO_ALL)
    def big_output(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes // 4)


@pytest.fixture
def holder_group(group_cache):
    return group_cache.get(Holder, RankMesh(tp=2, dp=2))


def big_batch(mib: int = 64) -> DataProto:
    rows = 256
    x = torch.zeros(rows, mib * 1024 * 1024 // 4 // rows)
    return DataProto.from_dict({"x": x}, {"id": np.arange(rows)})


def test_one_copy_for_a_piece_shared_by_four_ranks(holder_group, monkeypatch):
    """A 64 MiB piece read by four ranks on the caller's node is written once, into one memory
    file all four map (no put), and each rank gets a private writable view of it."""
    from rankmesh.backends.ray.files import Mapped

    ex = holder_group.executor
    seen = []
    submit = ex.submit

    def spy(role, method, calls, deadline=None):
        seen.extend(calls.rank_calls())  # a GroupCall: the shares, and which rank runs which
        return submit(role, method, calls, deadline)

    monkeypatch.setattr(ex, "submit", spy)
    batch = big_batch(64)
    puts, maps = ex.stats.puts, ex.stats.maps
    out = holder_group.keep(batch)
    assert (ex.stats.puts - puts, ex.stats.maps - maps) == (0, 1)  # one file of 64 MiB ...
    files = {id(call.args[0]) for call in seen}
    assert len(seen) == 4 and len(files) == 1 and isinstance(seen[0].args[0], Mapped)  # ... read by four ranks
    assert all(o["writable"] for o in out)  # every rank got a writable view ...
    # ... of its own: a write in rank 0 stays there (the batch is all zeros).  Forked ranks share their
    # parent's address layout, so the views' addresses, alike in all four, say nothing of this.
    assert holder_group.bump(-1.0) == -1.0 and holder_group.first() == [-1.0, 0.0, 0.0, 0.0]


def test_a_rank_that_keeps_its_input_keeps_its_bytes_through_later_large_calls(holder_group):
    """A rank that keeps its input keeps its bytes, however many large calls follow.  On one node
    a large argument travels in a memory file that is written again only once every rank it was
    sent to let its views go; a kept batch never does, so its file is never reused.  Expected by
    hand: the kept batch is all 3.0 on every rank, each later batch all 5.0 (its echo too)."""
    kept = big_batch(8)
    kept.batch["x"].fill_(3.0)
    holder_group.keep(kept)
    later = big_batch(8)
    later.batch["x"].fill_(5.0)
    for _ in range(4):
        out = holder_group.echo(later)
        assert (float(out.batch["x"].min()), float(out.batch["x"].max())) == (5.0, 5.0)
    assert holder_group.kept_range() == [(3.0, 3.0)] * 4


def test_in_place_change_in_one_rank_stays_there(holder_group):
    holder_group.keep(big_batch(8))
    assert holder_group.bump(7.0) == 7.0
    assert holder_group.first() == [7.0, 0.0, 0.0, 0.0]


def test_only_collect_ranks_send_outputs(holder_group):
    # tp2 x dp2: collect ranks are tp==0 -> 0 and 2; ranks 1 and 3 run but return nothing.
    from rankmesh.backend import RankCall

    ex = holder_group.executor
    calls = [RankCall(r, (1 << 20,), return_output=r in (0, 2)) for r in range(4)]
    out = ex.fetch(ex.submit(None, "big_output", calls))
    assert [o is None for o in out] == [False, True, False, True]
    batch = big_batch(1)
    echoed = holder_group.echo(batch)
    assert torch.equal(echoed.batch["x"], batch.batch["x"])


class _Recorder:
    """An actor handle that records which of its methods the executor submits to."""

    def __init__(self, actor, log):
        self._actor, self._log = actor, log

    def __getattr__(self, name):
        self._log.append(name)
        return getattr(self._actor, name)


def test_repeated_calls_run_without_a_header_argument(holder_group, monkeypatch):
    """The Ray path's call slots (``RANKMESH_CONTROL=ray``; a call session would carry the plain calls)."""
    ex = holder_group.executor
    holder_group.set_control("ray")
    try:
        _slots_on_the_ray_path(holder_group, ex, monkeypatch)
    finally:
        holder_group.set_control("auto")


def _slots_on_the_ray_path(holder_group, ex, monkeypatch) -> None:
    log: list[str] = []
    # New handles are new processes to the header cache: each rank gets the header installed again.
    monkeypatch.setattr(ex.hosts, "actors", [_Recorder(a, log) for a in ex.hosts.actors])
    holder_group.keep(big_batch(1))
    assert log == ["execute_install"] * 4  # the first call carries the header and installs it
    log.clear()
    assert holder_group.bump(3.0) == 3.0  # a plain argument: its header travels with every call
    assert holder_group.first() == [3.0, 0.0, 0.0, 0.0]
    assert log == ["execute"] + ["execute_install"] * 4
    log.clear()
    assert holder_group.bump(4.0) == 4.0
    assert holder_group.first() == [4.0, 0.0, 0.0, 0.0]
    out = holder_group.keep(big_batch(1))
    assert len(out) == 4 and all(o["first"] == 0.0 for o in out)
    assert log[0] == "execute" and len(log) == 9
    # No header argument; a call without shared values runs a method without parameters
    # (first(): bare_<k>), a call with a shared batch passes only its reference (keep: call_<k>).
    assert [name.split("_")[0] for name in log[1:]] == ["bare"] * 4 + ["call"] * 4
    slot = int(log[-1].split("_")[1])
    assert ex.hosts.headers.installed(slot, 3, ex.hosts.actors[3])


def test_a_slot_never_installed_is_refused(holder_group):
    actor = holder_group.executor.hosts.actors[0]
    with pytest.raises(Exception, match="call slot 127 was never installed"):
        ray.get(actor.call_127.remote())
    with pytest.raises(Exception, match="call slot 126 was never installed"):
        ray.get(actor.bare_126.remote())


def test_a_group_rebuilt_in_used_processes_keeps_each_ranks_call_order(host_bank):
    """A group in processes an earlier group used keeps each rank's order: a session call waits for
    the Ray calls sent before it (fenced by the controller), whatever those processes ran before."""
    from tests.replica_workers import ReplicaWorker

    init = RayClassWithInitArgs(ReplicaWorker, delays={})
    wg = host_bank.build(init, RankMesh(tp=2, dp=2))
    for actor in wg.executor.hosts.actors:  # run by every process, counted by no controller
        with pytest.raises(Exception, match="call slot 127 was never installed"):
            ray.get(actor.call_127.remote())
    host_bank.give_back(wg)
    wg = host_bank.build(init, RankMesh(tp=2, dp=2))
    try:
        nap = wg.replica(0).nap(0.5, "replica-0-nap")  # a Ray call on ranks 0 and 1 ...
        logs = wg.record("whole-group")  # ... then a session call on every rank: after the nap there
        assert [log[-2:] for log in logs[:2]] == [["replica-0-nap", "whole-group"]] * 2
        assert [rank for rank, _, _ in nap.get()] == [0, 1]
    finally:
        host_bank.give_back(wg)


def test_fetch_timeout_names_the_slow_ranks(ray_session):
    from rankmesh.backends.ray.calls import Pending
    from rankmesh.backends.ray.waiting import fetch_outputs
    from rankmesh.errors import FetchTimeoutError

    sleepy = ray.remote(num_cpus=0)(lambda: __import__("time").sleep(2))
    ref = sleepy.remote()
    with pytest.raises(FetchTimeoutError, match=r"ranks \[5\] did not finish"):
        fetch_outputs([Pending(ref, 5, "sleepy")], timeout=0.3)
    ray.cancel(ref, force=True)
