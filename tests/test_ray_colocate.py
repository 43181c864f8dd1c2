"""Colocated roles: several worker classes in the same processes, spawned and fused groups."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

import torch  # noqa: E402

from rankmesh.backends.ray import (  # noqa: E402
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
)
from rankmesh.data import DataProto  # noqa: E402
from rankmesh.dispatch import Dispatch, register  # noqa: E402
from rankmesh.errors import BackendError, WorkerError  # noqa: E402
from rankmesh.mesh import RankMesh  # noqa: E402
from rankmesh.worker import Worker  # noqa: E402

#: Set by the actor role, read by the critic role: proof that both live in one process.
_PROCESS_NOTE: dict[str, int] = {}


class ActorRole(Worker):
    def __init__(self, lr: float = 0.0) -> None:
        self.lr = lr

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"role": self.context.role, "rank": self.rank, "pid": os.getpid(), "mesh": self.mesh, "lr": self.lr}

    @register(Dispatch.ONE_TO_ALL)
    def compute(self, x: int) -> str:
        return f"actor:{x}"

    @register(Dispatch.ONE_TO_ALL)
    def leave_note(self, value: int) -> None:
        _PROCESS_NOTE["note"] = value + self.rank

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"x": data.batch["x"] * 2})

    def plain(self, v: int) -> tuple[str, int]:
        return ("actor", v + self.rank)


class CriticRole(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"role": self.context.role, "rank": self.rank, "pid": os.getpid(), "mesh": self.mesh}

    @register(Dispatch.ONE_TO_ALL)
    def compute(self, x: int) -> str:
        return f"critic:{x}"

    @register(Dispatch.ONE_TO_ALL)
    def read_note(self) -> int | None:
        return _PROCESS_NOTE.get("note")

    @register(Dispatch.ONE_TO_ALL)
    def fail(self) -> None:
        raise ValueError("critic failed")


MESH = RankMesh(tp=2, dp=2)


@pytest.fixture(scope="module")
def fused(ray_session):
    colocated = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(ActorRole, lr=0.5), "critic": RayClassWithInitArgs(CriticRole)}
    )
    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), colocated, mesh=MESH)
    yield wg
    wg.shutdown()


def test_fused_group_has_prefixed_methods(fused):
    assert {"actor_whoami", "critic_whoami", "actor_compute", "critic_compute"} <= set(fused.method_names)
    # Unnamed, a colocated group is named by its roles; each role group by its role (traces, reports).
    assert fused.name_prefix == "actor+critic" and fused.trace_name == "actor+critic"
    assert fused.startup_report().format().splitlines()[0].startswith("start-up of actor+critic")
    actor, critic = fused.actor_whoami(), fused.critic_whoami()
    assert [a["role"] for a in actor] == ["actor"] * 4 and [c["role"] for c in critic] == ["critic"] * 4
    assert [a["pid"] for a in actor] == [c["pid"] for c in critic]  # same processes
    assert fused.critic_compute(3) == ["critic:3"] * 4


def test_spawned_roles_share_processes_and_mesh(fused):
    roles = fused.spawn(prefix_set={"actor", "critic"})
    assert set(roles) == {"actor", "critic"}
    actor, critic = roles["actor"], roles["critic"]
    a, c = actor.whoami(), critic.whoami()
    assert [x["pid"] for x in a] == [x["pid"] for x in c]
    assert {x["mesh"] for x in a} == {x["mesh"] for x in c} == {MESH}
    assert [x["lr"] for x in a] == [0.5] * 4
    # Same method name, routed to each role's own object.
    assert actor.compute(1) == ["actor:1"] * 4 and critic.compute(2) == ["critic:2"] * 4
    # One process: module state written by one role is visible to the other.
    actor.leave_note(100)
    assert critic.read_note() == [100, 101, 102, 103]
    # Dispatch modes and execute_all work per role.
    batch = DataProto.from_dict({"x": torch.arange(4)})
    assert actor.double(batch).batch["x"].tolist() == [0, 2, 4, 6]
    assert actor.execute_all("plain", 10) == [("actor", 10 + r) for r in range(4)]
    assert actor.workers == critic.workers == fused.workers


def test_spawned_roles_are_built_with_their_parents_startup_and_recovery(fused):
    # One constructor path: a role group gets every attribute the parent has, from arguments,
    # and shares the parent's start-up record and recovery state.
    from rankmesh.group import GroupMethod

    def attributes(group):  # a group's state, without its bound methods and fused role groups
        return {k for k, v in vars(group).items() if not isinstance(v, (GroupMethod, RayWorkerGroup))}

    roles = fused.spawn(["actor", "critic"])
    report = fused.startup_report()
    assert report is not None and report.ranks and all(report.ranks)
    for group in roles.values():
        assert attributes(group) == attributes(fused)
        assert group.startup_report() is report
        assert group.on_rank_death == fused.on_rank_death == "fail"
        assert group.replacements == fused.replacements == []
        assert group.executor is fused.executor


def test_role_errors_and_unknown_roles(fused):
    critic = fused.spawn(["critic"])["critic"]
    with pytest.raises(WorkerError, match="CriticRole.fail.*critic failed"):
        critic.fail()
    with pytest.raises(BackendError, match="no colocated role"):
        fused.spawn(["reward"])


def test_fuse_sets_role_attributes(fused):
    groups = fused.fuse(["actor", "critic"])
    assert fused.actor is groups["actor"] and fused.critic.compute(5) == ["critic:5"] * 4


def test_shutting_down_one_role_stops_the_shared_processes(ray_session):
    colocated = create_colocated_worker_cls({"actor": ActorRole, "critic": CriticRole})
    wg = RayWorkerGroup(RayResourcePool([2], use_gpu=False), colocated)
    roles = wg.spawn(["actor", "critic"])
    assert roles["actor"].compute(0) == ["actor:0"] * 2
    roles["critic"].shutdown()
    assert wg.closed and roles["actor"].closed
    with pytest.raises(BackendError, match="shut down"):
        roles["actor"].compute(0)
