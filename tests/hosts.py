"""Process reuse across test modules: one bank of running host processes, lent group after group.

Why: a Ray worker process costs 2-3 CPU-seconds to start here (``import torch``), a megatron one
4-5; building a new group's workers in a running, torn-down process costs well under one.  The
modules that only need *some* group of N processes (not a fresh start, a kill or a placement)
borrow hosts from the session's :class:`HostBank` (``host_bank`` in ``conftest.py``) with
:meth:`HostBank.build`, and give them back with :meth:`HostBank.give_back`, which resets the
processes for the next group: it drops the workers, destroys a default process group they left,
and reserves a fresh rendezvous port (the old TCPStore may still hold the last one).

A megatron group must release parallel_state itself first (``group.destroy_megatron()``): rankmesh
counts parallel_state's users in the process, and only the workers know theirs.  Hosts that do not
come back clean within :data:`RESET_TIMEOUT_S` (a call still running) are shut down, not reused.

Ranks of a group built here run in processes that earlier groups used: a test that needs fresh
processes (start-up, placement, pids, kills) must start its own group.

The bank's processes follow the suite's process model (``RANKMESH_PROCESS_MODEL``, ``"fork"`` unless
set: ``conftest.py``): forked ranks from a warm process that has megatron-core imported, each
behind its light holder.  A test about what only a rank in its own Ray actor does (copy-on-write
receive from Ray's store) asks for ``process_model="ray"``, and gets processes of that model.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import ray

from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from rankmesh.backends.ray.forked import Forking, process_model_of
from rankmesh.backends.ray.hosts import HostSet, launch_hosts
from rankmesh.dispatch import Dispatch, register
from rankmesh.mesh import RankMesh
from rankmesh.worker import Worker

logger = logging.getLogger(__name__)

#: What the bank's warm processes import before they fork: the heaviest worker module its borrowers use.
BANK_MODULES = ("rankmesh.megatron.worker",)
#: How long giving hosts back may wait for the ranks to finish what the last group left running.
RESET_TIMEOUT_S = 20.0


class ProcessReset(Worker):
    """Built on given-back hosts to leave each process as a new one would start: no default group."""

    @register(Dispatch.ONE_TO_ALL)
    def reset(self) -> bool:
        import sys

        import torch.distributed as dist

        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            raise RuntimeError("parallel_state is still initialized: call group.destroy_megatron() before give_back")
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return True


class HostBank:
    """Running host processes by world size; each set is lent to one group at a time."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list[HostSet]] = {}  # (world size, process model) -> free sets
        self._lent: dict[int, HostSet] = {}  # id(hosts) -> hosts, for the groups built on them (and their roles)

    def build(
        self,
        init: RayClassWithInitArgs | type,
        mesh: RankMesh,
        meshes: Mapping[str, RankMesh] | None = None,
        worker_env: Mapping[str, Any] | None = None,
        process_model: str | None = None,
    ) -> RayWorkerGroup:
        """A new group of ``init``'s workers over ``mesh`` in lent processes (started if none is free)
        of ``process_model`` (``None``: the suite's, ``RANKMESH_PROCESS_MODEL``)."""
        if not isinstance(init, RayClassWithInitArgs):
            init = RayClassWithInitArgs(init)
        kind = (mesh.world_size, process_model_of(process_model))
        free = self._free.setdefault(kind, [])
        hosts = free.pop() if free else self._launch(*kind)
        try:
            group = RayWorkerGroup.on_hosts(hosts, init, mesh=mesh, meshes=meshes, worker_env=worker_env)
        except BaseException:
            hosts.shutdown()
            raise
        self._lent[id(hosts)] = hosts
        return group

    def give_back(self, group: RayWorkerGroup) -> None:
        """Reset ``group``'s processes for the next group (or shut them down if they do not reset).

        ``group`` may be one of the role groups spawned from the group :meth:`build` returned."""
        hosts = self._lent.pop(id(group.executor.hosts), None)
        if hosts is None:  # the bank was closed meanwhile: its processes are gone
            return
        try:
            group.release_hosts(RESET_TIMEOUT_S)
            reset = RayWorkerGroup.on_hosts(hosts, RayClassWithInitArgs(ProcessReset), mesh=RankMesh(dp=len(hosts.actors)))
            reset.reset()
            reset.release_hosts(RESET_TIMEOUT_S)
            hosts.master = tuple(ray.get(hosts.actors[0].reserve_master_port.remote(fresh=True), timeout=RESET_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - a process that does not reset is not reused
            logger.warning("host bank: %d processes did not reset (%s); shutting them down", len(hosts.actors), exc)
            hosts.shutdown()
            return
        model = "ray" if hosts.forking is None else "fork"
        self._free.setdefault((len(hosts.actors), model), []).append(hosts)

    def _launch(self, world: int, process_model: str) -> HostSet:
        pool = RayResourcePool([world], use_gpu=False)
        pool.acquire()
        forking = Forking(BANK_MODULES) if process_model == "fork" else None
        hosts = launch_hosts(pool, f"bank{world}{process_model}", False, {}, 300.0, forking=forking)
        hosts.pool = pool  # released by shutdown
        return hosts

    def processes(self) -> "BankProcesses":
        """This bank as the ``processes`` of code that starts one group per role (the demo, the validate script)."""
        return BankProcesses(self)

    def close(self) -> None:
        """Shut every process down, lent or free."""
        for hosts in [*self._lent.values(), *(h for sets in self._free.values() for h in sets)]:
            hosts.shutdown()
        self._lent.clear()
        self._free.clear()


class BankProcesses:
    """:class:`~rankmesh.backends.ray.group.PoolPerGroup`'s two methods over a :class:`HostBank`.

    Groups that need what only a new pool gives (several nodes, standby bundles, a recovery policy
    or other group options) are refused: the run asking for them must start its own processes.  A
    group's name is not kept (the bank's processes keep theirs).
    """

    def __init__(self, bank: HostBank) -> None:
        self.bank = bank

    def start(
        self,
        process_on_nodes: list[int],
        ray_cls_with_init: RayClassWithInitArgs,
        mesh: RankMesh,
        *,
        pool_name: str | None = None,
        spares: int = 0,
        name_prefix: str | None = None,
        process_model: str | None = None,
        **group_kwargs: Any,
    ) -> RayWorkerGroup:
        # Running processes of the suite's process model, whatever the run would start its own with:
        # lending them is what the bank is for (and sets of both models would not fit the session's CPUs).
        if len(process_on_nodes) != 1 or spares or group_kwargs:
            raise ValueError(f"the host bank builds groups of one node without spares or options, not "
                             f"{process_on_nodes} with spares={spares} and {sorted(group_kwargs)}")
        return self.bank.build(ray_cls_with_init, mesh)

    def stop(self, group: RayWorkerGroup) -> None:
        self.bank.give_back(group)
