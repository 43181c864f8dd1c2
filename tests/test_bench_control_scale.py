"""Smoke test of ``scripts/bench_control_plane.py --scale``: the real controller against in-process agents.

The harness itself is a script, not a timed test; this checks that it still drives the real
group, executor and agent session (private parts it builds by hand, so a change there shows up
here), that every rank answers through the real collect, and that its fit has the three terms.
It runs in-process on the session's Ray with one actor of its own (the live sink for sends).
"""

from __future__ import annotations

import json

import pytest

from tests.scripts import script_module


@pytest.fixture
def bench():
    yield from script_module("bench_control_plane")


@pytest.mark.timeout(120)
def test_the_scale_harness_drives_the_real_controller(bench, ray_session, tmp_path, capsys):
    out = tmp_path / "scale.json"
    data = bench.main(["--scale", "2x2,4x2,4x4,8x2", "--calls", "5", "--fanout", "2", "--json", str(out)])
    rows = {(r["nodes"], r["per_node"]): r for r in data["rows"]}
    # Tops by hand: a tree 2 wide sends to min(2, nodes) agents.
    assert {shape: r["tops"] for shape, r in rows.items()} == {(2, 2): 2, (4, 2): 2, (4, 4): 2, (8, 2): 2}
    assert [r["ranks"] for r in data["rows"]] == [4, 8, 16, 16]
    assert all(r["controller_in_process_ms"] > 0 and r["send_ms"] > 0 for r in data["rows"])
    assert set(data["fit"]) == {"a", "per_node", "per_rank"}
    printed = capsys.readouterr().out
    assert "4 nodes, 2 -> 4 ranks per node: controller CPU" in printed
    assert json.loads(out.read_text())["rows"] == data["rows"]
