"""A simulated multi-node Ray cluster on 127.0.0.1, for tests, drills and the scaling script.

Several raylets on one machine (``ray.cluster_utils.Cluster``), each a "node" with its own object
store, so multi-node placement and node loss can be exercised without a real cluster.  The
loopback settings live here once: ``node_ip_address="127.0.0.1"`` on the head and every node, and
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (without it ``ray.init(address=...)`` rewrites the address
to the machine's network interface and hangs).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import ray
from ray.cluster_utils import Cluster

from rankmesh.backends.ray.runtime import LOOPBACK, loopback_in_this_process


def loopback_cluster(
    nodes: Sequence[Mapping[str, Any]],
    head_args: Mapping[str, Any] | None = None,
    connect: bool = True,
    logging_level: str = "WARNING",
):
    """Start a CPU-less head plus one raylet per entry of ``nodes`` (``add_node`` kwargs), all on loopback.

    Returns ``(cluster, node_handles)``; with ``connect=True`` this process's driver joins it.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    loopback_in_this_process()
    head = {"num_cpus": 0, "include_dashboard": False, **dict(head_args or {}), "node_ip_address": LOOPBACK}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    handles = [cluster.add_node(**{**dict(node), "node_ip_address": LOOPBACK}) for node in nodes]
    cluster.wait_for_nodes()
    if connect:
        ray.init(address=cluster.address, logging_level=logging_level)
    return cluster, handles
