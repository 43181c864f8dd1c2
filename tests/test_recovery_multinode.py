"""A node removed from a simulated cluster: its ranks are replaced on the spare node, survivors kept.

The scenario runs in a subprocess driver (``tests/recovery_node_loss.py``) because the test
session already holds its one Ray connection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_removed_node_ranks_are_re_placed_on_a_node_with_room():
    pytest.importorskip("ray")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "tests.recovery_node_loss"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=220)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT "):])
    # Two ranks per node (pool [2, 2]) on two of the three nodes; the third is the spare.
    assert len(report["ranks_on_victim"]) == 2 and report["replaced"] == report["ranks_on_victim"], report
    assert report["result"] == [10.0] * 4, report  # 1 + 2 + 3 + 4 on every rank: the undisturbed result
    spare = ({0, 1, 2} - set(report["nodes_before"])).pop()
    assert all(report["nodes_after"][r] == spare for r in report["replaced"]), report
    assert report["survivor_pids_kept"], report
