"""Run a ReshardPlan on Ray: destinations read same-node regions from the source process, the rest via the object store.

Why through the object store and not through the controller: the naive refit gathers every full
tensor on the controller and sends each destination its slice, so every byte crosses the driver
twice and the driver's memory must hold the model.  Here each source rank ``ray.put``s each of its
outgoing regions once (regions read by the same destinations share one object; a region several
destination replicas read is put once for all of them), as whole-row pieces of at most 1 MiB.
The controller submits the sends and the receives together and moves only the plan and object
references: each destination waits for the send calls it reads from and, as each source finishes,
``ray.get``s that source's objects and copies each piece into its parameter in place, while the
other sources are still putting.  Objects are owned by the source rank and freed when the last
reference goes.

Same node, one copy (``transport="auto"``, the default): when a source rank and a destination
rank run on the same Ray node, the source does not put their regions at all.  Its send call
returns its pid and, per tensor involved, ``(data_ptr, shape, strides, itemsize)``; the
destination computes the byte runs of each region itself and reads them straight from the source
process into its parameter view with ``process_vm_readv`` (:mod:`rankmesh.peermem`): every byte
is copied once, and no object-store page is touched.  Pairs on different nodes keep the object
store.  A pair whose read the kernel refuses (another user, Yama, seccomp, another pid namespace)
is sent again through the store, with one warning per controller process, and later calls send it
by the store directly.  ``transport="store"`` sends everything through the store, as before.

Colocated plans (both roles in the same processes) keep local regions out of the object store:
the source role leaves views of its tensors in a per-process outbox, and the destination role of
that process copies from them.

What this relies on from the worker-group API: registered methods may return ``ObjectRef`` values
and receive them inside their arguments (Ray keeps them alive while referenced), and a group's
executor submits rank calls without waiting (:meth:`RayExecutor.submit`), so that a call can be
given the references of another group's pending call.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import ray
import torch

from rankmesh.backend import RankCall
from rankmesh.dispatch import Dispatch, register
from rankmesh.errors import PeerReadError, ReshardError
from rankmesh.mesh import RankMesh
from rankmesh.peermem import allow_peer_reads, coalesce, namespace_id, read_process, segments, strided_segments
from rankmesh.reshard.plan import ParamLayout, ReshardPlan, Transfer, merge_layouts, plan_reshard
from rankmesh.serialization import numpy_view
from rankmesh.worker import Worker

from .runtime import worker_raylet_pid

logger = logging.getLogger(__name__)

#: Regions a colocated source role left for the destination role of the same process, by
#: (reshard token, rank).  Entries live from ``reshard_send`` to the matching ``reshard_recv``.
_OUTBOX: dict[tuple[str, int], list[torch.Tensor]] = {}

#: Largest piece a region is put as.  Ray copies a buffer above 1 MiB into the object store with
#: six threads it starts for that one copy (``parallel_memcopy``); on a machine whose cores are all
#: busy (every rank of both groups copying at once) waiting for the last of those threads cost
#: several times the copy itself; pieces of at most 1 MiB are copied by the putting thread alone.
PIECE_BYTES = 1 << 20

#: ``reshard(transport=...)``: ``auto`` reads same-node regions straight from the source process
#: (``process_vm_readv``, :mod:`rankmesh.peermem`) and sends the rest through the object store;
#: ``store`` sends everything through the object store.
TRANSPORTS = ("auto", "store")

#: (node id, source pid, destination pid) pairs whose direct read the kernel refused: later
#: reshards in this controller send them through the object store at once.
_REFUSED: set[tuple[str, int, int]] = set()


def row_blocks(shape: tuple[int, ...], itemsize: int, limit: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of the first dimension of a region of ``shape``, each at most ``limit`` bytes
    (or one row, when a row alone is larger).  Sender and receiver cut a region the same way."""
    if not shape:
        return [(0, 1)]
    row = math.prod(shape[1:]) * itemsize
    step = max(1, limit // max(1, row))
    return [(lo, min(lo + step, shape[0])) for lo in range(0, shape[0], step)]


def _copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
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


_LAYER = re.compile(r"^(.*\blayers)\.(\d+)$")


def global_parameter_names(module: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> name in the whole model, undoing the pipeline's layer offsets.

    megatron-core numbers the layers of a stage from 0 (``decoder.layers.0``) and keeps the
    global number in ``TransformerLayer.layer_number`` (1-based); a module without that
    attribute keeps its name.
    """
    renames = {}
    for qual, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        match = _LAYER.match(qual)
        if match and isinstance(number, int):
            renames[qual + "."] = f"{match.group(1)}.{number - 1}."
    out = {}
    for name, _ in module.named_parameters():
        new = name
        for prefix, repl in renames.items():
            if name.startswith(prefix):
                new = repl + name[len(prefix):]
                break
        out[name] = new
    return out


def layouts_from_module(module: torch.nn.Module, mesh: RankMesh, rank: int) -> list[ParamLayout]:
    """This rank's parameters as ParamLayouts, from megatron-core's own parameter attributes.

    ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` (set by megatron's
    parallel layers) give the tp split; the full size along ``partition_dim`` is the local one
    times tp; ``pp_stage`` is this rank's stage (:func:`~rankmesh.reshard.merge_layouts` turns a
    parameter every stage reports into ``None``).  A parameter without the attributes is replicated.
    """
    coords = mesh.coords(rank)
    names = global_parameter_names(module)
    out = []
    for local, param in module.named_parameters():
        if getattr(param, "allreduce", True) is False:
            raise ReshardError(
                f"parameter {local!r} is an expert-parallel parameter: its expert layout is not in megatron's "
                "attributes; override param_layouts() and describe it with ParamLayout(expert=True, ep_dim=...)"
            )
        shape = list(param.shape)
        tp_dim = None
        if getattr(param, "tensor_model_parallel", False):
            tp_dim = int(getattr(param, "partition_dim"))
            shape[tp_dim] *= mesh.size("tp")
        out.append(ParamLayout(
            names[local], tuple(shape), tp_dim=tp_dim, pp_stage=coords.pp_rank,
            tp_stride=int(getattr(param, "partition_stride", 1)) if tp_dim is not None else 1,
            dtype=str(param.dtype).removeprefix("torch."),
        ))
    return out


def _put_regions(tensors: dict[str, torch.Tensor], regions: list[tuple[str, tuple]]) -> Any:
    """One object of ``regions`` (whole-row pieces of at most PIECE_BYTES each), put into the store."""
    arrays = []
    for name, sl in regions:
        region = tensors[name][sl].detach().cpu()
        if region.dim() == 0:
            arrays.append(np.ascontiguousarray(numpy_view(region)))
            continue
        for lo, hi in row_blocks(tuple(region.shape), region.element_size()):
            # A piece that is already contiguous (whole rows) is not copied before the put.
            arrays.append(np.ascontiguousarray(numpy_view(region[lo:hi])))
    return ray.put(arrays)


def _copy_object(tensors: dict[str, torch.Tensor], arrays: list[np.ndarray], regions: list[tuple[str, tuple]]) -> int:
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
            _copy_into(block, array)
            received += array.nbytes
    return received


def _read_direct(tensors: dict[str, torch.Tensor], peer: dict[str, Any], entries: list[tuple]) -> int:
    """Read ``entries`` (region index, source slices, name, destination slices) from the source
    process ``peer`` describes straight into ``tensors``, one ``process_vm_readv`` batch for all.

    Raises :class:`PeerReadError` (``refused`` when the kernel says no, or when the source runs in
    another pid namespace, where its pid names another process).
    """
    if not entries:
        return 0
    if peer["ns"] != namespace_id():
        raise PeerReadError(errno.ESRCH, f"source pid {peer['pid']} runs in another pid namespace "
                                         f"({peer['ns']} vs {namespace_id()}): its memory cannot be read by pid")
    remote, local, staged = [], [], []
    wanted = 0  # bytes of the regions (the reads also fill scratch with the gaps they skip)
    for _, src_sl, name, dst_sl in entries:
        ptr, shape, strides, itemsize = peer["tensors"][name]
        offset = sum(sl.start * st for sl, st in zip(src_sl, strides)) * itemsize
        runs = strided_segments(ptr + offset, [sl.stop - sl.start for sl in src_sl], strides, itemsize)
        view = tensors[name][dst_sl]
        if view.device.type != "cpu":  # read into host memory, then copy to the device
            host = torch.empty(tuple(view.shape), dtype=view.dtype)
            staged.append((view, host))
            view = host
        if view.element_size() != itemsize:
            raise ReshardError(f"parameter {name!r}: source elements are {itemsize} bytes, destination {view.element_size()}")
        wanted += view.numel() * itemsize
        # Columns of a tp split along dim 1 are short runs: read the rows whole, the gaps into scratch.
        runs, into = coalesce(runs, segments(view))
        remote.append(runs)
        local.append(into)
    read_process(peer["pid"], np.concatenate(remote), np.concatenate(local))
    for view, host in staged:
        view.copy_(host)
    return wanted


class ReshardWorker(Worker):
    """Worker methods that describe, send and receive parameters for :func:`reshard`.

    Subclasses say where their parameters are by overriding :meth:`reshard_module` (default:
    ``self.model``) or, for full control, :meth:`reshard_tensors` and :meth:`param_layouts`.
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

    def reshard_tensors(self) -> dict[str, torch.Tensor]:
        """Global parameter name -> this rank's tensor (read by sends, written in place by receives)."""
        module = self.reshard_module()
        names = global_parameter_names(module)
        return {names[n]: p.data for n, p in module.named_parameters()}

    @register(Dispatch.ONE_TO_ALL)
    def param_layouts(self) -> list[ParamLayout]:
        """This rank's parameters (one list per rank; merge them with :func:`merge_layouts`)."""
        return layouts_from_module(self.reshard_module(), self.reshard_mesh(), self.rank)

    @register(Dispatch.ALL_TO_ALL)
    def reshard_send(self, job: dict[str, Any]) -> dict[str, Any]:
        """Put each object of ``job["objects"]`` (a list of regions) into the object store, and
        publish where the tensors of ``job["direct"]`` (regions read straight from this process) live.

        Returns ``{"refs": [one ObjectRef per object], "peer", "fallback", "fallback_bytes",
        "start", "end", "put_s"}``: ``peer`` is ``{"pid", "ns", "tensors": {name: (data_ptr, shape, strides,
        itemsize)}}`` for the CPU tensors of direct regions (the tensors stay referenced by this
        worker until its next send, so the addresses stay valid while the blocking
        :func:`reshard` runs); ``fallback`` maps the index of a direct region whose tensor is not
        on the CPU to an object holding it (``fallback_bytes`` in all).  Times are wall-clock, ``put_s`` the seconds in ``ray.put``.
        """
        start = time.time()
        tensors = self.reshard_tensors()
        refs = []
        put_s = 0.0
        for regions in job["objects"]:
            t = time.perf_counter()
            refs.append(_put_regions(tensors, regions))
            put_s += time.perf_counter() - t
        peer: dict[str, Any] = {"pid": os.getpid(), "ns": namespace_id(), "tensors": {}}
        fallback, fallback_bytes = {}, 0
        direct = job.get("direct", [])
        raylet = worker_raylet_pid() if direct else None
        if raylet is not None:  # this node's Ray workers (the raylet's descendants) may read this process
            allow_peer_reads(raylet)
        for i, (name, sl) in enumerate(direct):
            tensor = tensors[name]
            if tensor.device.type == "cpu":
                peer["tensors"][name] = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
                                         tensor.element_size())
            else:  # a device tensor has no address another process can read: this region goes by the store
                t = time.perf_counter()
                fallback[i] = _put_regions(tensors, [(name, sl)])
                put_s += time.perf_counter() - t
                fallback_bytes += tensor[sl].numel() * tensor.element_size()
        # Keep what was published alive until this worker's next send (reshard_tensors() may build
        # new tensors on every call): destinations read them after this call has returned.
        self._reshard_published = {name: tensors[name] for name in peer["tensors"]}
        if job["local"]:
            _OUTBOX[(job["token"], self.rank)] = [tensors[name][sl] for name, sl in job["local"]]
        return {"refs": refs, "peer": peer, "fallback": fallback, "fallback_bytes": fallback_bytes,
                "start": start, "end": time.time(), "put_s": put_s}

    @register(Dispatch.ALL_TO_ALL)
    def reshard_recv(self, job: dict[str, Any], sends: list[Any]) -> dict[str, Any]:
        """Fetch or read this rank's regions and copy each into place, source by source as they finish.

        ``sends`` are the references of the source ranks' :meth:`reshard_send` calls, nested (so
        this call starts at once, not after every source); ``job["refs"]`` names (source rank,
        object index, regions) fetched from the object store; ``job["direct"]`` names (source rank,
        region index, source slices, name, destination slices) read straight from the source
        process (:func:`rankmesh.peermem.read_process`).  A source whose memory the kernel will not
        let this process read is reported in ``refused`` (its direct regions left unwritten) for the
        controller to send through the store.  Returns ``{"bytes": received, "bytes_direct",
        "refused": {source rank: reason}, "start", "end", "copy_s", "copy_cpu_s"}`` (wall-clock
        times, and the seconds spent copying into place: wall-clock and this thread's CPU).
        """
        start = time.time()
        tensors = self.reshard_tensors()
        received, direct_bytes, copy_s, copy_cpu = 0, 0, 0.0, 0.0
        refused: dict[int, str] = {}
        by_source: dict[int, list[tuple[int, list]]] = {}
        for r, i, regions in job["refs"]:
            by_source.setdefault(r, []).append((i, regions))
        direct_by_source: dict[int, list[tuple]] = {}
        for r, *entry in job.get("direct", []):
            direct_by_source.setdefault(r, []).append(tuple(entry))
        waiting = {sends[r]: r for r in set(by_source) | set(direct_by_source)}
        while waiting:
            # Whichever sources have put their objects: copy theirs while the others still put.
            first, _ = ray.wait(list(waiting), num_returns=1)
            ready = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)[0] or first
            outputs = ray.get(ready)
            sources = [waiting.pop(ref) for ref in ready]
            t, c = time.perf_counter(), time.thread_time()
            for r, out in zip(sources, outputs):
                entries = direct_by_source.get(r)
                if not entries:
                    continue
                kept = [e for e in entries if e[0] not in out["fallback"]]
                try:
                    direct_bytes += _read_direct(tensors, out["peer"], kept)
                except PeerReadError as exc:
                    if not exc.refused:
                        raise ReshardError(f"reading source rank {r} (pid {out['peer']['pid']}) directly: {exc}") from exc
                    refused[r] = str(exc)  # the controller sends every region of this pair by the store
                    continue
                # Regions whose source tensor was not on the CPU came as objects: fetch them below.
                for i, _, name, dst_sl in entries:
                    if i in out["fallback"]:
                        out["refs"].append(out["fallback"][i])
                        by_source.setdefault(r, []).append((len(out["refs"]) - 1, [(name, dst_sl)]))
            copy_s += time.perf_counter() - t
            copy_cpu += time.thread_time() - c
            wanted = [(out["refs"][i], regions) for r, out in zip(sources, outputs) for i, regions in by_source.get(r, ())]
            if not wanted:  # every region of these sources was read directly
                continue
            objects = ray.get([ref for ref, _ in wanted])
            t, c = time.perf_counter(), time.thread_time()
            for arrays, (_, regions) in zip(objects, wanted):
                received += _copy_object(tensors, arrays, regions)
            copy_s += time.perf_counter() - t
            copy_cpu += time.thread_time() - c
            del objects
        if job["local"]:
            views = _OUTBOX.pop((job["token"], self.rank))
            for view, (name, sl) in zip(views, job["local"]):
                tensors[name][sl].copy_(view)
        return {"bytes": received + direct_bytes, "bytes_direct": direct_bytes, "refused": refused, "start": start,
                "end": time.time(), "copy_s": copy_s, "copy_cpu_s": copy_cpu}

    @register(Dispatch.ONE_TO_ALL)
    def reshard_drop(self, token: str) -> int:
        """Forget the regions a colocated send of reshard ``token`` left in this process (after a failure)."""
        return len(_OUTBOX.pop((token, self.rank), ()))

    @register(Dispatch.ONE_TO_ALL)
    def reshard_pending(self) -> int:
        """How many colocated sends left regions in this process that no receive has taken (0 when idle)."""
        return sum(rank == self.rank for _, rank in _OUTBOX)


@dataclass(frozen=True)
class ReshardStats:
    """What one :func:`reshard` call moved, and how long its phases took.

    ``send_s``: from the call's start until the last source has put its objects (or published
    its tensors, for direct reads); ``recv_s``: the
    rest of the call (the receives were submitted with the sends and start as soon as their
    sources' puts exist, so part of the receiving overlaps ``send_s``).  ``copy_s``: the longest
    time one destination spent copying its regions into place (after its ``ray.get``, or reading
    them from the source processes).
    """

    bytes_moved: int
    bytes_local: int
    objects: int
    send_s: float
    recv_s: float
    #: Bytes the sources put into the object store: each region once, however many destinations read it.
    bytes_put: int = 0
    copy_s: float = 0.0
    #: Per rank, seconds from the call's start: ``("send", rank, started, finished, seconds in
    #: ray.put)`` and ``("recv", rank, started, seconds copying, finished)`` (for benchmarks).
    timeline: tuple[tuple[Any, ...], ...] = ()
    #: Bytes destinations read straight from a source process on their node (``transport="auto"``);
    #: the rest of ``bytes_moved`` went through the object store.
    bytes_direct: int = 0
    #: (source, destination) pairs whose direct read the kernel refused (sent by the store instead).
    refused: int = 0
    #: CPU seconds all destinations spent copying into place, summed (unlike ``copy_s``, not
    #: stretched by other processes competing for the cores).
    copy_cpu_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.send_s + self.recv_s


def _check_group(group: Any, mesh: RankMesh, side: str) -> None:
    if mesh not in group.meshes.values():
        raise ReshardError(f"the plan's {side} mesh is {mesh!r} but the {side} group's is {group.mesh!r}; plan again")
    for method in ("reshard_send", "reshard_recv"):
        if method not in group.method_names:
            raise ReshardError(f"the {side} group's workers have no registered {method}: derive them from ReshardWorker")


def _objects_of(plan: ReshardPlan, src_rank: int, direct: frozenset[tuple[int, int]] = frozenset()
                ) -> list[tuple[list[tuple[str, tuple]], dict[int, list[tuple[str, tuple]]]]]:
    """``src_rank``'s objects: (regions to put, destination -> where each region goes), in put order.

    A region several destinations read (dp replicas of the destination) is put once, and the
    regions read by the same set of destinations share one object: a tp1·dp8 generator refit from
    a tp2 trainer costs each source one put, read by every destination that needs it.
    """
    readers: dict[tuple, dict[int, Transfer]] = {}
    for t in plan.sends(src_rank):
        if not t.local and (t.src_rank, t.dst_rank) not in direct:
            key = (t.name, tuple((s.start, s.stop) for s in t.src_slices))
            readers.setdefault(key, {})[t.dst_rank] = t
    groups: dict[frozenset, list[tuple]] = {}
    for key, by_dst in readers.items():
        groups.setdefault(frozenset(by_dst), []).append(key)
    out = []
    for dsts, keys in groups.items():
        regions = [(name, readers[(name, bounds)][min(dsts)].src_slices) for name, bounds in keys]
        places = {d: [(readers[k][d].name, readers[k][d].dst_slices) for k in keys] for d in sorted(dsts)}
        out.append((regions, places))
    return out


def _submit(group: Any, method: str, calls: list[RankCall]) -> list[Any]:
    """Submit one rank call per rank of ``group``'s ``method`` without waiting (the group's own routing)."""
    binding = getattr(group, method).rankmesh_binding
    return group.executor.submit(binding.role, binding.target, calls)


def _drain(group: Any, pending: list[Any]) -> None:
    """Wait for calls that may fail because a call they depend on failed; their errors are not the first."""
    try:
        group.executor.fetch(pending)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        logger.debug("reshard: a receive failed after its source did", exc_info=True)


def _direct_regions(plan: ReshardPlan, src_rank: int, direct: frozenset[tuple[int, int]]) -> tuple[list, dict[int, list]]:
    """``src_rank``'s regions read straight from its process: (name, source slices) each once, and
    per destination its entries (source rank, region index, source slices, name, destination slices)."""
    index: dict[tuple, int] = {}
    regions, entries = [], {}
    for t in plan.sends(src_rank):
        if t.local or (t.src_rank, t.dst_rank) not in direct:
            continue
        key = (t.name, tuple((sl.start, sl.stop) for sl in t.src_slices))
        if key not in index:
            index[key] = len(regions)
            regions.append((t.name, t.src_slices))
        entries.setdefault(t.dst_rank, []).append((src_rank, index[key], t.src_slices, t.name, t.dst_slices))
    return regions, entries


def _direct_pairs(src_group: Any, dst_group: Any, plan: ReshardPlan, transport: str) -> frozenset[tuple[int, int]]:
    """(source rank, destination rank) pairs read directly: same Ray node, not refused before."""
    if transport == "store":
        return frozenset()
    try:
        src_info, dst_info = src_group.node_info, dst_group.node_info
    except AttributeError:  # a group that cannot say where its ranks run: the store works anywhere
        return frozenset()
    pairs = set()
    for t in plan.transfers:
        if t.local:
            continue
        s, d = src_info[t.src_rank], dst_info[t.dst_rank]
        if s["node_id"] == d["node_id"] and (s["node_id"], s["pid"], d["pid"]) not in _REFUSED:
            pairs.add((t.src_rank, t.dst_rank))
    return frozenset(pairs)


@dataclass
class _Run:
    sent: list[dict[str, Any]]
    got: list[dict[str, Any]]
    start: float
    end: float
    n_objects: int
    bytes_put: int


def _run(src_group: Any, dst_group: Any, plan: ReshardPlan, direct: frozenset[tuple[int, int]]) -> _Run:
    """Submit every send and receive of ``plan`` at once and wait for them (``direct`` pairs read by pid)."""
    token = uuid.uuid4().hex
    send_jobs = []
    recv_jobs: list[dict[str, Any]] = [{"token": token, "refs": [], "direct": [], "local": []}
                                       for _ in range(plan.dst.world_size)]
    bytes_put = n_objects = 0
    for r in range(plan.src.world_size):
        objects = _objects_of(plan, r, direct)
        n_objects += len(objects)
        bytes_put += sum(math.prod(s.stop - s.start for s in sl) * plan.params[name].itemsize
                         for regions, _ in objects for name, sl in regions)
        for i, (_, places) in enumerate(objects):
            for d, regions in places.items():
                recv_jobs[d]["refs"].append((r, i, regions))
        regions, entries = _direct_regions(plan, r, direct)
        for d, items in entries.items():
            recv_jobs[d]["direct"] += items
        send_jobs.append({"token": token, "objects": [regions for regions, _ in objects], "direct": regions,
                          "local": [(t.name, t.src_slices) for t in plan.sends(r) if t.local]})
    for d in range(plan.dst.world_size):
        recv_jobs[d]["local"] = [(t.name, t.dst_slices) for t in plan.receives(d) if t.local]
    start = time.time()
    sends = _submit(src_group, "reshard_send", [RankCall(r, (job,)) for r, job in enumerate(send_jobs)])
    try:
        # The send calls' references travel inside one stored list, so Ray does not wait for them
        # before starting a receive: each destination copies from each source as soon as it has put.
        refs = dst_group.executor.share([p.ref for p in sends])
        recvs = _submit(dst_group, "reshard_recv", [RankCall(d, (job, refs)) for d, job in enumerate(recv_jobs)])
        try:
            sent = src_group.executor.fetch(sends)
        except BaseException:
            _drain(dst_group, recvs)
            raise
        got = dst_group.executor.fetch(recvs)
    except BaseException:
        if any(job["local"] for job in send_jobs):  # views a colocated send left behind would pin the tensors
            try:
                src_group.reshard_drop(token)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                logger.warning("reshard %s failed and its colocated regions could not be dropped", token, exc_info=True)
        raise
    # Regions of device tensors planned as direct reads went by the store after all (reshard_send).
    n_objects += sum(len(s["fallback"]) for s in sent)
    bytes_put += sum(s["fallback_bytes"] for s in sent)
    return _Run(sent, got, start, time.time(), n_objects, bytes_put)


def reshard(src_group: Any, dst_group: Any, plan: ReshardPlan, transport: str = "auto") -> ReshardStats:
    """Move the weights of ``src_group`` into ``dst_group`` as ``plan`` says; only references pass here.

    The sends and the receives are submitted together: each receive gets the references of the
    send calls, waits for the ones it reads from and copies from each source as soon as that
    source has put its objects (or published its tensors), without a round trip through the
    controller between the phases.

    ``transport``: ``"auto"`` (default) reads each region whose source and destination ranks run
    on the same Ray node straight out of the source process into the destination's parameter
    (``process_vm_readv``: one copy, no object store; CPU source tensors), and sends the others
    through the object store; ``"store"`` sends everything through the object store.  A direct
    read the kernel refuses (another user, Yama, seccomp, another pid namespace) is not an error:
    that pair's regions go through the store in a second round, a warning is logged once, and
    later calls send that pair by the store at once.

    Blocking: it returns only after every destination has its regions.  The sources' tensors must
    not change (nor be freed) until then, since destinations read them in place.
    """
    if transport not in TRANSPORTS:
        raise ReshardError(f"reshard(transport={transport!r}): expected one of {', '.join(map(repr, TRANSPORTS))}")
    _check_group(src_group, plan.src, "source")
    _check_group(dst_group, plan.dst, "destination")
    direct = _direct_pairs(src_group, dst_group, plan, transport)
    run = _run(src_group, dst_group, plan, direct)
    runs = [run]
    refused = {(r, d): why for d, g in enumerate(run.got) for r, why in g["refused"].items()}
    if refused:
        _note_refused(src_group, dst_group, refused)
        transfers = [t for t in plan.transfers if not t.local and (t.src_rank, t.dst_rank) in refused]
        again = ReshardPlan(plan.src, plan.dst, plan.params, plan.dst_params, transfers, colocated=plan.colocated)
        runs.append(_run(src_group, dst_group, again, frozenset()))
    start, end = run.start, runs[-1].end
    received = sum(g["bytes"] for r in runs for g in r.got)
    if received != plan.bytes_moved:
        raise ReshardError(f"destinations received {received} bytes, the plan moves {plan.bytes_moved}")
    sent_at = max((s["end"] for s in run.sent), default=start)
    copy_s = max((sum(r.got[d]["copy_s"] for r in runs) for d in range(plan.dst.world_size)), default=0.0)
    timeline = tuple(("send", r, s["start"] - start, s["end"] - start, s["put_s"]) for r, s in enumerate(run.sent)) + tuple(
        ("recv", d, g["start"] - start, g["copy_s"], g["end"] - start) for d, g in enumerate(run.got))
    return ReshardStats(plan.bytes_moved, plan.bytes_local, sum(r.n_objects for r in runs), sent_at - start, end - sent_at,
                        sum(r.bytes_put for r in runs), copy_s, timeline,
                        bytes_direct=sum(g["bytes_direct"] for r in runs for g in r.got), refused=len(refused),
                        copy_cpu_s=sum(g["copy_cpu_s"] for r in runs for g in r.got))


_warned_refused = False


def _note_refused(src_group: Any, dst_group: Any, refused: dict[tuple[int, int], str]) -> None:
    """Remember pairs whose direct read was refused; warn once per controller process."""
    global _warned_refused
    try:
        src_info, dst_info = src_group.node_info, dst_group.node_info
        for r, d in refused:
            _REFUSED.add((src_info[r]["node_id"], src_info[r]["pid"], dst_info[d]["pid"]))
    except AttributeError:
        pass
    (r, d), why = next(iter(sorted(refused.items())))
    if not _warned_refused:
        _warned_refused = True
        logger.warning("reshard: %d same-node pair(s) could not read each other's memory directly (e.g. destination "
                       "rank %d from source rank %d: %s); they go through the object store instead. "
                       "Pass transport='store' to skip the attempt; see rankmesh.peermem for when the kernel refuses.",
                       len(refused), d, r, why)
    else:
        logger.debug("reshard: %d pair(s) refused direct reads; sent through the object store", len(refused))


def plan_between(
    src_group: Any,
    dst_group: Any,
    colocated: bool = False,
    names: Iterable[str] | None = None,
    src_mesh: RankMesh | None = None,
    dst_mesh: RankMesh | None = None,
) -> ReshardPlan:
    """Ask both groups for their parameter layouts and plan the reshard between their meshes.

    ``names`` restricts the plan to some parameters (e.g. leave out a value head the destination
    lacks); otherwise both sides must hold the same parameters.  ``src_mesh`` / ``dst_mesh``: a
    role whose layout follows one of its group's named meshes (see ``ReshardWorker.reshard_mesh``).
    """
    src_mesh, dst_mesh = src_mesh or src_group.mesh, dst_mesh or dst_group.mesh
    src = merge_layouts(src_group.param_layouts(), src_mesh.size("pp"))
    dst = merge_layouts(dst_group.param_layouts(), dst_mesh.size("pp"))
    if names is not None:
        keep = set(names)
        src, dst = [p for p in src if p.name in keep], [p for p in dst if p.name in keep]
    only_src = sorted({p.name for p in src} - {p.name for p in dst})
    only_dst = sorted({p.name for p in dst} - {p.name for p in src})
    if only_src or only_dst:
        raise ReshardError(
            f"the groups hold different parameters (only source: {only_src[:5]}, only destination: {only_dst[:5]}); "
            "pass names=[...] to reshard the common ones"
        )
    return plan_reshard(src, src_mesh, dst_mesh, dst_layouts=dst, colocated=colocated)
