"""Smoke test of scripts/bench_dispatch.py: the smallest run prints a table and valid JSON.

The benchmark itself is a script, not a timed test; this only checks that it still runs.  It runs
in-process on the session's Ray (``main`` joins a running Ray as it is, and leaves it running):
a subprocess would prove nothing more and pay for another Python, Ray and 16 imports of torch.
Its rankmesh group is built in the host bank's processes (tests/hosts.py), as the other modules'
groups of 8 are; the plain-Ray floor's actors are its own.
"""

from __future__ import annotations

import json

import pytest

from tests.scripts import script_module


@pytest.fixture
def bench():
    yield from script_module("bench_dispatch")


@pytest.mark.timeout(120)
def test_bench_dispatch_smallest_run(bench, host_bank, tmp_path, capsys):
    import ray

    out = tmp_path / "bench.json"
    argv = ["--quick", "--sizes", "0,1", "--repeat", "2", "--micro-mib", "1", "--json", str(out)]
    code = bench.main(argv, processes=host_bank.processes())
    assert code == 0
    assert ray.is_initialized()  # the session's Ray: joined, not shut down
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("mesh") and "floor ms" in line and "ratio" in line for line in lines)
    for workload in ("noop", "dp", "mesh", "pp_as_dp", "traced"):
        assert any(line.split()[:2] == ["tp2pp2dp2", workload] for line in lines), workload
    data = json.loads(out.read_text())
    assert {r["workload"] for r in data["results"]} == {"noop", "dp", "mesh", "pp_as_dp", "traced"}
    assert all(r["rankmesh_ms"] > 0 and r["floor_ms"] > 0 for r in data["results"])
    assert data["micro"]["chunk_copies_nothing"] is True
    assert data["micro"]["inband_pickle_bytes"] < 4096
