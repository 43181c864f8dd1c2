"""Pre-flight: would a layout fit the nodes of a live cluster, before any process starts?

The layout names its own nodes (``cluster``, and each pool's ``nodes``); a live cluster has
nodes with resources.  Each layout node needs one live node of its own with at least as many
units of the process resource (``GPU``, or ``CPU`` for CPU workers) as the processes of every
pool on it (colocated roles share their pool, so they count once).  Matching the largest demand
to the largest live node, in order, finds a mapping whenever one exists (one resource, one node
each, no labels).  The report says which pool entries land on which live node, which cannot and why (no
node offers the resource, too few nodes, a node too small), and which tp/cp/ep groups of a role
cross nodes.  A pool's ``node_labels`` restrict its layout nodes to live nodes carrying those
labels; layout nodes are then matched to live nodes by augmenting paths (a maximum matching),
and one that finds none is reported with the reason (no node has the labels, the labelled
nodes are too small, or taken).  The live nodes come from the backend (``rankmesh.backends.ray.preflight``); this
module only compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .spec import Layout

#: Groups whose collectives should stay inside a node.
CROSSING_TOKENS = ("tp", "cp", "ep")


@dataclass(frozen=True)
class LiveNode:
    """One node of a live cluster: its name (id or address), resources and labels."""

    name: str
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)

    def units(self, resource: str) -> int:
        return int(self.resources.get(resource, 0))


@dataclass
class PreflightReport:
    """What :func:`preflight` found; ``ok`` when every layout node has a live node."""

    layout: str
    resource: str
    nodes: list[LiveNode]
    placed: list[str] = field(default_factory=list)
    unplaced: list[str] = field(default_factory=list)
    crossing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unplaced

    def format(self) -> str:
        lines = [f"{self.layout} on a live cluster of {len(self.nodes)} node(s), one {self.resource} per process:"]
        for node in self.nodes:
            labels = f", labels {dict(node.labels)}" if node.labels else ""
            lines.append(f"  node {node.name}: {node.units(self.resource)} {self.resource}{labels}")
        lines += [f"  fits: {line}" for line in self.placed]
        lines += [f"  cannot place: {line}" for line in self.unplaced]
        lines += [f"  crosses nodes: {line}" for line in self.crossing]
        lines.append(f"{self.layout}: {'fits' if self.ok else f'does not fit ({len(self.unplaced)} problem(s))'}")
        return "\n".join(lines)


def preflight(layout: Layout, nodes: Sequence[LiveNode], resource: str = "GPU") -> PreflightReport:
    """Check ``layout`` against the live ``nodes`` (see the module docstring)."""
    report = PreflightReport(layout.name, resource, list(nodes))
    used_pools = {role.pool.name: role.pool for role in layout.roles.values()}
    demand: dict[int, int] = {}
    entries: dict[int, list[str]] = {}
    labels: dict[int, dict[str, str]] = {}
    clashes: dict[int, list[str]] = {}
    for pool in used_pools.values():
        for node, count in zip(pool.nodes, pool.process_on_nodes):
            demand[node] = demand.get(node, 0) + count
            entries.setdefault(node, []).append(f"pool {pool.name!r} ({count} process{'es' if count > 1 else ''})")
            wanted_labels = labels.setdefault(node, {})
            for key, value in pool.node_labels.items():
                wanted_labels.setdefault(key, value)
    for conflict in layout.label_conflicts():
        clashes.setdefault(conflict.node, []).append(
            f"{conflict.key}={conflict.value} (pool {conflict.pool!r}) and {conflict.key}={conflict.other_value} "
            f"(pool {conflict.other_pool!r})")
    live = sorted((n for n in nodes if n.units(resource) > 0), key=lambda n: -n.units(resource))
    wanted = sorted(demand, key=lambda k: (-demand[k], k))
    if not live:
        report.unplaced.append(f"no live node offers {resource} (nodes offer {sorted({r for n in nodes for r in n.resources})})")
        wanted = []
    # Which live nodes each layout node may use, then a maximum matching (one live node each).
    fits = {k: [i for i, n in enumerate(live) if _has(n, labels[k]) and n.units(resource) >= demand[k]]
            for k in wanted if k not in clashes}
    match = _match([k for k in wanted if k in fits], fits)
    taken = set(match.values())
    for node in wanted:
        tag = f", labels {_fmt(labels[node])}" if labels[node] else ""
        what = f"layout node {node} ({demand[node]} {resource}{tag}: {', '.join(entries[node])})"
        if node in clashes:
            report.unplaced.append(f"{what}: its pools require {'; '.join(clashes[node])} on one node")
        elif node in match:
            report.placed.append(f"{what} -> node {live[match[node]].name}")
        else:
            report.unplaced.append(f"{what}: {_why(node, demand, labels, live, taken, resource, len(wanted))}")
    for role in layout.roles.values():
        for group in role.placement().spanning_groups(role.mesh(), CROSSING_TOKENS):
            report.crossing.append(f"role {role.name!r}: {group.describe()}")
    return report


def _has(node: LiveNode, labels: Mapping[str, str]) -> bool:
    return all(node.labels.get(k) == v for k, v in labels.items())


def _fmt(labels: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in labels.items()) + "}"


def _match(order: Sequence[int], fits: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Layout node -> live node index: a maximum matching (augmenting paths), largest demands first."""
    owner: dict[int, int] = {}  # live node index -> layout node

    def assign(node: int, seen: set[int]) -> bool:
        for i in fits[node]:
            if i not in seen:
                seen.add(i)
                if i not in owner or assign(owner[i], seen):
                    owner[i] = node
                    return True
        return False

    for node in order:
        assign(node, set())
    return {node: i for i, node in owner.items()}


def _why(node: int, demand: Mapping[int, int], labels: Mapping[int, Mapping[str, str]], live: Sequence[LiveNode],
         taken: set[int], resource: str, used: int) -> str:
    """Why layout ``node`` found no live node (the matching left it out)."""
    need = labels[node]
    with_labels = [i for i, n in enumerate(live) if _has(n, need)]
    if not with_labels:
        seen = sorted({f"{k}: {v}" for n in live for k, v in n.labels.items() if k in need})
        return (f"no live node with {resource} has the labels {_fmt(need)}"
                + (f" (live nodes have {', '.join(seen)})" if seen else " (no live node has these keys)"))
    left = [i for i in with_labels if i not in taken]
    if not left:
        if need:
            return (f"the {len(with_labels)} live node(s) with {resource} and labels {_fmt(need)} are taken by other "
                    "layout nodes")
        return f"the layout uses {used} nodes, only {len(live)} live node(s) offer {resource}"
    best = live[left[0]]
    return (f"needs {demand[node]} {resource} on one node; node {best.name} (the largest left"
            f"{' with its labels' if need else ''}) offers {best.units(resource)}")
