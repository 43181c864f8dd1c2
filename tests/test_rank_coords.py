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
