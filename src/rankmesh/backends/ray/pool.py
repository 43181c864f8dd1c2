"""Resource pools: placement groups that reserve one bundle per worker process, node by node.

A pool reserves ``process_on_nodes[i]`` bundles in one STRICT_PACK placement group per entry (so
each entry's processes share a node), waits a bounded time for Ray to place them, and then fixes
the rank order once:

* placement groups are ordered by the node they landed on, by *numeric* IP address (verl sorts
  the strings, so 10.0.0.10 comes before 10.0.0.9), ties (several nodes on one IP, as in a
  simulated cluster) broken by Ray node id (hex string order), then by entry order;
* ranks run through the bundles of each group in order.

Placement groups that land on the same node count as one node: LOCAL_RANK and LOCAL_WORLD_SIZE
describe the processes of the group on that physical node, as torchrun would.  Entries may have
different sizes (heterogeneous nodes); :attr:`RayResourcePool.placement` tells what was granted.

Connecting: a pool is what first needs Ray, so it is the pool that starts the embedded Ray when
no cluster is given (:meth:`RayResourcePool.connect`), declaring at least the logical CPUs the
pool reserves.  Ray's CPU counts are scheduling tokens, not cores: on a 2-core laptop, a pool of
8 CPU worker processes is a normal development setup (the processes share the cores), and a
bare ``ray.init()`` (as many CPUs as cores) would leave it unplaceable.  A Ray that is already
running, or a cluster joined by address, is never resized: there a pool that does not fit fails
with :class:`ResourcePoolError`.
"""

from __future__ import annotations

import bisect
import contextlib
import ipaddress
import itertools
import logging
import math
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from rankmesh.errors import PlacementError, ResourcePoolError
from rankmesh.placement import Placement, RankPlace
from rankmesh.validate import node_labels as validate_labels

from .runtime import RayConnection, alive_nodes, ensure_ray, raylet_pids

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT = 60.0
"""Seconds a pool waits for Ray to place its placement groups before failing."""

FIT_CHECK_S = 1.0
"""Seconds after which a pool on a Ray this process started checks whether it can fit at all.

Such a Ray (the embedded one, or the caller's own ``ray.init()``) has no autoscaler and no other
driver, so a pool that does not fit its free resources then never will: it fails at once with
what is free and how to size the Ray, instead of after :data:`DEFAULT_READY_TIMEOUT`.  A pool on
a cluster joined by address waits the whole timeout (nodes may join).
"""


@dataclass(frozen=True)
class Slot:
    """One bundle of a pool, i.e. where one rank of a group runs."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    entry: int  # index into the requested process_on_nodes
    bundle_index: int
    node_id: str
    node_ip: str


def node_sort_key(ip: str, node_id: str) -> tuple:
    """Numeric IP order (v4 before v6), then node id; unparsable addresses sort last by text."""
    try:
        addr = ipaddress.ip_address(ip)
        return (addr.version, int(addr), ip, node_id)
    except ValueError:
        return (99, 0, ip, node_id)


def _check_counts(process_on_nodes: Sequence[int]) -> tuple[int, ...]:
    try:
        return Placement(process_on_nodes).process_on_nodes
    except PlacementError as exc:
        raise ResourcePoolError(str(exc)) from exc


class RayResourcePool:
    """Bundles of ``{"CPU": max_colocate_count, "GPU": 1}`` (GPU only with ``use_gpu``), one per process.

    ``max_colocate_count`` is how many worker groups may share each bundle (each actor asks for
    1 CPU and ``1 / max_colocate_count`` GPU).  Placement groups are created on first use
    (:meth:`slots`), and removed when the last worker group using them shuts down
    (:meth:`release`) or on :meth:`remove`.  ``detached=True`` makes them outlive the driver.

    Bundles always hold whole CPUs, so the accounting is the same on a laptop and on a cluster.
    What adapts is the embedded Ray: when no Ray is running and no address is given, the first
    use of the pool starts one with ``max(cores, reserved_cpus)`` logical CPUs (see
    :meth:`connect`), so ``RayResourcePool([8], use_gpu=False)`` places on a 2-core machine.
    GPUs are never invented: a ``use_gpu=True`` pool needs GPUs that exist.

    ``spares=N`` reserves N more bundles, spread over the nodes, that belong to no rank: each
    worker group on the pool that replaces dead ranks (``on_rank_death`` ``"keep"`` or
    ``"replace"``) keeps a warm standby process in each, which takes a dead rank's place in a
    fraction of the time a new process needs (:mod:`.spares`).  Views made by
    :func:`split_resource_pool` and :func:`merge_resource_pool` carry no spares.  ``node_labels``
    selects the nodes of every bundle; ``spare_labels`` (default: ``node_labels``) those of the
    standby bundles, e.g. to keep the spares on nodes of their own, where a node's loss never
    takes a rank and its spares at once.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = True,
        max_colocate_count: int = 1,
        name_prefix: str | None = None,
        detached: bool = False,
        ready_timeout: float = DEFAULT_READY_TIMEOUT,
        accelerator_type: str | None = None,
        node_labels: Mapping[str, str] | None = None,
        spares: int = 0,
        spare_labels: Mapping[str, str] | None = None,
    ) -> None:
        self._counts = _check_counts(process_on_nodes)
        if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
            raise ResourcePoolError(f"spares must be a non-negative integer (standby bundles), got {spares!r}")
        self.spares = spares
        self.node_labels = validate_labels(node_labels, "node_labels", ResourcePoolError)
        self.spare_labels = (self.node_labels if spare_labels is None
                             else validate_labels(spare_labels, "spare_labels", ResourcePoolError))
        if spare_labels is not None and not spares:
            raise ResourcePoolError(f"spare_labels={dict(spare_labels)} says where standby bundles go, but the pool "
                                    "keeps none: give spares=N too, or leave spare_labels out")
        if isinstance(max_colocate_count, bool) or not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ResourcePoolError(f"max_colocate_count must be a positive integer, got {max_colocate_count!r}")
        if ready_timeout is not None and ready_timeout <= 0:
            raise ResourcePoolError(f"ready_timeout must be positive, got {ready_timeout!r}")
        self.use_gpu = bool(use_gpu)
        self.max_colocate_count = max_colocate_count
        self.name_prefix = name_prefix if name_prefix is not None else f"rankmesh-pool-{uuid.uuid4().hex[:8]}"
        self.detached = bool(detached)
        self.ready_timeout = ready_timeout
        self.accelerator_type = accelerator_type
        self._lock = threading.RLock()
        self._slots: list[Slot] | None = None
        self._spare_slots: list[Slot] = []
        self._pgs: list[Any] = []
        self._users = 0
        self._groups_on = [0] * sum(self._counts)  # worker groups on each bundle (root pools only)
        # Rank r of this pool is bundle _members[r][1] of root pool _members[r][0]: a root pool
        # lists its own bundles; split_resource_pool and merge_resource_pool make views that list
        # their roots' (one root sliced, or several roots one after the other).
        self._members: tuple[tuple[RayResourcePool, int], ...] = tuple((self, i) for i in range(sum(self._counts)))

    # ----- description -------------------------------------------------------------------------

    @property
    def process_on_nodes(self) -> list[int]:
        """The process counts requested per node entry."""
        return list(self._counts)

    store = process_on_nodes  # verl's name

    @property
    def world_size(self) -> int:
        return sum(self._counts)

    @property
    def reserved_cpus(self) -> float:
        """Logical CPUs the whole pool reserves (every bundle of its root pools, views included, spares too)."""
        return sum((sum(root._counts) + root.spares) * root.bundle["CPU"] for root in self._roots())

    def _roots(self) -> list[RayResourcePool]:
        """The root pools whose bundles this pool's ranks use, in rank order (itself for a root)."""
        return list(dict.fromkeys(root for root, _ in self._members))

    @contextlib.contextmanager
    def _locked(self):
        """Hold every root's lock (in one fixed order, so two views over the same roots cannot deadlock)."""
        with contextlib.ExitStack() as stack:
            for root in sorted(self._roots(), key=id):
                stack.enter_context(root._lock)
            yield

    @property
    def bundle(self) -> dict[str, float]:
        """Resources of one bundle."""
        bundle: dict[str, float] = {"CPU": float(self.max_colocate_count)}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle

    @property
    def actor_resources(self) -> dict[str, float]:
        """Ray options of one actor inside a bundle (its share of the bundle)."""
        opts: dict[str, float] = {"num_cpus": 1.0}
        if self.use_gpu:
            opts["num_gpus"] = 1.0 / self.max_colocate_count
        return opts

    def __repr__(self) -> str:
        state = "placed" if all(root._slots is not None for root in self._roots()) else "not placed"
        return (
            f"RayResourcePool(process_on_nodes={self.process_on_nodes}, use_gpu={self.use_gpu}, "
            f"max_colocate_count={self.max_colocate_count}, name_prefix={self.name_prefix!r}, {state})"
        )

    # ----- placement ---------------------------------------------------------------------------

    def connect(self) -> RayConnection:
        """Make this process a Ray driver the way the pool needs: an embedded Ray sized for it.

        Already connected, or ``RAY_ADDRESS`` set: as :func:`ensure_ray` (nothing is resized).
        Otherwise the embedded Ray starts with ``max(os.cpu_count(), reserved_cpus)`` logical
        CPUs, so the pool fits on one machine whatever its core count.  Worker groups call this
        before anything else touches Ray; call :func:`ensure_ray` with ``num_cpus=`` yourself
        first to size the embedded Ray for several pools at once.
        """
        cores = os.cpu_count() or 1
        return ensure_ray(num_cpus=max(cores, math.ceil(self.reserved_cpus)))

    def slots(self, timeout: float | None = None) -> list[Slot]:
        """Every bundle in rank order; creates the placement groups on first call."""
        with self._locked():
            for root in self._roots():
                if root._slots is None:
                    root._slots = root._create(root.ready_timeout if timeout is None else timeout)
            return [root._slots[index] for root, index in self._members]

    def spare_slots(self) -> list[Slot]:
        """The standby bundles (``spares``), placed with the others on first use; a view of a pool has none.

        A group on the pool keeps a warm process in each of them (:mod:`.spares`) to take a dead
        rank's place without starting one.
        """
        if self._members != tuple((self, i) for i in range(sum(self._counts))):
            return []
        self.slots()
        return list(self._spare_slots)

    def get_placement_groups(self) -> list[Any]:
        """The placement groups of this pool, in rank (node) order (verl's accessor)."""
        seen: dict[Any, None] = {}
        for slot in self.slots():
            seen.setdefault(slot.pg, None)
        return list(seen)

    @property
    def placement(self) -> Placement:
        """Processes per physical node, in rank order, as granted (places the pool if needed)."""
        return Placement(self._node_counts()[1])

    def node_ids(self) -> list[str]:
        """Ray node id of each node of :attr:`placement`."""
        return self._node_counts()[0]

    def places(self) -> list[RankPlace]:
        """Node index and local rank of every rank of a group on this pool."""
        return self.placement.places()

    def _node_counts(self) -> tuple[list[str], list[int]]:
        ids: list[str] = []
        counts: list[int] = []
        for slot in self.slots():
            if ids and ids[-1] == slot.node_id:
                counts[-1] += 1
            else:
                ids.append(slot.node_id)
                counts.append(1)
        return ids, counts

    def describe(self) -> str:
        """One line per rank: rank, node index, node ip/id, placement group entry and bundle."""
        lines = []
        for place, slot in zip(self.places(), self.slots()):
            lines.append(
                f"rank {place.rank}: node {place.node} ({slot.node_ip} {slot.node_id[:8]}) "
                f"local_rank {place.local_rank}/{place.local_world_size} pg entry {slot.entry} bundle {slot.bundle_index}"
            )
        return "\n".join(lines)

    def _create(self, timeout: float) -> list[Slot]:
        self.connect()
        lifetime = "detached" if self.detached else None
        pgs = [
            placement_group(
                [dict(self.bundle) for _ in range(count)],
                strategy="STRICT_PACK",
                name=f"{self.name_prefix}_pg{i}",
                lifetime=lifetime,
                **({"bundle_label_selector": [dict(self.node_labels)] * count} if self.node_labels else {}),
            )
            for i, count in enumerate(self._counts)
        ]
        readies = [pg.ready() for pg in pgs]
        done, _ = ray.wait(readies, num_returns=len(readies), timeout=min(timeout, FIT_CHECK_S))
        # A Ray this process started has no autoscaler and no other driver: what does not fit now
        # never will, so say so at once instead of after the whole ready_timeout.
        never = len(done) < len(readies) and bool(raylet_pids()) and not self._fits_now(set(done), readies)
        if len(done) < len(readies) and not never:
            done, _ = ray.wait(readies, num_returns=len(readies), timeout=max(0.0, timeout - FIT_CHECK_S))
        done_set = set(done)
        if len(done) < len(readies):
            message = self._unplaced_message(pgs, [r in done_set for r in readies], timeout, never)
            for pg in pgs:
                _remove_pg(pg)
            raise ResourcePoolError(message)
        nodes = alive_nodes()
        placed = []
        for entry, pg in enumerate(pgs):
            table = placement_group_table(pg)
            node_id = table["bundles_to_node_id"][0]
            ip = nodes.get(node_id, {}).get("NodeManagerAddress", "")
            placed.append((node_sort_key(ip, node_id), entry, pg, node_id, ip))
        placed.sort(key=lambda item: (item[0], item[1]))
        self._pgs = [item[2] for item in placed]
        slots = [
            Slot(pg=pg, entry=entry, bundle_index=b, node_id=node_id, node_ip=ip)
            for _, entry, pg, node_id, ip in placed
            for b in range(self._counts[entry])
        ]
        logger.info("resource pool %s placed: %s", self.name_prefix, [(s.node_ip, s.node_id[:8]) for s in slots])
        self._spare_slots = self._create_spares(timeout, nodes)
        return slots

    def _create_spares(self, timeout: float, nodes: Mapping[str, Any]) -> list[Slot]:
        """The ``spares`` standby bundles, one placement group spread over the nodes (best effort).

        Spread, not packed: a spare on each node lets a dead rank be replaced on its own node.
        Entry -1 marks them; they belong to no rank until a group swaps one in (:mod:`.spares`).
        """
        if not self.spares:
            return []
        lifetime = "detached" if self.detached else None
        pg = placement_group(
            [dict(self.bundle) for _ in range(self.spares)],
            strategy="SPREAD",
            name=f"{self.name_prefix}_spares",
            lifetime=lifetime,
            **({"bundle_label_selector": [dict(self.spare_labels)] * self.spares} if self.spare_labels else {}),
        )
        done, _ = ray.wait([pg.ready()], timeout=timeout)
        if not done:
            _remove_pg(pg)
            self._remove_own()
            raise ResourcePoolError(
                f"resource pool {self.name_prefix!r}: its {self.spares} spare bundle(s) of {self.bundle} could not be "
                f"placed{f' on nodes with labels {self.spare_labels}' if self.spare_labels else ''} within {timeout:g} s "
                "(the ranks' bundles were); ask for fewer spares, or declare more "
                "logical CPUs (`rankmesh.backends.ray.ensure_ray(num_cpus=N)` before the first pool, N counting spares)"
            )
        self._pgs.append(pg)
        table = placement_group_table(pg)["bundles_to_node_id"]
        return [
            Slot(pg=pg, entry=-1, bundle_index=b, node_id=table[b], node_ip=nodes.get(table[b], {}).get("NodeManagerAddress", ""))
            for b in range(self.spares)
        ]

    def _fits_now(self, done: set[Any], readies: list[Any]) -> bool:
        """Whether every unplaced entry fits the free resources of some live node right now."""
        try:
            free = ray._private.state.available_resources_per_node()  # noqa: SLF001 - no public per-node view
        except Exception:  # noqa: BLE001 - cannot tell: wait the whole timeout as before
            return True
        for count, ready in zip(self._counts, readies):
            if ready in done:
                continue
            need = {k: v * count for k, v in self.bundle.items()}
            if not any(all(node.get(k, 0) >= v for k, v in need.items()) for node in free.values()):
                return False
        return True

    def _unplaced_message(self, pgs: list[Any], ready: list[bool], timeout: float, never: bool = False) -> str:
        why = ("does not fit the free resources of the Ray this process started (nothing there frees up or joins)"
               if never else f"could not be placed within {timeout:g} s")
        parts = [
            f"resource pool {self.name_prefix!r} (process_on_nodes={list(self._counts)}) {why}; "
            "each node entry needs its bundles on ONE node (STRICT_PACK)."
        ]
        for entry, (pg, ok, count) in enumerate(zip(pgs, ready, self._counts)):
            need = {k: v * count for k, v in self.bundle.items()}
            if ok:
                node = placement_group_table(pg)["bundles_to_node_id"].get(0, "?")
                parts.append(f"  entry {entry}: {count} x {self.bundle} placed on node {str(node)[:8]}")
            else:
                on = f" with labels {self.node_labels}" if self.node_labels else ""
                parts.append(f"  entry {entry}: {count} x {self.bundle} NOT placed (needs {need} on one node{on})")
        try:
            totals = ray._private.state.total_resources_per_node()
            avail = ray._private.state.available_resources_per_node()
            nodes = alive_nodes()
        except Exception as exc:  # pragma: no cover - diagnostics only
            parts.append(f"  (could not read cluster resources: {exc})")
            return "\n".join(parts)
        keys = sorted({k for k in self.bundle} | {"CPU", "GPU"})
        parts.append("  cluster, available/total per node:")
        for node_id in sorted(totals, key=lambda n: node_sort_key(nodes.get(n, {}).get("NodeManagerAddress", ""), n)):
            ip = nodes.get(node_id, {}).get("NodeManagerAddress", "?")
            res = ", ".join(
                f"{k} {avail.get(node_id, {}).get(k, 0):g}/{totals[node_id].get(k, 0):g}" for k in keys
            )
            parts.append(f"    {ip} {node_id[:8]}: {res}")
        parts.append(
            "  to fix: ask for fewer processes per node entry; or declare more logical CPUs (Ray counts CPUs as "
            "scheduling tokens: `ray start --num-cpus N` on a cluster; for the embedded Ray, which the first pool "
            "sizes for itself, `rankmesh.backends.ray.ensure_ray(num_cpus=N)` before the first pool, N = the "
            "processes of all pools together); GPUs must exist (use_gpu=False runs on CPU)."
        )
        return "\n".join(parts)

    # ----- lifetime ----------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse, before any actor starts, a worker group that would not fit this pool's bundles.

        Each group's actor takes 1 CPU (and ``1 / max_colocate_count`` GPU) of its bundle, so a
        bundle holds ``max_colocate_count`` groups; one more would wait for its actors forever.
        """
        with self._locked():
            held = max((root._groups_on[i] for root, i in self._members), default=0)
        if held >= self.max_colocate_count:
            raise ResourcePoolError(
                f"resource pool {self.name_prefix!r}: its bundles already hold {held} worker group(s), as many as "
                f"max_colocate_count={self.max_colocate_count} allows (each group's actor takes 1 CPU"
                f"{' and 1/' + str(self.max_colocate_count) + ' GPU' if self.use_gpu else ''} of a bundle); create "
                f"the pool with max_colocate_count={held + 1} or more to run another group on the same bundles "
                "(verl's default is 10), or put the roles into one process with create_colocated_worker_cls"
            )

    def acquire(self) -> None:
        """Note one more worker group using this pool's placement groups (and its bundles)."""
        with self._locked():
            for root, i in self._members:
                root._groups_on[i] += 1
            for root in self._roots():
                root._users += 1

    def release(self) -> None:
        """A worker group stopped using the pool; the last one out of a root removes its placement groups."""
        with self._locked():
            for root, i in self._members:
                root._groups_on[i] = max(0, root._groups_on[i] - 1)
            for root in self._roots():
                root._users = max(0, root._users - 1)
                if root._users == 0:
                    root._remove_own()

    def remove(self) -> None:
        """Remove the placement groups now (actors inside them die); the next use places anew."""
        with self._locked():
            for root in self._roots():
                root._remove_own()

    def _remove_own(self) -> None:
        for pg in self._pgs:
            _remove_pg(pg)
        self._pgs = []
        self._slots = None
        self._spare_slots = []


def _remove_pg(pg: Any) -> None:
    try:
        remove_placement_group(pg)
    except Exception as exc:  # already removed, or Ray is gone
        logger.debug("removing placement group %s: %s", pg.id, exc)


def split_resource_pool(pool: RayResourcePool, split_size: int | Sequence[int]) -> list[RayResourcePool]:
    """Carve ``pool`` into consecutive sub-pools of ``split_size`` processes (one int or a list).

    The sub-pools share the parent's placement groups (created once, on first use of any of
    them) and keep its rank order; each sub-pool's ranks start at 0.
    """
    total = pool.world_size
    if isinstance(split_size, bool):
        raise ResourcePoolError(f"split_size must be an int or a list of ints, got {split_size!r}")
    if isinstance(split_size, int):
        if split_size <= 0 or total % split_size:
            raise ResourcePoolError(f"split_size {split_size} does not divide the pool's {total} processes")
        sizes = [split_size] * (total // split_size)
    else:
        sizes = list(split_size)
        if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
            raise ResourcePoolError(f"split sizes must be positive integers, got {split_size!r}")
        if sum(sizes) != total:
            raise ResourcePoolError(f"split sizes {sizes} sum to {sum(sizes)}, but the pool has {total} processes")
    views = []
    offset = 0
    for size in sizes:
        members = pool._members[offset : offset + size]
        views.append(_view(pool, members, _entry_counts(members)))
        offset += size
    return views


def merge_resource_pool(rp1: RayResourcePool, rp2: RayResourcePool) -> RayResourcePool:
    """One pool whose ranks are ``rp1``'s followed by ``rp2``'s (verl's ``merge_resource_pool``).

    The merged pool reserves nothing of its own: its groups run on the two pools' bundles (placed
    on first use of any of them), so a group on the merged pool and a group on ``rp2`` share
    ``rp2``'s bundles under its ``max_colocate_count``.  The two pools must agree on what an actor
    in a bundle gets (``use_gpu``, ``max_colocate_count``) and on ``detached``, as in verl.
    """
    for name in ("use_gpu", "max_colocate_count", "detached"):
        first, second = getattr(rp1, name), getattr(rp2, name)
        if first != second:
            raise ResourcePoolError(
                f"merge_resource_pool: the pools differ in {name} ({rp1.name_prefix!r} has {first!r}, "
                f"{rp2.name_prefix!r} has {second!r}); create both with the same {name}"
            )
    shared = set(rp1._members) & set(rp2._members)
    if shared:
        raise ResourcePoolError(
            f"merge_resource_pool: {rp1.name_prefix!r} and {rp2.name_prefix!r} share {len(shared)} bundle(s); "
            "merge pools that do not overlap (a rank would run twice on one bundle)"
        )
    members = rp1._members + rp2._members
    merged = _view(rp1, members, _entry_counts(members))
    merged.name_prefix = f"{rp1.name_prefix}_{rp2.name_prefix}"
    return merged


def _view(pool: RayResourcePool, members: tuple[tuple[RayResourcePool, int], ...], counts: tuple[int, ...]) -> RayResourcePool:
    """A pool over ``members`` (bundles of root pools), with ``pool``'s settings and class."""
    view = type(pool).__new__(type(pool))  # a compat pool's views keep verl's extra methods
    view.__dict__.update(pool.__dict__)
    view._members = members
    view.spares = 0  # the standby bundles stay with the root pool (see RayResourcePool.spare_slots)
    view._counts = counts  # requested counts of the slice, entry by entry (the granted ones come from slots())
    return view


def _entry_counts(members: Sequence[tuple[RayResourcePool, int]]) -> tuple[int, ...]:
    """How many of ``members`` fall in each requested node entry of their roots, entries in order of first use."""
    counts: dict[tuple[RayResourcePool, int], int] = {}
    for root, index in members:
        entry = bisect.bisect_right(list(itertools.accumulate(root._counts)), index)
        counts[(root, entry)] = counts.get((root, entry), 0) + 1
    return tuple(counts.values())
