"""``WorkerGroup.call_ranks``: per-rank arguments and an explicit rank subset, through the group's one call path.

The same checks run on the in-process backend and on Ray.  Expected values are written by hand
from the arguments (each rank answers with its own rank), never read back from the group.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.errors import DispatchError, HangError
from rankmesh.futures import GroupFuture
from tests.call_workers import RankEcho


def _calls_in(path, method: str) -> tuple[list[dict], list[dict]]:
    """The controller slices of ``method`` in the trace at ``path``, and its ranks' ``return`` spans."""
    events = json.loads(path.read_text())["traceEvents"]
    calls = [e for e in events if e.get("cat") == "call" and e["ph"] == "B" and e["name"] == method]
    returns = [e for e in events if e.get("name") == "return" and e["ph"] == "B" and e["args"]["method"] == method]
    return calls, returns


def check_call_ranks(wg, tmp_path) -> None:
    # An explicit subset, in the caller's order, with per-rank positional and keyword arguments.
    assert wg.call_ranks("tag", [(5,), (7,)], ranks=[3, 1], kwargs=[{"scale": 2}, {}]) == [(3, 10), (1, 7)]
    # Every rank by default; a method that is not registered goes the same way.
    assert wg.call_ranks("plain", [(1,), (2,), (3,), (4,)]) == [1, 102, 203, 304]
    # Non-blocking: a future with one handle per rank called.
    future = wg.call_ranks("tag", [(1,), (2,)], ranks=[0, 2], blocking=False)
    assert isinstance(future, GroupFuture) and len(future.handles) == 2
    assert future.get() == [(0, 1), (2, 2)]

    with pytest.raises(DispatchError, match=r"RankEcho\.tag.*ranks must name ranks of this group \(0\.\.3\), got \[0, 4\]"):
        wg.call_ranks("tag", [(1,), (2,)], ranks=[0, 4])
    with pytest.raises(DispatchError, match=r"name a rank twice"):
        wg.call_ranks("tag", [(1,), (2,)], ranks=[1, 1])
    with pytest.raises(DispatchError, match=r"args needs one entry per rank of \[0, 1, 2\] \(3\), got 2 items"):
        wg.call_ranks("tag", [(1,), (2,)], ranks=[0, 1, 2])
    with pytest.raises(DispatchError, match=r"kwargs needs one entry per rank of \[0\] \(1\), got 2 items"):
        wg.call_ranks("tag", [(1,)], ranks=[0], kwargs=[{}, {}])
    with pytest.raises(DispatchError, match=r"each entry of args must be a tuple"):
        wg.call_ranks("tag", [1], ranks=[0])
    with pytest.raises(DispatchError, match=r"RankEcho has no method 'nope'"):
        wg.call_ranks("nope", [()], ranks=[0])

    # Traced like every call: its own slice on the controller, and each called rank's return
    # span with the array bytes it sent back (rank r: 3 + r float32 values).
    path = tmp_path / "call_ranks.json"
    with wg.trace(path):
        out = wg.call_ranks("array", [(4,), (6,)], ranks=[2, 0])
    np.testing.assert_array_equal(out[0], np.full(4, 2, dtype=np.float32))
    calls, returns = _calls_in(path, "array")
    assert len(calls) == 1 and calls[0]["args"]["blocking"] is True
    assert sorted((e["args"]["rank"], e["args"]["bytes"]) for e in returns) == [(0, 6 * 4), (2, 4 * 4)]


def test_call_ranks_in_process(tmp_path) -> None:
    check_call_ranks(LocalWorkerGroup(RankEcho, world_size=4), tmp_path)


def test_call_ranks_on_ray(ray_session, tmp_path) -> None:
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    wg = RayWorkerGroup(RayResourcePool([4], use_gpu=False), RayClassWithInitArgs(RankEcho))
    try:
        check_call_ranks(wg, tmp_path)
        # Bounded like any call: past its timeout, a hang report naming the unfinished rank.
        with pytest.raises(HangError, match=r"(?s)nap.*rank 1"):
            wg.call_ranks("nap", [(30.0,)], ranks=[1], timeout_s=1.0)
    finally:
        wg.shutdown()
