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
import os
import subprocess
import time

import pytest

from rankmesh.testing.cluster import unavailable
from tests.scripts import script_module

logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def chaos():
    yield from script_module("chaos")


def _state(pid: int) -> str:
    """A process's state letter from ``/proc`` (R, S, T stopped, Z zombie)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_rank_fault_is_injected_only_into_a_live_process(chaos, tmp_path):
    """The driver's state can name a rank that has died since it was written (killed by its group's
    ``on_hang`` as collateral of another fault, and not yet replaced): such a rank, gone or a zombie
    not yet reaped, or one already stopped, is never picked; a live one is."""
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    zombie = subprocess.Popen(["sleep", "0"])  # exits at once; not reaped until the end of the test
    stopped = subprocess.Popen(["sleep", "60"])
    live = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, 19)  # SIGSTOP
        deadline = time.monotonic() + 10
        while _state(zombie.pid) != "Z" or _state(stopped.pid) != "T":
            assert time.monotonic() < deadline, "the helper processes did not settle"
            time.sleep(0.01)
        soak = chaos.Soak(chaos.parse_args(["--seed", "3", "--out", str(tmp_path)]), tmp_path)

        def state(*pids):
            ranks = [{"rank": i, "pid": pid, "node": "10.1.0.9", "shard": [0, 0, 0, i]} for i, pid in enumerate(pids)]
            return {"groups": {"critic": {"ranks": ranks, "replacements": []}}}

        assert soak.inject("kill", state(gone.pid, zombie.pid, stopped.pid)) is None
        fault = soak.inject("kill", state(gone.pid, zombie.pid, stopped.pid, live.pid))
        assert fault is not None and fault.victims == {"critic": [3]}, fault
        assert live.wait(timeout=10) == -9  # SIGKILL
    finally:
        for p in (zombie, stopped, live):
            p.kill()
            p.wait()


@pytest.mark.timeout(420)
def test_a_short_soak_survives_a_kill_a_stop_and_a_partition_and_loses_no_row(chaos, tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    # Small and quick: one spare per group, a 6 s call timeout (the demo's calls take well under
    # 1 s) and a partition healed 1 s after its node's ranks are replaced.  Seed 16 draws the
    # partition first (then a kill, then a stop): a node fault waits for every open fault, and a
    # stop can take 10-20 s to recover on 2 cores, so a partition drawn last (seed 3) could find
    # the stop still open in its slot and give the slot to a second kill.
    args = chaos.parse_args(["--minutes", "1", "--faults", "3", "--kinds", "kill,stop,partition", "--seed", "16",
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
