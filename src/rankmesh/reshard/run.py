"""Run a ReshardPlan between two worker groups: per-rank jobs, the groups' one call path, and the stats.

Why the controller moves only jobs and handles: each source rank puts its outgoing regions into
its backend's objects once (regions several destination replicas read are put once for all of
them), and each destination fetches what it needs, source by source as the sources finish
(:class:`~rankmesh.reshard.worker.ReshardWorker`).  The sends are one non-blocking
``src_group.call_ranks("reshard_send", ...)``; the receives one blocking
``dst_group.call_ranks("reshard_recv", ...)`` given the sends' pending handles, submitted right
after, so no round trip through the controller separates the two phases.  Both are ordinary
group calls: a trace shows them (with the bytes each rank put and wrote), timeouts and hang
reports apply, and a rank death goes to the groups' ``on_rank_death`` policy (a dead destination
rank: the destination group replaces it and retries the receives; a dead source rank: the
reshard runs once more, after its group replaced it).

Same node, one copy (``transport="auto"``, the default): when a source and a destination rank
run on the same node (the groups' ``node_info``; in-process groups have none), the destination
reads their regions straight from the source process (``process_vm_readv``,
:mod:`rankmesh.peermem`); pairs on different nodes use the store.  A pair whose read the kernel
refuses (another user, Yama, seccomp, another pid namespace) is sent again through the store,
with one warning per :class:`ReshardSession`, and later calls send it by the store directly.
``transport="store"`` sends everything through the store.

Same GPU, no host copy (``transport="auto"`` or ``"cuda_ipc"``): when a source and a
destination rank hold their tensors on the same physical GPU (colocated roles sharing it through
fractional bundles, as verl's hybrid engine runs trainer and rollout), the source shares its
tensors as CUDA IPC handles and the destination copies each region device-to-device into its
parameter.  The controller asks every rank where its tensors are (``reshard_place``, one small
call per group, made only when some pair could use IPC) and picks each pair's route with
:func:`pair_route`, a pure rule: the GPU's UUID, not its visible-device number, says "same GPU".

Colocated plans (both roles in the same processes) keep local regions out of the store: the
source role leaves views of its tensors in its process's outbox, and the destination role of
that process copies from them.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from rankmesh.errors import ReshardError, WorkerDiedError
from rankmesh.mesh import RankMesh
from rankmesh.reshard.plan import ReshardPlan, Transfer, merge_layouts, plan_reshard
from rankmesh.validate import is_int
from rankmesh.reshard.worker import (DirectRead, ObjectRead, RecvJob, RecvResult, Region, SendJob, SendResult,
                                     TensorPlace)

logger = logging.getLogger(__name__)

#: ``reshard(transport=...)``: ``auto`` copies regions between tensors on one GPU through CUDA IPC,
#: reads other same-node regions straight from the source process (``process_vm_readv``,
#: :mod:`rankmesh.peermem`) and sends the rest through the object store; ``store`` sends
#: everything through the object store; ``cuda_ipc`` sends everything through CUDA IPC, and is an
#: error for any pair whose two tensors are not on one GPU.
TRANSPORTS = ("auto", "store", "cuda_ipc")

#: A (source rank, destination rank) pair.
Pair = tuple[int, int]

#: How one pair's regions travel (:func:`pair_route`).
ROUTES = ("ipc", "direct", "store")


def pair_route(transport: str, pair: Pair, same_node: bool, src: TensorPlace | None, dst: TensorPlace | None,
               refused: bool = False) -> str:
    """How the regions of ``pair`` (source rank, destination rank) travel: ``"ipc"``, ``"direct"`` or ``"store"``.

    ``same_node``: both processes on one node; ``src``/``dst``: where their tensors are (None:
    not asked); ``refused``: an earlier direct read or IPC open of this pair failed.  IPC needs
    both tensors on one CUDA device by UUID and two processes (a process cannot open its own
    handle).  ``transport="cuda_ipc"`` raises :class:`ReshardError` naming the pair when it cannot.
    """
    on_one_gpu = (same_node and src is not None and dst is not None and src.gpu_uuid is not None
                  and src.gpu_uuid == dst.gpu_uuid and src.pid != dst.pid)
    if transport == "cuda_ipc":
        if not on_one_gpu:
            where = (f"source on {src.device if src else 'an unknown device'} (GPU {src.gpu_uuid if src else None}, "
                     f"pid {src.pid if src else None}), destination on {dst.device if dst else 'an unknown device'} "
                     f"(GPU {dst.gpu_uuid if dst else None}, pid {dst.pid if dst else None})"
                     + ("" if same_node else ", on different nodes"))
            raise ReshardError(f"reshard(transport='cuda_ipc'): source rank {pair[0]} -> destination rank {pair[1]} "
                               f"cannot use CUDA IPC: {where}; both tensors must be on one GPU in two processes "
                               "of one node. Pass transport='auto' to route such pairs by memory read or the store")
        return "ipc"
    if transport == "store" or not same_node or refused:
        return "store"
    return "ipc" if on_one_gpu else "direct"


@dataclass
class ReshardSession:
    """What reshards into one destination group remember between calls (held by that group).

    ``refused``: (node id, source pid, destination pid) of pairs whose direct read the kernel
    refused: later reshards send them through the store at once.  ``warned``: the refusal
    warning was logged (once per session).
    """

    refused: set[tuple[str, int, int]] = field(default_factory=set)
    warned: bool = False

    @classmethod
    def of(cls, group: Any) -> "ReshardSession":
        """The session of reshards into ``group`` (made on the first one)."""
        if group.reshard_session is None:
            group.reshard_session = cls()
        return group.reshard_session

    def routes(self, src_group: Any, dst_group: Any, plan: ReshardPlan, transport: str) -> dict[str, frozenset[Pair]]:
        """The pairs of ``plan`` that go ``"ipc"`` and ``"direct"`` (:func:`pair_route`; the rest use the store).

        Asks both groups where their tensors are (``reshard_place``) only when a pair could use IPC."""
        src_info, dst_info = src_group.node_info, dst_group.node_info
        pairs = sorted({(t.src_rank, t.dst_rank) for t in plan.transfers if not t.local})
        if src_info is None or dst_info is None:
            if transport == "cuda_ipc" and pairs:
                raise ReshardError("reshard(transport='cuda_ipc'): the groups run in this process (no node_info), and "
                                   "CUDA IPC needs the source and destination in two processes: use Ray worker groups")
            return {"ipc": frozenset(), "direct": frozenset()}
        same = {p: src_info[p[0]]["node_id"] == dst_info[p[1]]["node_id"] for p in pairs}
        src_places = dst_places = None
        if transport == "cuda_ipc" or (transport == "auto" and any(same.values())):
            src_places, dst_places = ask_places(src_group, dst_group, plan)
        out: dict[str, set[Pair]] = {"ipc": set(), "direct": set(), "store": set()}
        for r, d in pairs:
            s, t = src_info[r], dst_info[d]
            refused = (s["node_id"], s["pid"], t["pid"]) in self.refused
            out[pair_route(transport, (r, d), same[r, d], src_places[r] if src_places else None,
                           dst_places[d] if dst_places else None, refused)].add((r, d))
        return {"ipc": frozenset(out["ipc"]), "direct": frozenset(out["direct"])}

    def note_refused(self, src_group: Any, dst_group: Any, refused: dict[Pair, str]) -> None:
        """Remember pairs whose direct read was refused; warn once per session."""
        src_info, dst_info = src_group.node_info, dst_group.node_info
        if src_info is not None and dst_info is not None:
            for r, d in refused:
                self.refused.add((src_info[r]["node_id"], src_info[r]["pid"], dst_info[d]["pid"]))
        (r, d), why = next(iter(sorted(refused.items())))
        if self.warned:
            logger.debug("reshard: %d pair(s) refused direct reads; sent through the object store", len(refused))
            return
        self.warned = True
        logger.warning("reshard: %d same-node pair(s) could not read each other's memory directly (e.g. destination "
                       "rank %d from source rank %d: %s); they go through the object store instead. "
                       "Pass transport='store' to skip the attempt; see rankmesh.peermem for when the kernel refuses.",
                       len(refused), d, r, why)


def ask_places(src_group: Any, dst_group: Any, plan: ReshardPlan) -> tuple[list[TensorPlace], list[TensorPlace]]:
    """Every source and destination rank's :class:`TensorPlace` (both groups asked at once)."""
    pending = [g.call_ranks("reshard_place", [()] * mesh.world_size, blocking=False)
               for g, mesh in ((src_group, plan.src), (dst_group, plan.dst))]
    src, dst = (list(future.get()) for future in pending)
    return src, dst


@dataclass(frozen=True)
class ReshardStats:
    """What one :func:`reshard` call moved, and how long its phases took.

    ``send_s``: from the call's start until the last source has put its objects (or published
    its tensors, for direct reads); ``recv_s``: the
    rest of the call (the receives were submitted with the sends and start as soon as their
    sources' puts exist, so part of the receiving overlaps ``send_s``).  ``copy_s``: the longest
    time one destination spent copying its regions into place (after its fetch, or reading
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
    #: put)`` and ``("recv", rank, started, seconds copying, finished)`` (for benchmarks).
    timeline: tuple[tuple[Any, ...], ...] = ()
    #: Bytes destinations read straight from a source process on their node (``transport="auto"``);
    #: the rest of ``bytes_moved`` went through the object store.
    bytes_direct: int = 0
    #: (source, destination) pairs whose direct read the kernel refused (sent by the store instead).
    refused: int = 0
    #: CPU seconds all destinations spent copying into place, summed (unlike ``copy_s``, not
    #: stretched by other processes competing for the cores).
    copy_cpu_s: float = 0.0
    #: Bytes destinations copied device-to-device from a source's CUDA IPC handle (same GPU).
    bytes_ipc: int = 0

    @property
    def seconds(self) -> float:
        return self.send_s + self.recv_s


def _check_group(group: Any, mesh: RankMesh, side: str) -> None:
    if mesh not in group.meshes.values():
        raise ReshardError(f"the plan's {side} mesh is {mesh!r} but the {side} group's is {group.mesh!r}; plan again")
    for method in ("reshard_send", "reshard_recv"):
        if method not in group.method_names:
            raise ReshardError(f"the {side} group's workers have no registered {method}: derive them from ReshardWorker")


def _objects_of(plan: ReshardPlan, src_rank: int, direct: frozenset[Pair]
                ) -> list[tuple[tuple[Region, ...], dict[int, tuple[Region, ...]]]]:
    """``src_rank``'s objects: (regions to put, destination -> where each region goes), in put order;
    ``direct``: every pair that does not use the store (direct reads and IPC).

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
        regions = tuple((name, readers[(name, bounds)][min(dsts)].src_slices) for name, bounds in keys)
        places = {d: tuple((readers[k][d].name, readers[k][d].dst_slices) for k in keys) for d in sorted(dsts)}
        out.append((regions, places))
    return out


def _direct_regions(plan: ReshardPlan, src_rank: int, direct: frozenset[Pair]) -> tuple[tuple[Region, ...], dict[int, list[DirectRead]]]:
    """``src_rank``'s regions read straight from its process: (name, source slices) each once, and
    per destination the reads of them it makes."""
    index: dict[tuple, int] = {}
    regions: list[Region] = []
    reads: dict[int, list[DirectRead]] = {}
    for t in plan.sends(src_rank):
        if t.local or (t.src_rank, t.dst_rank) not in direct:
            continue
        key = (t.name, tuple((sl.start, sl.stop) for sl in t.src_slices))
        if key not in index:
            index[key] = len(regions)
            regions.append((t.name, t.src_slices))
        reads.setdefault(t.dst_rank, []).append(DirectRead(src_rank, index[key], t.src_slices, t.name, t.dst_slices))
    return tuple(regions), reads


@dataclass(frozen=True)
class Jobs:
    """Every rank's job of one run of a plan, and what the sources will put."""

    sends: tuple[SendJob, ...]
    recvs: tuple[RecvJob, ...]
    n_objects: int
    bytes_put: int


def build_jobs(plan: ReshardPlan, direct: frozenset[Pair], version: int | None = None, ipc: frozenset[Pair] = frozenset(),
               ipc_required: bool = False, wait_s: float | None = None) -> Jobs:
    """The send job of every source rank and the receive job of every destination rank (pure).

    ``direct`` / ``ipc``: the pairs read straight from the source process / through CUDA IPC
    handles (the rest use the store).  ``version``: the weight version each destination rank holds
    once its job is done; ``ipc_required``: an IPC handle that will not open is an error;
    ``wait_s``: how long a destination rank waits for its sources (``RecvJob.wait_s``)."""
    token = uuid.uuid4().hex
    sends = []
    objects: list[list[ObjectRead]] = [[] for _ in range(plan.dst.world_size)]
    reads: list[list[DirectRead]] = [[] for _ in range(plan.dst.world_size)]
    ipc_reads: list[list[DirectRead]] = [[] for _ in range(plan.dst.world_size)]
    bytes_put = n_objects = 0
    for r in range(plan.src.world_size):
        put = _objects_of(plan, r, direct | ipc)
        n_objects += len(put)
        bytes_put += sum(math.prod(s.stop - s.start for s in sl) * plan.params[name].itemsize
                         for regions, _ in put for name, sl in regions)
        for i, (_, places) in enumerate(put):
            for d, regions in places.items():
                objects[d].append(ObjectRead(r, i, regions))
        regions, by_dst = _direct_regions(plan, r, direct)
        for d, items in by_dst.items():
            reads[d] += items
        shared, by_dst = _direct_regions(plan, r, ipc)
        for d, items in by_dst.items():
            ipc_reads[d] += items
        local = tuple((t.name, t.src_slices) for t in plan.sends(r) if t.local)
        sends.append(SendJob(token, tuple(regions for regions, _ in put), regions, local, shared))
    recvs = tuple(
        RecvJob(token, tuple(objects[d]), tuple(reads[d]), tuple((t.name, t.dst_slices) for t in plan.receives(d) if t.local),
                version, tuple(ipc_reads[d]), ipc_required, wait_s)
        for d in range(plan.dst.world_size)
    )
    return Jobs(tuple(sends), recvs, n_objects, bytes_put)


@dataclass(frozen=True)
class _Run:
    sent: Sequence[SendResult]
    got: Sequence[RecvResult]
    start: float
    end: float
    n_objects: int
    bytes_put: int


def _run(src_group: Any, dst_group: Any, plan: ReshardPlan, direct: frozenset[Pair], version: int | None,
         ipc: frozenset[Pair] = frozenset(), ipc_required: bool = False) -> _Run:
    """Submit every send and receive of ``plan`` at once and wait for them (``direct`` pairs read by
    pid, ``ipc`` pairs through CUDA IPC handles)."""
    jobs = build_jobs(plan, direct, version, ipc, ipc_required, dst_group.call_timeout_s)
    start = time.time()
    sends = src_group.call_ranks("reshard_send", [(job,) for job in jobs.sends], blocking=False)
    try:
        # The sends' handles travel inside one stored list, so a receive does not wait for every
        # send before it starts: each destination copies from each source as soon as it has put.
        handles = list(sends.handles)
        try:
            got = dst_group.call_ranks("reshard_recv", [(job, handles) for job in jobs.recvs])
        except BaseException:
            sends.get()  # a failed send is the first error (the receives failed waiting for it)
            raise
        sent = sends.get()
    except BaseException:
        if any(job.local for job in jobs.sends):  # views a colocated send left behind would pin the tensors
            try:
                src_group.reshard_drop(jobs.sends[0].token)
            except Exception:  # noqa: BLE001 - the first error is the one to report
                logger.warning("reshard %s failed and its colocated regions could not be dropped", jobs.sends[0].token,
                               exc_info=True)
        raise
    # Regions of device tensors planned as direct reads went by the store after all (reshard_send).
    n_objects = jobs.n_objects + sum(len(s.fallback) for s in sent)
    bytes_put = jobs.bytes_put + sum(s.fallback_bytes for s in sent)
    return _Run(sent, got, start, time.time(), n_objects, bytes_put)


def _replaces(group: Any) -> bool:
    """Whether ``group`` replaces dead ranks itself (``on_rank_death="replace"``; Ray groups only have a policy)."""
    return getattr(group, "on_rank_death", None) == "replace"


def reshard(
    src_group: Any,
    dst_group: Any,
    plan: ReshardPlan,
    transport: str = "auto",
    session: ReshardSession | None = None,
    version: int | None = None,
) -> ReshardStats:
    """Move the weights of ``src_group`` into ``dst_group`` as ``plan`` says; only jobs and handles pass here.

    The sends and the receives are submitted together: each receive gets the handles of the
    send calls, waits for the ones it reads from and copies from each source as soon as that
    source has put its objects (or published its tensors), without a round trip through the
    controller between the phases.

    ``transport``: ``"auto"`` (default) copies each region whose source and destination tensors
    are on the same physical GPU (two processes, e.g. colocated on fractional GPU bundles)
    device-to-device through a CUDA IPC handle of the source's tensor (no host copy); reads each
    other region whose ranks run on the same node straight out of the source process into the
    destination's parameter (``process_vm_readv``: one copy, no object store; CPU source
    tensors), and sends the others through the object store; ``"store"`` sends everything
    through the object store; ``"cuda_ipc"`` sends everything through CUDA IPC and raises
    :class:`ReshardError` naming the first pair that is not on one GPU.  A CUDA IPC handle that
    will not open under ``"auto"`` is treated like a refused read (below).  A direct
    read the kernel refuses (another user, Yama, seccomp, another pid namespace) is not an error:
    that pair's regions go through the store in a second round, a warning is logged once per
    ``session``, and later calls send that pair by the store at once.  ``session`` (default: the
    destination group's, :meth:`ReshardSession.of`) holds that memory.

    A rank that dies during the call is handled by its group's ``on_rank_death`` policy: with
    ``"replace"``, the dead ranks are replaced and the reshard runs once more (a destination
    group retries its receives itself; a source death reruns the whole reshard).

    Blocking: it returns only after every destination has its regions.  The sources' tensors must
    not change (nor be freed) until then, since destinations read them in place.

    ``version``: the weight version the destination holds afterwards (``None``: the source's,
    ``src_group.weight_version``).  Every destination rank learns it (``Worker.weight_version``,
    which ``stamp_weight_version`` writes into generated rows) and the destination group records
    it for the replicas refitted (``dst_group.weight_versions``).  ``dst_group`` may be a replica
    view (``rollout.replica(i)``): a rolling refit, which moves that replica's bytes alone while
    the other replicas go on generating.
    """
    if transport not in TRANSPORTS:
        raise ReshardError(f"reshard(transport={transport!r}): expected one of {', '.join(map(repr, TRANSPORTS))}")
    _check_group(src_group, plan.src, "source")
    _check_group(dst_group, plan.dst, "destination")
    session = session or ReshardSession.of(dst_group)
    if version is None:
        held = sorted(set(src_group.weight_versions))
        if len(held) != 1:
            raise ReshardError(f"reshard: the source's replicas hold weight versions {held}; pass version=... for the destination")
        version = held[0]
    elif not is_int(version) or version < 0:
        raise ReshardError(f"reshard(version={version!r}): expected a weight version >= 0 (or None: the source's)")
    try:
        stats = _reshard(src_group, dst_group, plan, transport, session, version)
    except WorkerDiedError as err:
        if not (_replaces(src_group) or _replaces(dst_group)):
            raise
        # The next call of the group that lost the rank replaces it first (its _call), then runs.
        logger.warning("reshard: %s; running it once more after the dead ranks are replaced", err)
        stats = _reshard(src_group, dst_group, plan, transport, session, version)
    dst_group.weight_version = version
    return stats


def _reshard(
    src_group: Any, dst_group: Any, plan: ReshardPlan, transport: str, session: ReshardSession, version: int
) -> ReshardStats:
    routes = session.routes(src_group, dst_group, plan, transport)
    run = _run(src_group, dst_group, plan, routes["direct"], version, routes["ipc"], transport == "cuda_ipc")
    runs = [run]
    refused = {(r, d): why for d, g in enumerate(run.got) for r, why in g.refused.items()}
    if refused:
        session.note_refused(src_group, dst_group, refused)
        transfers = [t for t in plan.transfers if not t.local and (t.src_rank, t.dst_rank) in refused]
        again = ReshardPlan(plan.src, plan.dst, plan.params, plan.dst_params, transfers, colocated=plan.colocated)
        runs.append(_run(src_group, dst_group, again, frozenset(), version))
    start, end = run.start, runs[-1].end
    received = sum(g.received for r in runs for g in r.got)
    if received != plan.bytes_moved:
        raise ReshardError(f"destinations received {received} bytes, the plan moves {plan.bytes_moved}")
    ipc_planned = sum(t.nbytes for t in plan.transfers if (t.src_rank, t.dst_rank) in routes["ipc"]
                      and (t.src_rank, t.dst_rank) not in refused)
    ipc_got = sum(g.bytes_ipc for g in run.got)
    if ipc_got != ipc_planned:
        raise ReshardError(f"destinations copied {ipc_got} bytes through CUDA IPC, the plan routes {ipc_planned} that way")
    sent_at = max((s.end for s in run.sent), default=start)
    copy_s = max((sum(r.got[d].copy_s for r in runs) for d in range(plan.dst.world_size)), default=0.0)
    timeline = tuple(("send", r, s.start - start, s.end - start, s.put_s) for r, s in enumerate(run.sent)) + tuple(
        ("recv", d, g.start - start, g.copy_s, g.end - start) for d, g in enumerate(run.got))
    return ReshardStats(plan.bytes_moved, plan.bytes_local, sum(r.n_objects for r in runs), sent_at - start, end - sent_at,
                        sum(r.bytes_put for r in runs), copy_s, timeline,
                        bytes_direct=sum(g.bytes_direct for r in runs for g in r.got), refused=len(refused),
                        copy_cpu_s=sum(g.copy_cpu_s for r in runs for g in r.got),
                        bytes_ipc=ipc_got)


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
