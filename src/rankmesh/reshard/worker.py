"""The worker side of a reshard: :class:`ReshardWorker` describes, sends and receives parameters, on any backend.

Why it knows no backend: a send puts regions into "the backend's objects" and a receive gets
them back, and that is all it asks of where it runs.  The backend hands each worker an
:class:`~rankmesh.backend.ObjectTransport` in its context (``self.context.objects``: ``ray.put`` /
``ray.get`` / ``ray.wait`` on Ray, plain references in-process), one per process, so colocated
roles of one process share it and its outbox.  Regions whose source and destination run on one
node are read straight from the source process with ``process_vm_readv``
(:mod:`rankmesh.peermem`), which needs no transport at all; regions whose source and destination
tensors lie on the same physical GPU (colocated roles sharing it through fractional bundles) are
copied device-to-device through a CUDA IPC handle of the source's storage (:func:`share_cuda`,
:func:`open_cuda`), with no host copy.

What travels between the controller and the ranks are the typed records below:
:class:`SendJob` / :class:`SendResult` for a source rank, :class:`RecvJob` / :class:`RecvResult`
for a destination rank.  The controller side (planning the jobs, running them through the
groups' one call path, the stats) is :mod:`rankmesh.reshard.run`.

Parameter names and layouts come from two hooks, :meth:`ReshardWorker.reshard_names` and
:meth:`ReshardWorker.reshard_layouts`; megatron-core's conventions (global layer numbers,
``tensor_model_parallel`` attributes) are supplied by :class:`rankmesh.megatron.layouts.MegatronReshardWorker`.
"""

from __future__ import annotations

import errno
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rankmesh.backend import ObjectTransport
from rankmesh.deadline import Deadline
from rankmesh.dispatch import Dispatch, register
from rankmesh.errors import PeerReadError, ReshardError
from rankmesh.mesh import RankMesh
from rankmesh.peermem import allow_peer_reads, coalesce, namespace_id, read_process, segments, strided_segments
from rankmesh.reshard.plan import ParamLayout
from rankmesh.serialization import numpy_view
from rankmesh.worker import Worker

#: Largest piece a region is put as.  Ray copies a buffer above 1 MiB into the object store with
#: six threads it starts for that one copy (``parallel_memcopy``); on a machine whose cores are all
#: busy (every rank of both groups copying at once) waiting for the last of those threads cost
#: several times the copy itself; pieces of at most 1 MiB are copied by the putting thread alone.
#: Sender and receiver cut a region the same way (:func:`row_blocks`), on every backend.
PIECE_BYTES = 1 << 20

#: One region of a parameter: (global parameter name, slices of its tensor).
Region = tuple[str, tuple[slice, ...]]


# ----- the records between the controller and the ranks ---------------------------------------------


@dataclass(frozen=True)
class SendJob:
    """What one source rank sends in reshard ``token``.

    ``objects``: each entry is the regions put together as one object (read by the same
    destinations); ``direct``: regions destinations on this node read straight from this process;
    ``local``: regions the colocated destination role of this very process copies (left in the
    process's outbox).
    """

    token: str
    objects: tuple[tuple[Region, ...], ...] = ()
    direct: tuple[Region, ...] = ()
    local: tuple[Region, ...] = ()
    #: Regions destinations on the same GPU copy through a CUDA IPC handle of their tensor.
    ipc: tuple[Region, ...] = ()


@dataclass(frozen=True)
class TensorPlace:
    """Where one rank's reshard tensors live: what the controller needs to choose a pair's transport.

    ``device``: ``"cpu"``, ``"cuda:<i>"`` (this process's numbering) or ``"mixed"``.
    ``gpu_uuid``: the physical GPU holding every tensor (None unless all are on one CUDA device).
    Visible-device numbers differ between processes under ``CUDA_VISIBLE_DEVICES``; the UUID does not.
    """

    pid: int
    device: str
    gpu_uuid: str | None = None


@dataclass(frozen=True)
class IpcTensor:
    """A CUDA tensor of a source process, as the arguments of torch's ``rebuild_cuda_tensor``
    (``torch.multiprocessing.reductions.reduce_tensor``: the storage's IPC handle, the offset of
    the tensor's storage inside its CUDA allocation, shape, strides and the producer's ref counter)."""

    gpu_uuid: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class PeerTensor:
    """Where one CPU tensor of a source process lives: what a direct reader needs to find a region's bytes."""

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int


@dataclass(frozen=True)
class SendResult:
    """A source rank's answer: its objects and where its direct regions' tensors live.

    ``objects``: one transport handle per :attr:`SendJob.objects` entry.  ``pid``/``namespace``:
    the process direct readers read (a pid names it only inside its pid namespace).
    ``tensors``: the CPU tensors of the job's direct regions (kept referenced by the worker until
    its next send).  ``fallback``: index of a direct region whose tensor is not on the CPU -> a
    handle of an object holding it (``fallback_bytes`` in all).  ``start``/``end`` are wall-clock
    times, ``put_s`` the seconds spent putting; ``put_bytes`` the bytes put, fallbacks included.
    """

    objects: tuple[Any, ...]
    pid: int
    namespace: int
    tensors: Mapping[str, PeerTensor]
    fallback: Mapping[int, Any]
    fallback_bytes: int
    start: float
    end: float
    put_s: float
    put_bytes: int = 0
    direct_bytes: int = 0
    #: Tensor name -> its CUDA IPC handle, for :attr:`SendJob.ipc` regions (``ipc_bytes`` of them).
    ipc: Mapping[str, IpcTensor] = field(default_factory=dict)
    ipc_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this send made readable (put, or published for direct or IPC reads): what a trace shows for it."""
        return self.put_bytes + self.direct_bytes + self.ipc_bytes


@dataclass(frozen=True)
class ObjectRead:
    """Object ``index`` of source rank ``src_rank``: fetch it and copy its pieces into ``regions``."""

    src_rank: int
    index: int
    regions: tuple[Region, ...]


@dataclass(frozen=True)
class DirectRead:
    """Direct region ``index`` of source rank ``src_rank`` (``src_slices`` of its tensor ``name``),
    read from that process into ``dst_slices`` of this rank's tensor ``name``."""

    src_rank: int
    index: int
    src_slices: tuple[slice, ...]
    name: str
    dst_slices: tuple[slice, ...]


@dataclass(frozen=True)
class RecvJob:
    """What one destination rank receives in reshard ``token``: objects to fetch, regions to read
    directly, and ``local`` regions the colocated send of its own process left in the outbox."""

    token: str
    objects: tuple[ObjectRead, ...] = ()
    direct: tuple[DirectRead, ...] = ()
    local: tuple[Region, ...] = ()
    version: int | None = None  # the weight version the rank holds once written (None: unchanged)
    #: Regions copied device-to-device from a source's CUDA IPC handle (``index`` unused: by name).
    ipc: tuple[DirectRead, ...] = ()
    #: Whether a CUDA IPC handle that will not open is an error (``transport="cuda_ipc"``) or a
    #: refusal the controller answers by sending that pair through the store (``"auto"``).
    ipc_required: bool = False
    #: How long the rank waits for its sources to have sent (seconds; ``None``: as long as they
    #: run): the receiving call's timeout, past which the controller has given the call up.
    wait_s: float | None = None


def _fetch_by(objects: Any, handles: Sequence[Any], deadline: Deadline, rank: int, sources: Sequence[int]) -> list[Any]:
    """``handles``' values (what sources ``sources`` sent destination ``rank``) by ``deadline``: a
    source cut off leaves the rank free, not stuck."""
    try:
        return objects.get(handles, deadline.timeout())
    except TimeoutError as exc:
        raise ReshardError(f"destination rank {rank}: what source ranks {list(sources)} sent did not arrive within "
                           f"the call's timeout ({exc}); refit again once they are back or replaced") from exc


@dataclass(frozen=True)
class RecvResult:
    """A destination rank's answer.

    ``received``: bytes written into place (objects, direct reads and IPC copies; ``bytes_direct`` of them
    read directly, ``bytes_ipc`` through CUDA IPC).  ``refused``: source rank -> why the kernel
    refused its direct reads, or its IPC handle would not open (those regions are left unwritten,
    for the controller to send by the store).  Wall-clock
    ``start``/``end``; ``copy_s``/``copy_cpu_s``: seconds spent copying into place (wall-clock
    and this thread's CPU).
    """

    received: int
    bytes_direct: int
    refused: Mapping[int, str]
    start: float
    end: float
    copy_s: float
    copy_cpu_s: float
    #: Bytes of ``received`` copied device-to-device through CUDA IPC handles.
    bytes_ipc: int = 0

    @property
    def nbytes(self) -> int:
        """The bytes this receive wrote into place: what a trace shows for it."""
        return self.received


# ----- regions -------------------------------------------------------------------------------------


def row_blocks(shape: tuple[int, ...], itemsize: int, limit: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of the first dimension of a region of ``shape``, each at most ``limit`` bytes
    (or one row, when a row alone is larger).  Sender and receiver cut a region the same way."""
    if not shape:
        return [(0, 1)]
    row = math.prod(shape[1:]) * itemsize
    step = max(1, limit // max(1, row))
    return [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]


def copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
    """``dst[...] = src`` in place, one copy (``src`` may be a read-only object-store view)."""
    if dst.device.type == "cpu":
        np.copyto(numpy_view(dst), src.reshape(dst.shape), casting="no")
        return
    with warnings.catch_warnings():  # a read-only view is fine: it is copied, never written
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(src)
    if source.dtype != dst.dtype:
        source = source.view(dst.dtype)
    dst.copy_(source.reshape(dst.shape), non_blocking=False)


def region_pieces(tensors: Mapping[str, torch.Tensor], regions: Sequence[Region]) -> list[np.ndarray]:
    """The pieces of ``regions`` (whole-row runs of at most PIECE_BYTES each), as one object holds them."""
    arrays = []
    for name, sl in regions:
        region = tensors[name][sl].detach().cpu()
        if region.dim() == 0:
            arrays.append(np.ascontiguousarray(numpy_view(region)))
            continue
        for lo, hi in row_blocks(tuple(region.shape), region.element_size()):
            # A piece that is already contiguous (whole rows) is not copied before the put.
            arrays.append(np.ascontiguousarray(numpy_view(region[lo:hi])))
    return arrays


def copy_object(tensors: Mapping[str, torch.Tensor], arrays: Sequence[np.ndarray], regions: Sequence[Region]) -> int:
    """Copy the pieces of one fetched object into ``regions`` of ``tensors``; returns the bytes."""
    received = 0
    pieces = iter(arrays)
    for name, sl in regions:
        view = tensors[name][sl]
        if view.dim() == 0:
            blocks = [view]
        else:
            blocks = [view[lo:hi] for lo, hi in row_blocks(tuple(view.shape), view.element_size())]
        for block in blocks:
            array = next(pieces)
            copy_into(block, array)
            received += array.nbytes
    return received


def region_bytes(tensors: Mapping[str, torch.Tensor], regions: Sequence[Region]) -> int:
    return sum(tensors[name][sl].numel() * tensors[name].element_size() for name, sl in regions)


def read_direct(tensors: Mapping[str, torch.Tensor], peer: SendResult, reads: Sequence[DirectRead]) -> int:
    """Read ``reads`` from the source process ``peer`` describes straight into ``tensors``, one
    ``process_vm_readv`` batch for all.

    Raises :class:`PeerReadError` (``refused`` when the kernel says no, or when the source runs in
    another pid namespace, where its pid names another process).
    """
    if not reads:
        return 0
    if peer.namespace != namespace_id():
        raise PeerReadError(errno.ESRCH, f"source pid {peer.pid} runs in another pid namespace "
                                         f"({peer.namespace} vs {namespace_id()}): its memory cannot be read by pid")
    remote, local, staged = [], [], []
    wanted = 0  # bytes of the regions (the reads also fill scratch with the gaps they skip)
    for read in reads:
        src = peer.tensors[read.name]
        offset = sum(sl.start * st for sl, st in zip(read.src_slices, src.strides)) * src.itemsize
        runs = strided_segments(src.data_ptr + offset, [sl.stop - sl.start for sl in read.src_slices], src.strides,
                                src.itemsize)
        view = tensors[read.name][read.dst_slices]
        if view.device.type != "cpu":  # read into host memory, then copy to the device
            host = torch.empty(tuple(view.shape), dtype=view.dtype)
            staged.append((view, host))
            view = host
        if view.element_size() != src.itemsize:
            raise ReshardError(f"parameter {read.name!r}: source elements are {src.itemsize} bytes, "
                               f"destination {view.element_size()}")
        wanted += view.numel() * src.itemsize
        # Columns of a tp split along dim 1 are short runs: read the rows whole, the gaps into scratch.
        runs, into = coalesce(runs, segments(view))
        remote.append(runs)
        local.append(into)
    read_process(peer.pid, np.concatenate(remote), np.concatenate(local))
    for view, host in staged:
        view.copy_(host)
    return wanted


#: Position of ``storage_device`` among ``rebuild_cuda_tensor``'s arguments (tensor class, size,
#: stride, offset, storage class, dtype, storage device, handle, ...), as ``reduce_tensor`` returns them.
REBUILD_STORAGE_DEVICE = 6


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind this process's ``device`` (the same string in every process that sees it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def tensor_place(tensors: Mapping[str, torch.Tensor]) -> TensorPlace:
    """Where ``tensors`` live (:class:`TensorPlace`); no tensors count as the CPU."""
    devices = {t.device for t in tensors.values()}
    if not devices:
        return TensorPlace(os.getpid(), "cpu")
    if len(devices) > 1:
        return TensorPlace(os.getpid(), "mixed")
    (device,) = devices
    if device.type != "cuda":
        return TensorPlace(os.getpid(), str(device))
    return TensorPlace(os.getpid(), str(device), gpu_uuid(device))


def share_cuda(tensor: torch.Tensor) -> IpcTensor:
    """``tensor`` (on a CUDA device) as an IPC handle another process on the same GPU can open.

    The handle names the tensor's whole CUDA allocation; the offset of its storage inside it, its
    own offset, shape and strides travel with it, so a view (a parameter inside megatron's
    contiguous buffer) opens as the same view.  The caller keeps ``tensor`` alive until every
    reader has copied.
    """
    _, args = reduce_tensor(tensor.detach())
    return IpcTensor(gpu_uuid(tensor.device), tuple(args))


def open_cuda(shared: IpcTensor, device: torch.device) -> torch.Tensor:
    """The source tensor of ``shared``, opened on this process's ``device`` (the same physical GPU).

    The device number inside the handle is the source process's; it is replaced by ``device``'s,
    since ``CUDA_VISIBLE_DEVICES`` may number the same GPU differently here.
    """
    if gpu_uuid(device) != shared.gpu_uuid:
        raise ReshardError(f"a CUDA IPC handle of GPU {shared.gpu_uuid} cannot be opened on {device} "
                           f"(GPU {gpu_uuid(device)}): the controller routes only pairs on one GPU through IPC")
    args = list(shared.args)
    args[REBUILD_STORAGE_DEVICE] = device.index
    return rebuild_cuda_tensor(*args)


def copy_ipc(tensors: Mapping[str, torch.Tensor], peer: SendResult, reads: Sequence[DirectRead]) -> int:
    """Copy ``reads`` device-to-device from the source tensors ``peer`` shared into ``tensors``; returns the bytes.

    Synchronizes the device before returning: the source may change its tensors once the reshard
    has returned, and the opened handles are dropped here (the source's ref counters fall with them).
    """
    opened: dict[str, torch.Tensor] = {}
    moved = 0
    for read in reads:
        view = tensors[read.name][read.dst_slices]
        if view.device.type != "cuda":
            raise ReshardError(f"parameter {read.name!r} of this rank is on {view.device}, not on a GPU: "
                               "it cannot be copied from a CUDA IPC handle")
        if read.name not in opened:
            opened[read.name] = open_cuda(peer.ipc[read.name], view.device)
        src = opened[read.name][read.src_slices]
        if src.dtype != view.dtype:
            raise ReshardError(f"parameter {read.name!r}: source elements are {src.dtype}, destination {view.dtype}")
        view.copy_(src)
        moved += view.numel() * view.element_size()
    if opened:
        torch.cuda.synchronize(next(iter(opened.values())).device)
    opened.clear()
    return moved


# ----- the worker ----------------------------------------------------------------------------------


class ReshardWorker(Worker):
    """Worker methods that describe, send and receive parameters for :func:`rankmesh.reshard.reshard`.

    Subclasses say where their parameters are by overriding :meth:`reshard_module` (default:
    ``self.model``), how they are named and laid out by :meth:`reshard_names` and
    :meth:`reshard_layouts` (megatron modules: derive from
    :class:`rankmesh.megatron.layouts.MegatronReshardWorker`, which reads megatron-core's own
    attributes), or, for full control, :meth:`reshard_tensors`.
    """

    def reshard_module(self) -> torch.nn.Module:
        """The module whose parameters are resharded (override; the default is ``self.model``)."""
        model = getattr(self, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ReshardError(
                f"{type(self).__name__} has no torch module at self.model: override reshard_module() to return "
                "the module whose parameters are resharded"
            )
        return model

    def reshard_mesh(self) -> RankMesh:
        """The mesh this role's parameters are laid out by (default: the group's; a colocated role
        with a layout of its own returns one of ``self.meshes``)."""
        return self.mesh

    def reshard_names(self, module: torch.nn.Module) -> dict[str, str]:
        """Local parameter name -> its name in the whole model (default: the module's own names)."""
        return {name: name for name, _ in module.named_parameters()}

    def reshard_layouts(self) -> list[ParamLayout]:
        """This rank's parameters as ParamLayouts (override, or derive from a class that knows the model's conventions)."""
        raise ReshardError(
            f"{type(self).__name__} does not say how its parameters are laid out: override reshard_layouts() "
            "(ParamLayout per parameter), or derive from rankmesh.megatron.layouts.MegatronReshardWorker for "
            "modules built from megatron-core's parallel layers"
        )

    def reshard_tensors(self) -> dict[str, torch.Tensor]:
        """Global parameter name -> this rank's tensor (read by sends, written in place by receives)."""
        module = self.reshard_module()
        names = self.reshard_names(module)
        return {names[n]: p.data for n, p in module.named_parameters()}

    def reshard_objects(self) -> ObjectTransport:
        """The backend's objects as this process reaches them (``self.context.objects``)."""
        objects = self.context.objects
        if objects is None:
            raise ReshardError(f"{type(self).__name__} (rank {self.rank}) was built without a backend's objects "
                               "(WorkerContext.objects): build it through a worker group to reshard")
        return objects

    def recovery_state(self) -> dict[str, Any]:
        """What the refits wrote, for a replaced rank: every reshard tensor and the weight version.

        Why: a replaced rank is built from its constructor's arguments, so a receiving group's
        new rank (a rollout) would hold its initial weights and version, and the call the group
        retries after the replacement would run on them, its rows stamped with the old version,
        with nothing to say so.  (:class:`rankmesh.megatron.worker.MegatronWorker` moves whole
        modules over torch.distributed instead.)"""
        return {"tensors": self.reshard_tensors(), "weight_version": self.weight_version}

    def load_recovery_state(self, state: Mapping[str, Any]) -> None:
        """Copy the peer's reshard tensors into this rank's, in place, and take its version."""
        tensors = self.reshard_tensors()
        if set(state["tensors"]) != set(tensors):
            raise ReshardError(
                f"rank {self.rank}: its live peer's reshard tensors {sorted(state['tensors'])} are not this rank's "
                f"{sorted(tensors)}: a replaced rank must build the same parameters as the rank it replaces"
            )
        with torch.no_grad():
            for name, tensor in tensors.items():
                tensor.copy_(state["tensors"][name])
        self.weight_version = state["weight_version"]

    @register(Dispatch.ONE_TO_ALL)
    def reshard_place(self) -> TensorPlace:
        """Where this rank's reshard tensors live (asked before each reshard that may use CUDA IPC)."""
        return tensor_place(self.reshard_tensors())

    @register(Dispatch.ONE_TO_ALL)
    def param_layouts(self) -> list[ParamLayout]:
        """This rank's parameters (one list per rank; merge them with :func:`~rankmesh.reshard.merge_layouts`)."""
        return self.reshard_layouts()

    @register(Dispatch.ALL_TO_ALL)
    def reshard_send(self, job: SendJob) -> SendResult:
        """Put each of ``job.objects`` into the backend's objects, and publish where the tensors of
        ``job.direct`` (regions read straight from this process) live.

        The published tensors stay referenced by this worker until its next send, so their
        addresses stay valid while the blocking reshard runs.  A direct region whose tensor is
        not on the CPU has no address another process can read: it is put as an object instead
        (:attr:`SendResult.fallback`).
        """
        start = time.time()
        objects = self.reshard_objects()
        tensors = self.reshard_tensors()
        handles = []
        put_s = 0.0
        for regions in job.objects:
            t = time.perf_counter()
            handles.append(objects.put(region_pieces(tensors, regions)))
            put_s += time.perf_counter() - t
        published: dict[str, PeerTensor] = {}
        fallback, fallback_bytes, direct_bytes = {}, 0, 0
        tracer = objects.peer_tracer() if job.direct else None
        if tracer is not None:  # the node's peers (on Ray: the raylet's descendants) may read this process
            allow_peer_reads(tracer)
        for i, (name, sl) in enumerate(job.direct):
            tensor = tensors[name]
            if tensor.device.type == "cpu":
                published[name] = PeerTensor(tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
                                             tensor.element_size())
                direct_bytes += region_bytes(tensors, [(name, sl)])
            else:
                t = time.perf_counter()
                fallback[i] = objects.put(region_pieces(tensors, [(name, sl)]))
                put_s += time.perf_counter() - t
                fallback_bytes += region_bytes(tensors, [(name, sl)])
        shared: dict[str, IpcTensor] = {}
        ipc_bytes = 0
        for name, sl in job.ipc:
            tensor = tensors[name]
            if tensor.device.type != "cuda":
                raise ReshardError(f"source rank {self.rank}: parameter {name!r} is on {tensor.device}, but this reshard "
                                   "routes it through CUDA IPC, which needs it on a GPU: keep the weights where they are "
                                   "during a reshard, or pass transport='auto'")
            if name not in shared:
                shared[name] = share_cuda(tensor)
            ipc_bytes += region_bytes(tensors, [(name, sl)])
        # Keep what was published alive until this worker's next send (reshard_tensors() may build
        # new tensors on every call): destinations read them after this call has returned.
        self._reshard_published = {name: tensors[name] for name in (*published, *shared)}
        if job.local:
            objects.outbox[(job.token, self.rank)] = [tensors[name][sl] for name, sl in job.local]
        put_bytes = sum(region_bytes(tensors, regions) for regions in job.objects) + fallback_bytes
        return SendResult(tuple(handles), os.getpid(), namespace_id(), published, fallback, fallback_bytes,
                          start, time.time(), put_s, put_bytes, direct_bytes, shared, ipc_bytes)

    @register(Dispatch.ALL_TO_ALL)
    def reshard_recv(self, job: RecvJob, sends: Sequence[Any]) -> RecvResult:
        """Fetch or read this rank's regions and copy each into place, source by source as they finish.

        ``sends`` are the pending handles of the source ranks' :meth:`reshard_send` calls (passed
        unresolved, so this call starts at once, not after every source).  A source whose memory
        the kernel will not let this process read is reported in :attr:`RecvResult.refused` (its
        direct regions left unwritten) for the controller to send through the store.
        """
        start = time.time()
        objects = self.reshard_objects()
        tensors = self.reshard_tensors()
        received, direct_bytes, copy_s, copy_cpu = 0, 0, 0.0, 0.0
        refused: dict[int, str] = {}
        by_source: dict[int, list[tuple[Any, tuple[Region, ...]]]] = {}  # source -> (object handle or index, regions)
        for read in job.objects:
            by_source.setdefault(read.src_rank, []).append((read.index, read.regions))
        direct_by_source: dict[int, list[DirectRead]] = {}
        for d in job.direct:
            direct_by_source.setdefault(d.src_rank, []).append(d)
        ipc_by_source: dict[int, list[DirectRead]] = {}
        for d in job.ipc:
            ipc_by_source.setdefault(d.src_rank, []).append(d)
        ipc_bytes = 0
        waiting = sorted(set(by_source) | set(direct_by_source) | set(ipc_by_source))
        deadline = Deadline.after(job.wait_s)
        while waiting:
            # Whichever sources have put their objects: copy theirs while the others still put.
            done = objects.wait_any([sends[r] for r in waiting], deadline.timeout())
            if not done:  # a source's node cut off, say: this rank is free for the next call, not stuck here
                raise ReshardError(f"destination rank {self.rank}: source ranks {waiting} had not sent within "
                                   f"{job.wait_s:g} s (the call's timeout); refit again once they are back or replaced")
            sources = [waiting[i] for i in done]
            waiting = [r for r in waiting if r not in sources]
            outputs: list[SendResult] = _fetch_by(objects, [sends[r] for r in sources], deadline, self.rank, sources)
            t, c = time.perf_counter(), time.thread_time()
            wanted: list[tuple[Any, tuple[Region, ...]]] = []
            for r, out in zip(sources, outputs):
                wanted += [(out.objects[i], regions) for i, regions in by_source.get(r, ())]
                if r in ipc_by_source:
                    try:
                        ipc_bytes += copy_ipc(tensors, out, ipc_by_source[r])
                    except RuntimeError as exc:  # the handle would not open (another IPC namespace, a driver refusal)
                        if job.ipc_required:
                            raise ReshardError(f"destination rank {self.rank}: opening the CUDA IPC handles of source "
                                               f"rank {r} (pid {out.pid}) failed: {exc}; pass transport='auto' to "
                                               "fall back to the object store") from exc
                        refused[r] = f"CUDA IPC: {exc}"
                    continue
                reads = direct_by_source.get(r)
                if not reads:
                    continue
                kept = [d for d in reads if d.index not in out.fallback]
                try:
                    direct_bytes += read_direct(tensors, out, kept)
                except PeerReadError as exc:
                    if not exc.refused:
                        raise ReshardError(f"reading source rank {r} (pid {out.pid}) directly: {exc}") from exc
                    refused[r] = str(exc)  # the controller sends every region of this pair by the store
                    continue
                # Regions whose source tensor was not on the CPU came as objects: fetch them below.
                wanted += [(out.fallback[d.index], ((d.name, d.dst_slices),)) for d in reads if d.index in out.fallback]
            copy_s += time.perf_counter() - t
            copy_cpu += time.thread_time() - c
            if not wanted:  # every region of these sources was read directly
                continue
            fetched = _fetch_by(objects, [handle for handle, _ in wanted], deadline, self.rank, sources)
            t, c = time.perf_counter(), time.thread_time()
            for arrays, (_, regions) in zip(fetched, wanted):
                received += copy_object(tensors, arrays, regions)
            copy_s += time.perf_counter() - t
            copy_cpu += time.thread_time() - c
            del fetched
        if job.local:
            views = objects.outbox.pop((job.token, self.rank), None)
            if views is None:
                raise ReshardError(f"rank {self.rank}: the colocated send of reshard {job.token} left no regions in this "
                                   "process (was it replaced since?): run the reshard again")
            for view, (name, sl) in zip(views, job.local):
                tensors[name][sl].copy_(view)
        if job.version is not None and not refused:  # with refused regions the second round says it
            self.weight_version = job.version
        return RecvResult(received + direct_bytes + ipc_bytes, direct_bytes, refused, start, time.time(), copy_s, copy_cpu,
                          ipc_bytes)

    @register(Dispatch.ONE_TO_ALL)
    def reshard_drop(self, token: str) -> int:
        """Forget the regions a colocated send of reshard ``token`` left in this process (after a failure)."""
        return len(self.reshard_objects().outbox.pop((token, self.rank), ()))

    @register(Dispatch.ONE_TO_ALL)
    def reshard_pending(self) -> int:
        """How many colocated sends left regions in this process that no receive has taken (0 when idle)."""
        return sum(rank == self.rank for _, rank in self.reshard_objects().outbox)
