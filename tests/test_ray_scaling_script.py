"""scripts/scaling_test.py without a cluster: argument parsing, spreading, table, plot and JSON."""

from __future__ import annotations

import json

import pytest

from tests.scripts import script_module


@pytest.fixture(scope="module")
def script():
    yield from script_module("scaling_test")


def test_spread_fills_nodes_evenly(script):
    assert script.spread(1, 4) == [1]
    assert script.spread(6, 4) == [2, 2, 1, 1]
    assert script.spread(16, 2) == [8, 8]


def test_defaults_and_quick(script):
    args = script.parse_args([])
    assert args.nodes == [1, 2, 4] and args.world_sizes == [1, 2, 4, 8, 16] and not args.fresh
    quick = script.parse_args(["--quick", "--json", "-"])
    assert quick.nodes == [1, 2] and quick.world_sizes == [1, 2] and quick.json == "-"


def test_table_plot_and_json(script, tmp_path):
    rows = [
        script.Row(n, w, script.spread(w, n), 0.01 * w, 0.5 * w, 2.0 * w, 60.0 * w, 1.0, 64.0, fresh=False)
        for n in (1, 2)
        for w in (2, 4)
    ]
    line = script.format_row(rows[0])
    assert line.split()[:3] == ["1", "2", "2"] and "*" in line
    assert "64MiB ms" in script.header(script.parse_args([]))
    png = tmp_path / "plot.png"
    script.plot(rows, png, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(json.dumps([{**script.asdict(r), "large_gbps": r.large_gbps} for r in rows]))
    assert payload[0]["large_gbps"] == pytest.approx(64 / 1024 / 0.12)
