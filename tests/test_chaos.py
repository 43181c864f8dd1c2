"""The chaos soak's short form (``scripts/chaos.py``): the asynchronous demo on a namespaced 3-node
cluster through a rank killed, a rank stopped past its call's timeout and a node cut off, each once,
in one minute.

Every fault must be survived (the group(s) of its ranks report replacing them), no row lost
(generated = trained + dropped + held, from the demo's own tally), no hang, and the demo's own
checks must pass (log-probs against single-process references, exact refits, identical replicas).
Skips with one line where namespaces cannot be made (no root, no ``ip``).
"""

from __future__ import annotations

import logging

import pytest

from rankmesh.testing.cluster import unavailable
from tests.scripts import script_module

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def chaos():
    yield from script_module("chaos")


@pytest.mark.timeout(420)
def test_a_short_soak_survives_a_kill_a_stop_and_a_partition_and_loses_no_row(chaos, tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    # Small and quick: one spare per group, a 6 s call timeout (the demo's calls take well under
    # 1 s) and a partition healed 1 s after its node's ranks are replaced.
    args = chaos.parse_args(["--minutes", "1", "--faults", "3", "--kinds", "kill,stop,partition", "--seed", "3",
                             "--spares", "1", "--call-timeout", "6", "--heal-s", "1", "--out", str(tmp_path)])
    report = chaos.Soak(args, tmp_path).run()
    logger.info("%s", chaos.format_report(report, args.faults, args.p95_target))
    injected = [f for f in report.faults if f.kind != "add"]
    assert sorted(f.kind for f in injected) == ["kill", "partition", "stop"], report.faults
    assert all(f.recovered_at is not None for f in report.faults), report.faults
    assert [f.kind for f in report.faults].count("add") == 1  # the cut-off node's place, added back
    assert not report.hangs, report.hangs
    assert report.result is not None and report.result["ok"], report.result and report.result["checks"]
    rows = report.rows()
    assert rows is not None and rows["rows_trained"] > 0 and report.rows_lost() == 0, rows
