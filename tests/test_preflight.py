"""Pre-flight of a layout against a live cluster: pure comparison, the session's Ray, a simulated three-node cluster.

The simulated cluster is the shared one (``simulated_cluster``, tests/drivers.py); the scenario runs
in its driver process.

Expected fits are worked out by hand from the node sizes in each test, not from the checker.
"""

from __future__ import annotations

import pytest

from rankmesh.cli import main as cli_main
from rankmesh.layout import load_layout
from rankmesh.layout.preflight import LiveNode, preflight

TWO_NODE_LAYOUT = """
name: two-node-tp4
cluster: {nodes: 2, devices_per_node: 4}
roles:
  actor: {mesh: {tp: 4, dp: 2}}
"""
THREE_NODE_LAYOUT = """
name: three-node-tp2
cluster: {nodes: 3, devices_per_node: 4}
roles:
  actor: {mesh: {tp: 4, dp: 3}}
"""
CROSSING_LAYOUT = """
name: tp-across
cluster: {nodes: 2, devices_per_node: 2}
roles:
  actor: {mesh: {tp: 4}}
"""

LABELLED_LAYOUT = """
name: labelled
cluster: {nodes: 2, devices_per_node: 4}
pools:
  train: {process_on_nodes: [4], nodes: [0], node_labels: {zone: a}}
  gen: {process_on_nodes: [4], nodes: [1]}
roles:
  actor: {pool: train, mesh: {tp: 4}}
  rollout: {pool: gen, mesh: {tp: 4}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "layout.yaml"
    path.write_text(text)
    return path


def test_preflight_pure(tmp_path):
    layout = load_layout(write(tmp_path, TWO_NODE_LAYOUT))
    # Two layout nodes of 4 processes: nodes of 8 and 4 GPUs fit; 8 and 3 do not (the second is short by 1).
    ok = preflight(layout, [LiveNode("small", {"GPU": 4}), LiveNode("big", {"GPU": 8})])
    assert ok.ok and len(ok.placed) == 2 and not ok.crossing
    short = preflight(layout, [LiveNode("big", {"GPU": 8}), LiveNode("small", {"GPU": 3})])
    assert not short.ok and "needs 4 GPU on one node; node small (the largest left) offers 3" in short.unplaced[0]
    one = preflight(layout, [LiveNode("big", {"GPU": 16})])
    assert not one.ok and "uses 2 nodes, only 1 live node(s) offer GPU" in one.unplaced[0]
    none = preflight(layout, [LiveNode("cpu", {"CPU": 64})])
    assert not none.ok and "no live node offers GPU" in none.unplaced[0]
    crossing = preflight(load_layout(write(tmp_path, CROSSING_LAYOUT)), [LiveNode("a", {"GPU": 2}), LiveNode("b", {"GPU": 2})])
    assert crossing.ok and crossing.crossing == ["role 'actor': tp group [0, 1, 2, 3] spans nodes [0, 1]"]


def test_preflight_checks_node_labels(tmp_path):
    from rankmesh.errors import LayoutError

    layout = load_layout(write(tmp_path, LABELLED_LAYOUT))
    assert layout.pools["train"].node_labels == {"zone": "a"} and layout.pools["gen"].node_labels == {}
    # Only the big node has zone a: train must take it, although the unlabelled pool would fit there
    # too and is listed first among equal demands; gen then takes the small one.
    ok = preflight(layout, [LiveNode("big", {"GPU": 8}, {"zone": "a"}), LiveNode("small", {"GPU": 4}, {"zone": "b"})])
    assert ok.ok, ok.format()
    assert sorted(ok.placed) == [
        "layout node 0 (4 GPU, labels {zone: a}: pool 'train' (4 processes)) -> node big",
        "layout node 1 (4 GPU: pool 'gen' (4 processes)) -> node small",
    ]
    # No node carries zone a.
    none = preflight(layout, [LiveNode("x", {"GPU": 8}, {"zone": "b"}), LiveNode("y", {"GPU": 8})])
    assert none.unplaced == ["layout node 0 (4 GPU, labels {zone: a}: pool 'train' (4 processes)): no live node with "
                             "GPU has the labels {zone: a} (live nodes have zone: b)"]
    # The zone-a node is too small; the big node lacks the label.
    small = preflight(layout, [LiveNode("x", {"GPU": 2}, {"zone": "a"}), LiveNode("y", {"GPU": 8})])
    assert small.unplaced == ["layout node 0 (4 GPU, labels {zone: a}: pool 'train' (4 processes)): needs 4 GPU on "
                              "one node; node x (the largest left with its labels) offers 2"]
    # A pool on two layout nodes needs two labelled nodes.
    two = load_layout(write(tmp_path, LABELLED_LAYOUT.replace("[4], nodes: [0]", "[4, 4], nodes: [0, 1]")
                            .replace("gen: {process_on_nodes: [4], nodes: [1]}", "gen: {process_on_nodes: [4], nodes: [2]}")
                            .replace("nodes: 2,", "nodes: 3,").replace("tp: 4}}\n  rollout", "tp: 4, dp: 2}}\n  rollout")))
    taken = preflight(two, [LiveNode(n, {"GPU": 4}, {"zone": z}) for n, z in (("p", "a"), ("q", "b"), ("r", "b"))])
    assert len(taken.placed) == 2 and taken.unplaced == [
        "layout node 1 (4 GPU, labels {zone: a}: pool 'train' (4 processes)): the 1 live node(s) with GPU and labels "
        "{zone: a} are taken by other layout nodes"]
    # Two pools on one layout node that want different values of one label.
    clash = load_layout(write(tmp_path, LABELLED_LAYOUT.replace("[4], nodes: [1]}", "[4], nodes: [0], node_labels: {zone: b}}")
                              .replace("nodes: 2, devices_per_node: 4", "nodes: 1, devices_per_node: 8")), check=False)
    report = preflight(clash, [LiveNode("big", {"GPU": 8}, {"zone": "a"})])
    assert not report.ok and "its pools require zone=a (pool 'train') and zone=b (pool 'gen') on one node" in report.unplaced[0]
    # Label values are strings: an unquoted number names the field and how to fix it.
    with pytest.raises(LayoutError, match=r"pools\.train\.node_labels.*label values are strings, got 1; quote it"):
        load_layout(write(tmp_path, LABELLED_LAYOUT.replace("{zone: a}", "{zone: 1}")))


def test_preflight_against_the_session_ray(ray_session, capsys):
    import ray

    from rankmesh.backends.ray.preflight import live_nodes, validate_on_cluster

    cpus = int(ray.cluster_resources()["CPU"])
    assert [n.units("CPU") for n in live_nodes()] == [cpus]
    report = validate_on_cluster(load_layout("cpu_demo"), "auto", "CPU")  # 16 processes on one node
    assert report.ok == (cpus >= 16), report.format()
    # llama70b_4x8 wants 4 nodes of 8: one live node cannot hold it.
    assert cli_main(["layout", "validate", "llama70b_4x8", "--address", "auto", "--resource", "CPU"]) == 1
    assert "the layout uses 4 nodes, only 1 live node(s) offer CPU" in capsys.readouterr().out


def simulated_scenario(cluster, *layouts: str) -> dict:
    """Runs inside the shared simulated cluster's driver (nodes of 4, 4 and 2 CPUs, zones a, a, b)."""
    import ray

    from rankmesh.backends.ray import RayResourcePool
    from rankmesh.backends.ray.preflight import validate_on_cluster
    from rankmesh.errors import ResourcePoolError

    out: dict = {}
    for name in layouts:
        r = validate_on_cluster(load_layout(name), None, "CPU")
        out[name] = {"ok": r.ok, "placed": r.placed, "unplaced": r.unplaced, "nodes": [n.units("CPU") for n in r.nodes]}
    # A pool with node labels lands on the node that has them, and fails clearly when none has them.
    pool = RayResourcePool([2], use_gpu=False, node_labels={"zone": "b"})
    node = pool.slots()[0].node_id
    out["pool_zone"] = [n["Labels"].get("zone") for n in ray.nodes() if n["NodeID"] == node]
    pool.remove()
    # Its spares may have labels of their own: the ranks in zone a, the standby bundles in zone b.
    pool = RayResourcePool([2], use_gpu=False, node_labels={"zone": "a"}, spares=2, spare_labels={"zone": "b"})
    zones = {n["NodeID"]: n["Labels"].get("zone") for n in ray.nodes()}
    out["spare_zones"] = ([zones[s.node_id] for s in pool.slots()], [zones[s.node_id] for s in pool.spare_slots()])
    pool.remove()
    try:
        RayResourcePool([1], use_gpu=False, spare_labels={"zone": "b"})
        out["labels_without_spares"] = "accepted"
    except ResourcePoolError as exc:
        out["labels_without_spares"] = str(exc)
    try:
        RayResourcePool([1], use_gpu=False, node_labels={"zone": "c"}, ready_timeout=3).slots()
        out["missing"] = "placed"
    except ResourcePoolError as exc:
        out["missing"] = str(exc)
    return out


@pytest.mark.timeout(300)
def test_preflight_on_a_simulated_three_node_cluster(simulated_cluster, tmp_path):
    two = tmp_path / "two.yaml"
    two.write_text(TWO_NODE_LAYOUT)
    three = tmp_path / "three.yaml"
    three.write_text(THREE_NODE_LAYOUT)
    labelled = tmp_path / "labelled.yaml"
    labelled.write_text(LABELLED_LAYOUT)
    nowhere = tmp_path / "nowhere.yaml"
    nowhere.write_text(LABELLED_LAYOUT.replace("{zone: a}", "{zone: c}"))
    out = simulated_cluster.run("tests.test_preflight:simulated_scenario", str(two), str(three), str(labelled), str(nowhere))
    # Nodes of 4, 4 and 2 CPUs (the head has none): two nodes of 4 fit, three do not (the third has 2).
    assert sorted(out[str(two)]["nodes"]) == [0, 2, 4, 4]  # the head, listed with no CPU
    assert out[str(two)]["ok"] and len(out[str(two)]["placed"]) == 2
    assert not out[str(three)]["ok"]
    assert "needs 4 CPU on one node" in out[str(three)]["unplaced"][0] and "offers 2" in out[str(three)]["unplaced"][0]
    # labels: the two 4-CPU nodes have zone a, the 2-CPU node zone b
    assert out[str(labelled)]["ok"] and out[str(labelled)]["placed"][0].startswith("layout node 0 (4 CPU, labels {zone: a}")
    assert "no live node with CPU has the labels {zone: c}" in out[str(nowhere)]["unplaced"][0]
    assert out["pool_zone"] == ["b"]
    assert out["spare_zones"] == [["a", "a"], ["b", "b"]]
    assert "keeps none: give spares=N too" in out["labels_without_spares"]
    assert "NOT placed" in out["missing"] and "with labels {'zone': 'c'}" in out["missing"]
