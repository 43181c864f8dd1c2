"""Pre-flight: would a layout fit the nodes of a live cluster, before any process starts?

The layout names its own nodes (``cluster``, and each pool's ``nodes``); a live cluster has
nodes with resources.  Each layout node needs one live node of its own with at least as many
units of the process resource (``GPU``, or ``CPU`` for CPU workers) as the processes of every
pool on it (colocated roles share their pool, so they count once).  Matching the largest demand
to the largest live node, in order, finds a mapping whenever one exists (one resource, one node
each).  The report says which pool entries land on which live node, which cannot and why (no
node offers the resource, too few nodes, a node too small), and which tp/cp/ep groups of a role
cross nodes.  The live nodes come from the backend (``rankmesh.backends.ray.preflight``); this
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
    for pool in used_pools.values():
        for node, count in zip(pool.nodes, pool.process_on_nodes):
            demand[node] = demand.get(node, 0) + count
            entries.setdefault(node, []).append(f"pool {pool.name!r} ({count} process{'es' if count > 1 else ''})")
    live = sorted((n for n in nodes if n.units(resource) > 0), key=lambda n: -n.units(resource))
    wanted = sorted(demand, key=lambda k: (-demand[k], k))
    if not live:
        report.unplaced.append(f"no live node offers {resource} (nodes offer {sorted({r for n in nodes for r in n.resources})})")
    for i, node in enumerate(wanted):
        what = f"layout node {node} ({demand[node]} {resource}: {', '.join(entries[node])})"
        if not live:
            continue
        if i >= len(live):
            report.unplaced.append(f"{what}: the layout uses {len(wanted)} nodes, only {len(live)} live node(s) offer {resource}")
        elif live[i].units(resource) < demand[node]:
            report.unplaced.append(f"{what}: needs {demand[node]} {resource} on one node; node {live[i].name} "
                                   f"(the largest left) offers {live[i].units(resource)}")
        else:
            report.placed.append(f"{what} -> node {live[i].name}")
    for role in layout.roles.values():
        for group in role.placement().spanning_groups(role.mesh(), CROSSING_TOKENS):
            report.crossing.append(f"role {role.name!r}: {group.describe()}")
    return report
