"""Smoke test of ``scripts/bench_control_plane.py --scale``: the real controller against in-process agents.

The harness itself is a script, not a timed test; this checks that it still drives the real
group, executor and agent session (private parts it builds by hand, so a change there shows up
here), that every rank answers through the real collect (a no-op call, and a megatron call with
two dp pieces), and that its fits have the three terms.
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
    data = bench.main(["--scale", "2x2,4x2,4x4,8x2", "--calls", "5", "--fanout", "2", "--dp", "2", "--json", str(out)])
    rows = {(r["nodes"], r["per_node"]): r for r in data["rows"]}
    # Tops by hand: a tree 2 wide sends to min(2, nodes) agents.
    assert {shape: r["tops"] for shape, r in rows.items()} == {(2, 2): 2, (4, 2): 2, (4, 4): 2, (8, 2): 2}
    assert [r["ranks"] for r in data["rows"]] == [4, 8, 16, 16]
    assert all(r["controller_in_process_ms"] > 0 and r["send_ms"] > 0 for r in data["rows"])
    assert set(data["fit"]) == set(data["fit_megatron"]) == {"a", "per_node", "per_rank"}
    assert all(r["dp"] == 2 and r["megatron_cpu_ms"] > 0 for r in data["rows"])
    printed = capsys.readouterr().out
    assert "4 nodes, 2 -> 4 ranks per node, no-op: controller CPU" in printed
    assert "4 nodes, 2 -> 4 ranks per node, MEGATRON_COMPUTE: controller CPU" in printed
    assert json.loads(out.read_text())["rows"] == data["rows"]


def _python_calls(run) -> int:
    """How many Python functions ``run()`` calls, every module's (the controller's work, counted, not
    timed): the fewest of three runs, with the garbage collector held off (a collection runs
    finalizers wherever it happens to start)."""
    import gc
    import sys

    counts = []
    for _ in range(3):
        count = 0

        def profile(frame, event, arg):
            nonlocal count
            if event == "call":
                count += 1

        gc.collect()
        gc.disable()
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
            gc.enable()
        counts.append(count)
    return min(counts)


@pytest.mark.timeout(120)
def test_the_controller_does_the_same_work_per_call_whatever_the_ranks_per_node(bench, ray_session):
    """Issue 41, item 1: a call is its shares plus a selection the agents expand, so the controller's
    work per call does not depend on the ranks per node (or tp): counted as the Python functions it
    calls for one call, at 2, 4 and 8 ranks per node on 16 nodes in a tree 4 wide.  A non-blocking
    data call too: its future reads the collect ranks alone, and the agents send back theirs; and a
    non-blocking call whose future reads every rank (a ``GroupFuture``): one joined answer per top
    agent.  Expected by hand:
    4 sends per call (the tops), the selection's plans sent with the first call only."""
    from rankmesh.mesh import RankMesh

    import torch

    from rankmesh.data import DataProto

    counts: dict[str, list[int]] = {"noop": [], "shifted": [], "later": [], "every_later": []}
    batch = DataProto.from_dict({"x": torch.arange(16)})
    for per_node in (2, 4, 8):
        wg, agents, tops = bench.scale_group(16, per_node, 4, RankMesh(tp=per_node, dp=16))
        assert tops == 4
        for method, args in (("noop", ()), ("shifted", (list(range(16)),))):
            call = getattr(wg, method)
            for _ in range(2):  # the first call of a method carries the selection's plans; the agents keep them
                call(*args)
            sent = len(agents.shares)
            counts[method].append(_python_calls(lambda: call(*args)))
            new = agents.shares[sent:]
            assert len(new) == 4 * 3  # one send per top agent, for each of the three calls counted
            assert all(key is not None and plans is None for *_, key, plans, _, _ in new)  # the agents keep the plans
        # A non-blocking data call read at once: the agents answer one output reference per collect
        # rank (16, one per dp piece), whatever the ranks per node.
        for _ in range(2):
            assert len(wg.rows_megatron_later(batch).get()) == 16
        counts["later"].append(_python_calls(lambda: wg.rows_megatron_later(batch).get()))
        # A non-blocking call whose future holds every rank's output (ONE_TO_ALL, a GroupFuture) read
        # at once: each top agent answers its subtree joined, not a reference per rank.
        for _ in range(2):
            assert len(wg.slow_append("x", 0.0).get()) == 16 * per_node
        counts["every_later"].append(_python_calls(lambda: wg.slow_append("x", 0.0).get()))
    assert len(set(counts["noop"])) == 1, counts
    assert len(set(counts["shifted"])) == 1, counts
    assert len(set(counts["later"])) == 1, counts
    assert len(set(counts["every_later"])) == 1, counts
