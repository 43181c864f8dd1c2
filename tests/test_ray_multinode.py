"""Placement on the shared multi-node cluster (a namespace and an address per node, or raylets on 127.0.0.1).

Ray allows one cluster connection per process and the session already holds one (conftest), so
the scenarios run in the shared simulated cluster's driver process (``simulated_cluster``,
tests/drivers.py), which returns one JSON report; the tests below check parts of that report.
Nodes (``tests.drivers.SHARED_NODES``): ``node_a`` and ``node_b`` with 4 CPUs, ``node_c`` with 2,
each tagged with a custom resource of its name; the head has no CPUs.  Namespaced, the nodes'
addresses are :data:`tests.drivers.NETNS_ADDRESSES` (mixed widths: string order is not numeric).
"""

from __future__ import annotations

import time

import pytest

from tests.drivers import NETNS_ADDRESSES, SHARED_NODES

NODES = {name: node["num_cpus"] for name, node in SHARED_NODES.items()}


# ----- the scenarios (run in the shared cluster's driver) ----------------------------------------


def scenarios(cluster) -> dict:
    """Runs inside the driver process, on the shared cluster: every scenario, one report."""
    import ray

    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rankmesh.errors import ResourcePoolError
    from rankmesh.mesh import RankMesh
    from tests.multinode_worker import NodeWorker

    report: dict = {}
    names = {
        n["NodeID"]: next((k for k in n["Resources"] if k in NODES), "head") for n in ray.nodes() if n["Alive"]
    }
    report["node_names"] = names
    report["node_ips"] = sorted({n["NodeManagerAddress"] for n in ray.nodes()})
    report["addresses"] = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

    # 1. tp2 over two nodes of 4: ranks where the pool says, tp groups inside a node.
    pool = RayResourcePool([4, 4], use_gpu=False)
    mesh = RankMesh(tp=2, dp=4)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), mesh=mesh, process_model="ray")  # asks Ray its node
    report["tp2"] = {
        "pool_nodes": [s.node_id for s in pool.slots()],
        "worker_nodes": [w["node_id"] for w in wg.where()],
        "places": [[p.node, p.local_rank, p.local_world_size] for p in wg.placements],
        "env": [[w["LOCAL_RANK"], w["LOCAL_WORLD_SIZE"], w["MASTER_ADDR"]] for w in wg.where()],
        "spanning": [g.describe() for g in wg.spanning_groups()],
        "tp_groups": mesh.groups("tp"),
    }
    wg.shutdown()

    # 2. heterogeneous nodes [4, 2] and a gloo all-reduce across them.
    pool = RayResourcePool([4, 2], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(NodeWorker), mesh=RankMesh(dp=6), process_model="ray")
    where = wg.where()
    report["hetero"] = {
        "counts": list(pool.placement.process_on_nodes),
        "node_ids": pool.node_ids(),
        "worker_nodes": [w["node_id"] for w in where],
        "local": [[int(w["LOCAL_RANK"]), int(w["LOCAL_WORLD_SIZE"])] for w in where],
        "all_reduce": wg.all_reduce(),
    }
    wg.shutdown()

    # 3. tp2 over nodes of 3 crosses nodes: the placement says so before anything starts.
    #    (No node holds 6 CPUs, so the two entries land on different nodes.)
    pool = RayResourcePool([3, 3], use_gpu=False)
    report["tp2_over_3_spans"] = [g.describe() for g in pool.placement.spanning_groups(RankMesh(tp=2, dp=3))]
    pool.remove()

    # 4. a pool no node can hold (5 CPUs on one node) fails within the bounded wait.
    start = time.monotonic()
    try:
        RayResourcePool([5], use_gpu=False, ready_timeout=3.0).slots()
        report["unfit"] = {"error": None}
    except ResourcePoolError as exc:
        report["unfit"] = {"error": str(exc), "seconds": time.monotonic() - start}
    return report


# ----- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(simulated_cluster) -> dict:
    return simulated_cluster.run("tests.test_ray_multinode:scenarios")


def test_nodes_have_the_shared_clusters_addresses(report, simulated_cluster):
    assert sorted(n for n in report["node_names"].values() if n != "head") == sorted(NODES)
    by_name = {name: report["addresses"][node] for node, name in report["node_names"].items()}
    if simulated_cluster.kind == "netns":
        assert by_name == NETNS_ADDRESSES
    else:
        assert report["node_ips"] == ["127.0.0.1"]


def test_ranks_land_where_the_pool_says_and_tp_stays_in_a_node(report, simulated_cluster):
    tp2 = report["tp2"]
    assert tp2["worker_nodes"] == tp2["pool_nodes"]
    names = [report["node_names"][n] for n in tp2["worker_nodes"]]
    assert set(names) == {"node_a", "node_b"} and names[:4] == [names[0]] * 4 and names[4:] == [names[4]] * 4
    if simulated_cluster.kind == "netns":
        # Nodes in numeric address order: node_a (.10) before node_b (.100); rank 0's node is the master.
        assert names[0] == "node_a"
        master = NETNS_ADDRESSES["node_a"]
    else:
        # Nodes on one IP are ordered by node id.
        assert tp2["worker_nodes"][0] < tp2["worker_nodes"][4]
        master = "127.0.0.1"
    assert tp2["places"] == [[r // 4, r % 4, 4] for r in range(8)]
    assert tp2["env"] == [[str(r % 4), "4", master] for r in range(8)]
    assert tp2["spanning"] == []
    for group in tp2["tp_groups"]:
        assert len({tp2["worker_nodes"][r] for r in group}) == 1


def test_heterogeneous_nodes(report):
    het = report["hetero"]
    assert sorted(het["counts"]) == [2, 4]
    # Ranks fill the nodes in the pool's order; local ranks count within each node.
    expected_nodes = [nid for nid, n in zip(het["node_ids"], het["counts"]) for _ in range(n)]
    assert het["worker_nodes"] == expected_nodes
    expected_local = [[i, n] for n in het["counts"] for i in range(n)]
    assert het["local"] == expected_local
    assert het["all_reduce"] == [21.0] * 6  # 1 + 2 + ... + 6 over gloo, across the two nodes


def test_layout_that_crosses_nodes_is_reported(report):
    assert report["tp2_over_3_spans"] == ["tp group [2, 3] spans nodes [0, 1]"]


def test_unfit_pool_fails_with_resources_per_node(report):
    unfit = report["unfit"]
    assert unfit["error"] is not None and unfit["seconds"] < 20
    assert "entry 0: 5 x {'CPU': 1.0} NOT placed (needs {'CPU': 5.0} on one node)" in unfit["error"]
    assert unfit["error"].count("/4") >= 2 and "/2" in unfit["error"]
