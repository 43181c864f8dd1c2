"""One rank, one name: every error, report, trace track and check prints a rank's coordinates alike.

Expected strings are written by hand from megatron's default order ``tp-cp-ep-dp-pp`` (first
axis fastest): on a tp2·pp2·dp2 mesh rank = tp + 2*dp + 4*pp, so rank 5 = 1 + 2*0 + 4*1 is
tp1 dp0 pp1, and rank 7 is tp1 dp1 pp1.  Labels list ``tp cp ep dp pp`` in that fixed order and
leave out the axes of size 1.
"""

from __future__ import annotations

import json
import pickle

import pytest

from rankmesh.backend import merge_failures
from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.backends.ray.recovery import ReplacementReport, restore_peers
from rankmesh.errors import MeshError, ShardLostError, WorkerDiedError, WorkerError
from rankmesh.hangs import HangReport, RankHang
from rankmesh.hangs.report import DEAD
from rankmesh.megatron.check import RankReport, compare_report, expected_report
from rankmesh.mesh import RankCoords, RankMesh
from rankmesh.tracing import trace

from .reliability_workers import FaultWorker

RANK = 5
LABEL = "tp1 dp0 pp1"  # rank 5 of tp2·pp2·dp2, by hand (see the module docstring)
NAMED = f"rank {RANK} ({LABEL})"


def test_label_order_and_the_size_one_rule():
    assert RankMesh(tp=2, pp=2, dp=2).rank_coords(5).label() == LABEL
    # The mesh's own order does not change the printed order: with tp-pp-dp, rank = tp + 2*pp + 4*dp,
    # so rank 5 is tp1 pp0 dp1, printed dp before pp as everywhere.
    assert RankMesh(tp=2, pp=2, dp=2, order="tp-pp-dp").rank_coords(5).label() == "tp1 dp1 pp0"
    # cp is shown when it has more than one rank: tp2 cp2 dp2, rank = tp + 2*cp + 4*dp; rank 6 = tp0 cp1 dp1.
    assert RankMesh(tp=2, cp=2, dp=2).rank_coords(6).label() == "tp0 cp1 dp1"
    # ep comes from the expert view (etp=tp=2, ep=2, edp=2; expert rank = etp + 2*ep + 4*edp):
    # rank 6 is dense tp0 dp3 and expert ep1.
    moe = RankMesh(tp=2, dp=4, ep=2).rank_coords(6)
    assert moe.label() == "tp0 ep1 dp3"
    assert moe.to_dict() == {"tp": 0, "cp": 0, "ep": 1, "dp": 3, "pp": 0}
    assert list(moe.to_dict()) == ["tp", "cp", "ep", "dp", "pp"]  # the JSON form has every axis, in order
    assert RankMesh(dp=4).rank_coords(3).label() == "dp3"
    single = RankMesh().rank_coords(0)
    assert single.label() == "" and single.rank_text(0) == "rank 0"
    assert RankMesh(tp=2, pp=2, dp=2).rank_coords(5).rank_text(5) == NAMED
    with pytest.raises(MeshError, match="out of range"):
        RankMesh(tp=2).rank_coords(2)


def test_a_merged_error_names_the_other_ranks_once():
    # Issue 45 item 14: the merge said the other ranks twice, "(and 3 other ranks)" from the
    # checkpoint's agreement and "(and 3 more rank(s): [1, 2, 3])" from the merge.  tp2·dp2 by hand:
    # rank = tp + 2*dp, so rank 0 is tp0 dp0 and rank 1 is tp1 dp0.
    mesh = RankMesh(tp=2, dp=2)
    errors = {r: WorkerError(r, mesh.rank_coords(r), "load_checkpoint", "CheckpointError: no checkpoint at 'x'", "n0")
              for r in range(4)}
    merged = merge_failures([(r, "n0", e.coords, e) for r, e in sorted(errors.items(), reverse=True)])
    assert str(merged) == ("rank 0 (tp0 dp0) on node n0 and 3 other ranks [1, 2, 3] failed in load_checkpoint: "
                           "CheckpointError: no checkpoint at 'x'")
    assert (merged.rank, [o.rank for o in merged.others]) == (0, [1, 2, 3])
    assert str(pickle.loads(pickle.dumps(merged))) == str(merged)
    # One other rank reads in the singular; the others keep their own one-rank text.
    two = merge_failures([(r, "n0", errors[r].coords, WorkerError(r, mesh.rank_coords(r), "act", "E: x")) for r in (3, 1)])
    assert str(two) == "rank 1 (tp1 dp0) and 1 other rank [3] failed in act: E: x"
    assert str(two.others[0]) == "rank 3 (tp1 dp1) failed in act: E: x"
    # Two steps of one rank failing in one wait (a rank's start and its port) name the rank once.
    twice = merge_failures([(0, None, None, WorkerError(0, None, "start", "E: x")),
                            (0, None, None, WorkerError(0, None, "start", "E: x"))])
    assert str(twice) == "rank 0 failed in start: E: x"


def test_bad_records_are_refused():
    with pytest.raises(MeshError, match=r"unknown axis 'xp' \(known axes: tp, cp, ep, dp, pp\)"):
        RankCoords(tp=1, shown=("tp", "xp"))
    with pytest.raises(MeshError, match="RankCoords dp must be a non-negative integer, got -1"):
        RankCoords(dp=-1)


def test_every_place_names_a_rank_alike(tmp_path):
    mesh = RankMesh(tp=2, pp=2, dp=2)
    wg = LocalWorkerGroup(FaultWorker, mesh=mesh)
    plan = ["ok"] * mesh.world_size

    # A worker error, raised by the real worker call path, and after pickling.
    with pytest.raises(WorkerError) as info:
        wg.act([*plan[:RANK], "raise", *plan[RANK + 1:]])
    err = info.value
    assert str(err).startswith(f"{NAMED} on node localhost failed in FaultWorker.act: ValueError"), str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    assert err.cause == "builtins.ValueError" and pickle.loads(pickle.dumps(err)).cause == err.cause  # the rank's class
    coords = err.coords
    assert coords.to_dict() == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}

    # A dead rank.
    died = WorkerDiedError(RANK, "act", "gone", "n0", coords={RANK: coords})
    assert str(died) == f"{NAMED} on node n0 died during act: gone"

    # A hang report line.
    hang = HangReport("act", 3.0, (RankHang(RANK, coords, "n0", DEAD, detail="gone"),), finished=(0, 1, 2, 3, 4, 6, 7))
    assert f"  {NAMED} on node n0: process dead (gone)" in hang.text().splitlines()

    # A recovery report, and the error when a shard has no live copy (rank 7 is rank 5's only dp peer).
    report = ReplacementReport([RANK], {RANK: 7}, {RANK: coords}, old_nodes={RANK: "n0"}, new_nodes={RANK: "n1"},
                               new_pids={RANK: 42})
    assert f"({NAMED}: n0 -> n1 (pid 42, restored from rank 7))" in report.format()
    with pytest.raises(ShardLostError) as lost:
        restore_peers(mesh, [RANK, 7])
    assert f"no live rank holds the shard of {NAMED}, rank 7 (tp1 dp1 pp1) (every dp copy of it died)" in str(lost.value)

    # A megatron cross-check message: the worker at rank 5 claims dp 1.
    good = expected_report(mesh, RANK)
    bad = RankReport(**{**good.to_dict(), "coords": {**good.coords, "dp": 1}})
    assert [str(m) for m in compare_report(mesh, bad)] == [f"{NAMED}: coord dp: mesh says 0, workers say 1"]

    # The trace's track of the rank.
    path = tmp_path / "t.json"
    with trace(path):
        assert wg.act(plan) == list(range(mesh.world_size))
    names = {e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "thread_name"}
    assert f"rank {RANK} · {LABEL} · local" in names


def test_coords_is_verls_record_and_rank_coords_the_printed_one():
    """Issue 45 item 9: ``mesh.coords(r)`` is verl's ``DistRankInfo`` (``tp_rank``, ... ``edp_rank``: what
    worker code reads), ``mesh.rank_coords(r)`` rankmesh's ``RankCoords`` (``label()``: how messages print
    a rank).  One rank, the same numbers, two shapes; each docstring says which is which."""
    from rankmesh.mesh import DistRankInfo

    mesh = RankMesh(tp=2, pp=2, dp=2)
    # by hand (module docstring): rank 5 is tp1 dp0 pp1; no ep, so the expert view repeats the dense one
    assert mesh.coords(RANK) == DistRankInfo(tp_rank=1, dp_rank=0, pp_rank=1, cp_rank=0, ep_rank=0, etp_rank=1, edp_rank=0)
    assert mesh.rank_coords(RANK).label() == LABEL
    moe = RankMesh.for_world(16, tp=2, pp=2, ep=2, etp=1)
    for rank in range(moe.world_size):
        verl, ours = moe.coords(rank), moe.rank_coords(rank)
        assert (verl.tp_rank, verl.cp_rank, verl.ep_rank, verl.dp_rank, verl.pp_rank) == tuple(ours.to_dict().values())
    # One way to print a rank: DistRankInfo has no sizes, so it cannot leave out the size-1 axes as label() does.
    assert not hasattr(DistRankInfo, "label")
    for method, names in ((RankMesh.coords, ("DistRankInfo", "verl", "rank_coords")),
                          (RankMesh.rank_coords, ("RankCoords", "label", ":meth:`coords`")),
                          (DistRankInfo, ("verl", "rank_coords"))):
        missing = [name for name in names if name not in (method.__doc__ or "")]
        assert not missing, f"{method.__qualname__}'s docstring does not say {missing}"
