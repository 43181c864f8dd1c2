"""Pre-flight of a layout against a live cluster: pure comparison, the session's Ray, a simulated three-node cluster.

Expected fits are worked out by hand from the node sizes in each test, not from the checker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rankmesh.cli import main as cli_main
from rankmesh.layout import load_layout
from rankmesh.layout.preflight import LiveNode, preflight

REPO = Path(__file__).resolve().parents[1]

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


SIMULATED_DRIVER = textwrap.dedent(
    """
    import json, sys
    from rankmesh.backends.ray.simulated import loopback_cluster
    from rankmesh.backends.ray.preflight import validate_on_cluster
    from rankmesh.layout import load_layout
    cluster, _ = loopback_cluster([{"num_cpus": c, "object_store_memory": 96 << 20} for c in (4, 4, 2)])
    try:
        out = {}
        for name in sys.argv[1:]:
            r = validate_on_cluster(load_layout(name), None, "CPU")
            out[name] = {"ok": r.ok, "placed": r.placed, "unplaced": r.unplaced, "nodes": [n.units("CPU") for n in r.nodes]}
        print("REPORT " + json.dumps(out))
    finally:
        import ray
        ray.shutdown()
        cluster.shutdown()
    """
)


@pytest.mark.timeout(300)
def test_preflight_on_a_simulated_three_node_cluster(tmp_path):
    two = tmp_path / "two.yaml"
    two.write_text(TWO_NODE_LAYOUT)
    three = tmp_path / "three.yaml"
    three.write_text(THREE_NODE_LAYOUT)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-c", SIMULATED_DRIVER, str(two), str(three)], capture_output=True, text=True, env=env, timeout=280
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("REPORT ")), None)
    assert line is not None, proc.stderr[-3000:]
    out = json.loads(line[len("REPORT "):])
    # Nodes of 4, 4 and 2 CPUs (the head has none): two nodes of 4 fit, three do not (the third has 2).
    assert sorted(out[str(two)]["nodes"]) == [0, 2, 4, 4]  # the head, listed with no CPU
    assert out[str(two)]["ok"] and len(out[str(two)]["placed"]) == 2
    assert not out[str(three)]["ok"]
    assert "needs 4 CPU on one node" in out[str(three)]["unplaced"][0] and "offers 2" in out[str(three)]["unplaced"][0]
