"""Smoke test of scripts/bench_dispatch.py: the smallest run prints a table and valid JSON.

The benchmark itself is a script, not a timed test; this only checks that it still runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_dispatch.py"


@pytest.mark.timeout(120)
def test_bench_dispatch_smallest_run(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--sizes", "0,1", "--repeat", "2", "--micro-mib", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("mesh") and "floor ms" in line and "ratio" in line for line in lines)
    for workload in ("noop", "dp", "mesh", "pp_as_dp", "traced"):
        assert any(line.split()[:2] == ["tp2pp2dp2", workload] for line in lines), workload
    data = json.loads(out.read_text())
    assert {r["workload"] for r in data["results"]} == {"noop", "dp", "mesh", "pp_as_dp", "traced"}
    assert all(r["rankmesh_ms"] > 0 and r["floor_ms"] > 0 for r in data["results"])
    assert data["micro"]["chunk_copies_nothing"] is True
    assert data["micro"]["inband_pickle_bytes"] < 4096
