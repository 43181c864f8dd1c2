"""Killing a node during a call reads like dead workers (< 10 s).

The scenario runs in a subprocess driver (``tests/reliability_node_loss.py``) because the test
session already holds its one Ray connection; it kills a node, so it gets a cluster of its own:
namespaced where namespaces can be made, else loopback raylets (``tests/node_faults.py``).
"""

from __future__ import annotations

import pytest

from tests.node_faults import run_node_scenario


@pytest.mark.timeout(180)
def test_removed_node_is_reported_as_dead_workers():
    pytest.importorskip("ray")
    from tests.reliability_node_loss import FAST_HEALTH_CHECKS, NODES

    report, _ = run_node_scenario("tests.reliability_node_loss", NODES, FAST_HEALTH_CHECKS, timeout=150)
    assert report["error"] == "WorkerDiedError", report
    assert report["ranks"] == report["ranks_on_victim"] and len(report["ranks"]) == 2, report
    assert report["seconds"] < 10, report
    assert "died during act" in report["message"] and report["failed"], report
