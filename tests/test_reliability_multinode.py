"""Removing a node during a call, on a simulated cluster, reads like dead workers (< 10 s).

The scenario runs in a subprocess driver (``tests/reliability_node_loss.py``) because the
test session already holds its one Ray connection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_node_loss(timeout: float = 150) -> dict:
    """Run the node-loss driver; its report (raises with the driver's output if it failed)."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability_node_loss"], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"node-loss driver failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("REPORT ") :])


@pytest.mark.timeout(180)
def test_removed_node_is_reported_as_dead_workers():
    pytest.importorskip("ray")
    report = run_node_loss()
    assert report["error"] == "WorkerDiedError", report
    assert report["ranks"] == report["ranks_on_victim"] and len(report["ranks"]) == 2, report
    assert report["seconds"] < 10, report
    assert "died during act" in report["message"] and report["failed"], report
