"""MegatronWorker: a rankmesh Worker whose process groups come from megatron-core's parallel_state.

The backend gives every worker its place (``self.rank``, ``self.mesh``) and the rendezvous
variables; this class turns them into ``torch.distributed`` (gloo on CPU, nccl with CUDA) and
``parallel_state.initialize_model_parallel`` with the sizes *and order* of the group's RankMesh.
It then reads its coordinates back from parallel_state's own getters, never from the mesh, so
that :meth:`megatron_report` is an independent witness the controller can check the mesh
against (:mod:`rankmesh.megatron.check`).

When the Ray backend replaces a dead rank (:mod:`rankmesh.backends.ray.recovery`), a surviving
MegatronWorker tears parallel_state down and rebuilds it from the same mesh, re-pointing every
process group its modules captured at construction (megatron-core's tensor-parallel layers keep
``self.tp_group``); the new rank receives its modules' parameters and buffers, its optimizers'
state and the torch RNG state from its live dp peer (:meth:`MegatronWorker.restore_from_peer`).
When no live peer holds a shard, or the run moves to another mesh, :meth:`MegatronWorker.save_checkpoint`
and :meth:`MegatronWorker.load_checkpoint` write and read the weights and optimizer state in the whole model's
coordinates (:mod:`rankmesh.megatron.checkpoint`), so any mesh of the same model resumes from it.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rankmesh.data import receive
from rankmesh.devices import RankDevice, check_one_rank_per_gpu
from rankmesh.errors import RendezvousError
from rankmesh.rendezvous import init_torch_distributed
from rankmesh.dispatch.modes import Dispatch
from rankmesh.dispatch.register import register
from rankmesh.megatron import checkpoint
from rankmesh.megatron.check import RankReport
from rankmesh.mesh import DistGlobalInfo, DistRankInfo, RankMesh
from rankmesh.megatron.layouts import MegatronReshardWorker

logger = logging.getLogger(__name__)


def _group_getters() -> dict[str, Any]:
    """Report name -> parallel_state getter of this rank's group (names as in check.GROUPS)."""
    return {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "cp": ps.get_context_parallel_group,
        "dp": lambda: ps.get_data_parallel_group(with_context_parallel=False),
        "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "ep": ps.get_expert_model_parallel_group,
        "etp": ps.get_expert_tensor_parallel_group,
        "edp": ps.get_expert_data_parallel_group,
    }


def captured_groups(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, str]]:
    """(module, attribute, group name) for every process group a module holds as an attribute.

    Raises if a module holds a group parallel_state does not name: rankmesh could not re-point it
    after a replacement (rebuild it in an override of ``rejoin_distributed``).
    """
    known = {id(getter()): name for name, getter in {**_group_getters(), "mp": ps.get_model_parallel_group}.items()}
    found = []
    for module in modules:
        for sub_name, sub in module.named_modules():
            for attr, value in vars(sub).items():
                if not isinstance(value, dist.ProcessGroup):
                    continue
                if id(value) not in known:
                    raise RuntimeError(
                        f"module {type(module).__name__}.{sub_name or '<root>'} holds process group {attr!r}, which is "
                        "none of parallel_state's: it cannot be re-pointed when ranks are replaced (override "
                        "leave_distributed/rejoin_distributed to rebuild it)"
                    )
                found.append((sub, attr, known[id(value)]))
    return found


def parallel_state_coords() -> dict[str, int]:
    """This rank's coordinates, from parallel_state's getters."""
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
    }


def parallel_state_sizes() -> dict[str, int]:
    """The axis sizes parallel_state was initialized with."""
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "edp": ps.get_expert_data_parallel_world_size(),
    }


def build_report(allreduce: bool = False, order: str = "") -> RankReport:
    """What parallel_state and torch.distributed say about this rank (optionally all-reducing ids).

    With ``allreduce=True`` every group sums the members' global rank ids; a correct group gives
    the sum of the members the controller expects, so the groups are proven to *communicate*, not
    only to exist.  Every rank must call this collectively (same ``allreduce``).
    """
    rank = dist.get_rank()
    groups: dict[str, list[int]] = {}
    sums: dict[str, int] = {}
    for name, getter in _group_getters().items():
        group = getter()
        groups[name] = [int(r) for r in dist.get_process_group_ranks(group)]
    if allreduce:
        # Every group of one kind partitions the world, and each rank joins exactly one group of
        # each kind, in the same order on every rank: no deadlock.
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        for name, getter in _group_getters().items():
            value = torch.tensor([rank], dtype=torch.int64, device=device)
            dist.all_reduce(value, group=getter())
            sums[name] = int(value.item())
    return RankReport(
        rank=rank,
        world_size=dist.get_world_size(),
        coords=parallel_state_coords(),
        sizes=parallel_state_sizes(),
        groups=groups,
        allreduce=sums,
        order=order,
        hostname=socket.gethostname(),
        pid=os.getpid(),
    )


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Join the group's default process group from RANK/WORLD_SIZE/MASTER_* (no-op if joined).

    Under nccl the rank first selects its GPU, and after joining refuses, on every rank, a group
    in which two ranks share a GPU (:func:`refuse_shared_gpus`), before any nccl collective runs.
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if os.environ.get("MASTER_ADDR", "").startswith("127.") and sys.platform.startswith("linux"):
        # A loopback rendezvous means one machine: keep gloo's own sockets on loopback too
        # (gloo otherwise binds to whatever the hostname resolves to).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    index = None
    if backend == "nccl":
        # Ray usually shows each actor only its own GPU; otherwise pick by local rank.
        count = torch.cuda.device_count()
        index = 0 if count == 1 else int(os.environ.get("LOCAL_RANK", "0")) % count
        torch.cuda.set_device(index)
    init_torch_distributed(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if index is not None:
        refuse_shared_gpus(this_rank_device(index))


def this_rank_device(index: int) -> RankDevice:
    """This rank's GPU ``cuda:<index>``, named by its UUID, else its PCI bus on this node, else its visible index."""
    node = socket.gethostname()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    bus = getattr(props, "pci_bus_id", None)
    if uuid is not None:
        gpu = f"GPU-{uuid}" if not str(uuid).startswith("GPU-") else str(uuid)
    elif bus is not None:
        gpu = f"{node} pci {bus}"
    else:
        gpu = f"{node} cuda:{index} of CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
    return RankDevice(rank=dist.get_rank(), node=node, gpu=gpu, index=index)


def gather_rank_devices(mine: RankDevice) -> list[RankDevice]:
    """Every rank's :class:`RankDevice`, in rank order, over a temporary gloo group (every rank calls it).

    gloo, because the question is whether nccl can run at all: an nccl collective among ranks
    that share a GPU is the failure being prevented.
    """
    group = dist.new_group(backend="gloo")
    try:
        devices: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(devices, mine, group=group)
    finally:
        dist.destroy_process_group(group)
    return devices


def refuse_shared_gpus(mine: RankDevice) -> None:
    """Raise on every rank, leaving torch.distributed, when two ranks of the nccl group share a GPU."""
    try:
        check_one_rank_per_gpu("nccl", gather_rank_devices(mine))
    except RendezvousError:
        dist.destroy_process_group()
        raise


class _ParallelStateUsers:
    """The roles of this process that use megatron-core's parallel_state, and what built it.

    parallel_state is process-global, and colocated roles (actor + reference in one process)
    share it, so its users are counted per process too: the first builds it, the others must
    ask for the same mesh, the last one destroys it.
    """

    def __init__(self) -> None:
        self.users = 0
        self.kwargs: dict[str, Any] | None = None

    def acquire(self, kwargs: dict[str, Any]) -> None:
        if self.users:
            if self.kwargs != kwargs:
                raise RuntimeError(
                    f"colocated roles need identical meshes: parallel_state was built with {self.kwargs}, "
                    f"this role asks for {kwargs}"
                )
        else:
            if ps.model_parallel_is_initialized():  # left over by code outside rankmesh
                ps.destroy_model_parallel()
            ps.initialize_model_parallel(**kwargs)
            self.kwargs = dict(kwargs)
        self.users += 1

    def release(self) -> None:
        self.users = max(0, self.users - 1)
        if self.users:
            return
        self.kwargs = None
        _drop_parallel_state()
        if dist.is_initialized():
            dist.destroy_process_group()

    def rebuild(self, kwargs: dict[str, Any]) -> None:
        """parallel_state again, with ``kwargs``, over the same default process group.

        Only for a process with one user: a colocated role would find its parallel_state changed
        under it.
        """
        if self.users != 1:
            raise RuntimeError(
                f"parallel_state has {self.users} users in this process (colocated roles share it): it can be "
                "rebuilt for another mesh only in a process with one role"
            )
        for group in _drop_parallel_state():  # the default group stays: close the old mesh's sockets now
            dist.destroy_process_group(group)
        ps.initialize_model_parallel(**kwargs)
        self.kwargs = dict(kwargs)


def _drop_parallel_state() -> list[dist.ProcessGroup]:
    """Destroy parallel_state and drop every process group it still references; those groups
    (without the default group) are returned for the caller to destroy or let go."""
    held = {id(v): v for v in vars(ps).values() if isinstance(v, dist.ProcessGroup)}
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # megatron-core 0.16's destroy_model_parallel leaves _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
    # set (the dp-cp group itself): a group still referenced keeps its gloo sockets open, and a
    # peer blocked in a dp all-reduce with this rank stays blocked (see rankmesh.backends.ray.rejoin).
    for name, value in list(vars(ps).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(ps, name, None)
    world = dist.group.WORLD if dist.is_initialized() else None
    return [group for group in held.values() if group is not world]


#: One per process, as parallel_state is (docs/architecture.md, "Process-global state").
_PARALLEL_STATE = _ParallelStateUsers()


def acquire_parallel_state(kwargs: dict[str, Any]) -> None:
    """Initialize parallel_state with ``kwargs``, or join the identical one a colocated role built."""
    _PARALLEL_STATE.acquire(kwargs)


def release_parallel_state() -> None:
    """Drop one user; the last one destroys parallel_state and the default process group."""
    _PARALLEL_STATE.release()


class MegatronWorker(MegatronReshardWorker):
    """A worker of a Megatron-parallel group: torch.distributed + parallel_state from the mesh.

    Subclasses (actor, critic, reference) build their model after ``super().__init__()``;
    ``self.rank_info``/``self.global_info`` then hold parallel_state's view of this rank.
    Its parameters can be resharded into another group (:mod:`rankmesh.reshard`):
    ``param_layouts()`` reads megatron-core's ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` attributes and the layers' ``layer_number`` (the pipeline's offsets) from
    :meth:`reshard_module` (default ``self.model``).
    """

    def __init__(
        self,
        backend: str | None = None,
        timeout_s: float = 600.0,
        cpu_threads: int | None = 1,
        force_order: str | None = None,
    ) -> None:
        """``force_order`` builds parallel_state with another order than the mesh's: a deliberate
        mismatch, for proving that the controller's check fails (never set it otherwise)."""
        super().__init__()
        self._megatron_up = False
        self._force_order = force_order
        self._timeout_s = timeout_s
        self._captured: list[tuple[torch.nn.Module, str, str]] = []
        self._backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if not torch.cuda.is_available() and cpu_threads:
            # Many ranks share few cores: one intra-op thread each avoids oversubscription.
            torch.set_num_threads(cpu_threads)
        init_distributed(self._backend, timeout_s)
        if dist.get_rank() != self.rank:
            raise RuntimeError(f"torch.distributed rank {dist.get_rank()} differs from the group rank {self.rank}")
        mesh = self.megatron_mesh()
        if dist.get_world_size() != mesh.world_size:
            raise RuntimeError(f"torch.distributed has {dist.get_world_size()} ranks but {mesh!r} has {mesh.world_size}")
        acquire_parallel_state(self.parallel_state_kwargs(mesh))
        self._megatron_up = True
        self._read_parallel_state()

    def _read_parallel_state(self) -> None:
        """Take this rank's coordinates and sizes from parallel_state's getters (never from the mesh)."""
        self._ps_rank_info = DistRankInfo(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            cp_rank=ps.get_context_parallel_rank(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            edp_rank=ps.get_expert_data_parallel_rank(),
        )
        sizes = parallel_state_sizes()
        self._ps_global_info = DistGlobalInfo(
            tp_size=sizes["tp"], dp_size=sizes["dp"], pp_size=sizes["pp"], cp_size=sizes["cp"],
            ep_size=sizes["ep"], etp_size=sizes["etp"], edp_size=sizes["edp"],
        )
        logger.debug("rank %d: parallel_state up, %s", dist.get_rank(), self._ps_rank_info)

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its CUDA device under nccl, else the CPU."""
        if self._backend == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def to_device(self, data: Any) -> Any:
        """``data`` (a received DataProto) on :attr:`device`, with no intermediate host copy.

        A received batch's tensors are copy-on-write views of the object store
        (:mod:`rankmesh.sharedmem`), so the host→device copy reads the shared bytes, once, and
        from page-locked pages (:func:`rankmesh.data.receive.to_device`: the store's pages are
        registered read-only for the copy; 2.4x faster than pageable for 256 MiB on an H200); on
        the CPU it copies nothing.  Declaring ``receive="copy"`` on such a method would add a host
        copy that buys nothing: keep the default.
        """
        return receive.to_device(data, self.device)

    @property
    def rank_info(self) -> DistRankInfo:  # type: ignore[override]
        """This rank's coordinates as parallel_state reports them (the mesh's before init)."""
        info = getattr(self, "_ps_rank_info", None)
        return info if info is not None else super().rank_info

    @property
    def global_info(self) -> DistGlobalInfo:
        """The axis sizes as parallel_state reports them (the mesh's before init)."""
        info = getattr(self, "_ps_global_info", None)
        return info if info is not None else self.mesh.global_info

    def megatron_mesh(self) -> RankMesh:
        """The mesh parallel_state is built from: the group's mesh."""
        return self.mesh

    def parallel_state_kwargs(self, mesh: RankMesh) -> dict[str, Any]:
        """Arguments of ``initialize_model_parallel`` for ``mesh`` (override to experiment)."""
        return dict(
            tensor_model_parallel_size=mesh.size("tp"),
            pipeline_model_parallel_size=mesh.size("pp"),
            context_parallel_size=mesh.size("cp"),
            expert_model_parallel_size=mesh.size("ep"),
            expert_tensor_parallel_size=mesh.size("etp"),
            order=self._force_order or mesh.order,
            # With gloo every group is already gloo: the extra gloo copies only cost start-up time.
            create_gloo_process_groups=self._backend != "gloo",
        )

    @register(Dispatch.ONE_TO_ALL)
    def megatron_report(self, allreduce: bool = False, mesh: RankMesh | None = None) -> dict[str, Any]:
        """parallel_state's coordinates and the members of every group (plain dict of a RankReport).

        With ``mesh``, another mesh over the same ranks: parallel_state is rebuilt for ``mesh``,
        reported on, and rebuilt for the group's own mesh before this returns.  One set of processes
        thus checks several meshes (``validate_rank_mapping.py`` does, for meshes of one process
        count) instead of paying ~2-4 s of start-up per rank for each.  Refused in a process whose
        modules hold parallel_state's groups (they would be left on groups of the wrong mesh) or
        that colocated roles share.
        """
        own = self.megatron_mesh()
        if mesh is None or mesh == own:
            return build_report(allreduce=allreduce, order=self.parallel_state_kwargs(own)["order"]).to_dict()
        if mesh.world_size != dist.get_world_size():
            raise ValueError(f"mesh {mesh!r} has {mesh.world_size} ranks; this group has {dist.get_world_size()}")
        held = captured_groups(self.recovery_modules())
        if held:
            module, attr, name = held[0]
            raise RuntimeError(
                f"rank {self.rank}: {type(module).__name__}.{attr} holds parallel_state's {name} group, which a report on "
                "another mesh would leave pointing at that mesh's groups: report on other meshes from a group without models"
            )
        kwargs = self.parallel_state_kwargs(mesh)
        _PARALLEL_STATE.rebuild(kwargs)
        try:
            return build_report(allreduce=allreduce, order=kwargs["order"]).to_dict()
        finally:
            _PARALLEL_STATE.rebuild(self.parallel_state_kwargs(own))
            self._read_parallel_state()

    @register(Dispatch.ONE_TO_ALL)
    def destroy_megatron(self) -> bool:
        """Tear down parallel_state and the process group; safe to call twice."""
        if self._megatron_up:
            self._megatron_up = False
            release_parallel_state()
        return True

    # ----- checkpoints on any mesh (rankmesh.megatron.checkpoint) -------------------------------

    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """The modules a checkpoint holds, by attribute name (the names are part of the keys).

        Default: every public ``torch.nn.Module`` attribute; private ones (the actor's
        ``_sampler``, an unsharded copy for rollouts) are left out.  Override to choose.
        """
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.nn.Module) and not k.startswith("_")}

    def checkpoint_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizers whose state a checkpoint holds, by attribute name (default: every public one)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.optim.Optimizer) and not k.startswith("_")}

    def _shard_place(self) -> checkpoint.ShardPlace:
        return checkpoint.ShardPlace(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
        )

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, weight_version: int | None = None) -> checkpoint.CheckpointReport:
        """Write the checkpointed modules' weights and the optimizers' state into the new directory ``path``.

        Every tensor is saved in global coordinates, so :meth:`load_checkpoint` reads it on any
        mesh of the same model.  ``path`` must be a directory every rank sees, new or empty.
        ``weight_version`` is recorded with it (default: this rank's own ``weight_version``; a
        trainer's versions are recorded by the controller: pass ``wg.weight_version``).
        """
        version = self.weight_version if weight_version is None else weight_version
        return checkpoint.save(str(path), self.checkpoint_modules(), self.checkpoint_optimizers(),
                               self.megatron_mesh(), self.rank, self._shard_place(), version)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str, optimizers: bool = True) -> checkpoint.CheckpointReport:
        """Read the checkpoint at ``path``, saved on this mesh or any other, into this rank's modules and optimizers.

        dist_checkpointing reads each rank's pieces of the whole tensors, whatever mesh cut them
        when they were saved.  ``optimizers=False`` reads the weights only and resets the
        optimizers' state.  This rank's ``weight_version`` becomes the saved one; the reports
        carry it, for the controller's record (``wg.weight_version = reports[0].weight_version``).
        """
        report = checkpoint.load(str(path), self.checkpoint_modules(), self.checkpoint_optimizers(),
                                 self.megatron_mesh(), self.rank, self._shard_place(), with_optimizers=optimizers)
        self.weight_version = report.weight_version
        return report

    # ----- replacing dead ranks (rankmesh.backends.ray.recovery) -------------------------------

    def recovery_modules(self) -> list[torch.nn.Module]:
        """The modules whose parameters and buffers a replaced rank restores (default: every
        ``torch.nn.Module`` attribute of the worker, in attribute order)."""
        return [v for v in vars(self).values() if isinstance(v, torch.nn.Module)]

    def recovery_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state a replaced rank restores (default: every optimizer attribute)."""
        return [v for v in vars(self).values() if isinstance(v, torch.optim.Optimizer)]

    def leave_distributed(self) -> None:
        """A survivor: forget the groups the modules captured, then tear parallel_state down."""
        self._captured = captured_groups(self.recovery_modules()) if self._megatron_up else []
        for module, attr, _ in self._captured:
            setattr(module, attr, None)  # the old group's connections close only when nothing holds it
        if self._megatron_up:
            self._megatron_up = False
            release_parallel_state()

    def rejoin_distributed(self) -> None:
        """A survivor: rebuild parallel_state from the same mesh, re-point the captured groups."""
        init_distributed(self._backend, self._timeout_s)
        acquire_parallel_state(self.parallel_state_kwargs(self.megatron_mesh()))
        self._megatron_up = True
        self._read_parallel_state()
        getters = {**_group_getters(), "mp": ps.get_model_parallel_group}
        for module, attr, name in self._captured:
            setattr(module, attr, getters[name]())
        self._captured = []

    def _comm_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    def recovery_state(self) -> None:
        """Nothing through the object store: :meth:`restore_from_peer` moves every module, the
        optimizers and the version over torch.distributed."""
        return None

    def restore_from_peer(self, peer_rank: int, sending: bool) -> None:
        """Parameters and buffers (tensor by tensor), optimizer state, the torch RNG state and the
        weight version, over torch.distributed.

        The live peer holds the same shard (same tp, pp, cp, ep coordinates), so both ends walk
        identical ``state_dict`` keys; tensors travel as they are (bit-exact).  Optimizer state
        (moments and step counts), the RNG state and the version travel as one ``torch.save`` payload, loaded
        with ``weights_only=True``.  Other Python state of a subclass is not restored: extend this
        method (call ``super()`` first) if it has any.
        """
        device = self._comm_device()
        for module in self.recovery_modules():
            for tensor in module.state_dict(keep_vars=True).values():
                if not torch.is_tensor(tensor):  # megatron layers' ``_extra_state`` is None
                    continue
                if sending:
                    dist.send(tensor.detach().to(device).contiguous(), dst=peer_rank)
                else:
                    buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    dist.recv(buf, src=peer_rank)
                    with torch.no_grad():
                        tensor.copy_(buf)
        optimizers = self.recovery_optimizers()
        if sending:
            out = io.BytesIO()
            torch.save({"optimizers": [o.state_dict() for o in optimizers], "rng": torch.get_rng_state(),
                        "weight_version": self.weight_version}, out)
            payload = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=device), dst=peer_rank)
            dist.send(payload.to(device), dst=peer_rank)
            return
        size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(size, src=peer_rank)
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(payload, src=peer_rank)
        state = torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), weights_only=True)
        if len(state["optimizers"]) != len(optimizers):
            raise RuntimeError(f"rank {self.rank}: peer {peer_rank} sent {len(state['optimizers'])} optimizer states, "
                               f"this rank has {len(optimizers)} optimizers")
        for optimizer, sd in zip(optimizers, state["optimizers"]):
            optimizer.load_state_dict(sd)
        torch.set_rng_state(state["rng"])
        self.weight_version = state["weight_version"]
