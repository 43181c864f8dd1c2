"""Removing a node during a call, on a simulated cluster, reads like dead workers (< 10 s).

The scenario runs in a subprocess driver (``tests/reliability_node_loss.py``, through
``tests.drivers.run_module``) because the test session already holds its one Ray connection; it
removes a node, so it owns its cluster rather than using the shared one.
"""

from __future__ import annotations

import pytest

from tests.drivers import run_module


@pytest.mark.timeout(180)
def test_removed_node_is_reported_as_dead_workers():
    pytest.importorskip("ray")
    report = run_module("tests.reliability_node_loss", timeout=150)
    assert report["error"] == "WorkerDiedError", report
    assert report["ranks"] == report["ranks_on_victim"] and len(report["ranks"]) == 2, report
    assert report["seconds"] < 10, report
    assert "died during act" in report["message"] and report["failed"], report
