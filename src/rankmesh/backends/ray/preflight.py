"""Pre-flight on Ray: the live nodes of a cluster, and a layout checked against them before any actor starts.

Only reads the cluster (``ray.nodes()``): no placement group is reserved and no actor is
started, so it is safe against a busy production cluster.  The comparison itself is
:func:`rankmesh.layout.preflight.preflight`.
"""

from __future__ import annotations

from typing import Any

import ray

from rankmesh.layout import Layout
from rankmesh.layout.preflight import LiveNode, PreflightReport, preflight

from .runtime import ensure_ray


def live_nodes() -> list[LiveNode]:
    """The alive nodes of the connected cluster, with their total resources and labels."""
    nodes = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        resources = {k: float(v) for k, v in info.get("Resources", {}).items() if not k.startswith("node:")}
        # Ray's own labels (ray.io/accelerator-type, ...) can be required too; the node id is its name already.
        labels = {str(k): str(v) for k, v in (info.get("Labels") or {}).items() if str(k) != "ray.io/node-id"}
        name = f"{info.get('NodeManagerAddress', '?')}/{info['NodeID'][:8]}"
        nodes.append(LiveNode(name, resources, labels))
    return nodes


def validate_on_cluster(layout: Layout, address: str | None = "auto", resource: str | None = None, **ray_kwargs: Any) -> PreflightReport:
    """Check ``layout`` against the Ray cluster at ``address`` (``"auto"``: the running one).

    ``resource`` is what each process takes: ``"GPU"`` or ``"CPU"``; ``None`` picks GPU when
    any node has one.
    """
    ensure_ray(address, **ray_kwargs)
    nodes = live_nodes()
    if resource is None:
        resource = "GPU" if any(n.units("GPU") for n in nodes) else "CPU"
    return preflight(layout, nodes, resource)
