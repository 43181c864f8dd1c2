"""The controller's cross-check of parallel_state against the RankMesh (pure, plus real groups in forks).

megatron-core's ``RankGenerator`` is the oracle: reports built from it must agree with a correct
mesh and disagree, rank by rank, with a deliberately wrong one.
"""

from __future__ import annotations

import pickle

import pytest

from rankmesh.errors import MeshMismatchError, RankMeshError
from rankmesh.megatron.check import (
    COORDS,
    GROUPS,
    Mismatch,
    RankReport,
    check_reports,
    compare_reports,
    expected_report,
)
from rankmesh.mesh import RankMesh

pytest.importorskip("megatron.core")
from tests.megatron_workers import oracle_reports  # noqa: E402

MESHES = [
    RankMesh(tp=2, pp=2, dp=2),
    RankMesh(tp=2, pp=2, dp=2, order="tp-pp-dp"),
    RankMesh(tp=2, cp=2, dp=2),
    RankMesh(tp=2, dp=2, ep=2, etp=1),
    RankMesh(tp=1, pp=2, dp=4, ep=2),
    RankMesh(pp=4),
]


@pytest.mark.parametrize("mesh", MESHES, ids=repr)
def test_expected_report_matches_rank_generator(mesh: RankMesh) -> None:
    for report in oracle_reports(mesh):
        want = expected_report(mesh, report.rank)
        assert want.groups == report.groups
        assert want.coords == report.coords
        assert want.allreduce == report.allreduce
    assert compare_reports(mesh, oracle_reports(mesh)) == []
    check_reports(mesh, oracle_reports(mesh))  # does not raise


def test_wrong_order_is_detected() -> None:
    """Workers built with the default order, controller believing tp-pp-dp: the check must fail."""
    workers = oracle_reports(RankMesh(tp=2, pp=2, dp=2))  # default order tp-cp-ep-dp-pp
    controller = RankMesh(tp=2, pp=2, dp=2, order="tp-pp-dp")
    mismatches = compare_reports(controller, workers)
    # Ranks 0, 1, 6, 7 keep their coordinates in both orders, 2..5 swap dp and pp; every rank's
    # dp and pp groups differ ([0, 2] vs [0, 4] ...).
    assert sorted({m.rank for m in mismatches if m.what.startswith("coord")}) == [2, 3, 4, 5]
    assert sorted({m.rank for m in mismatches if m.what == "group dp"}) == list(range(8))
    assert Mismatch(2, "coord dp", 0, 1) in mismatches
    assert Mismatch(2, "coord pp", 1, 0) in mismatches
    assert any(m.what == "group dp" and m.rank == 0 for m in mismatches)
    with pytest.raises(MeshMismatchError) as info:
        check_reports(controller, workers)
    err = info.value
    assert isinstance(err, RankMeshError)
    assert "8 of 8 ranks disagree" in str(err) and "ranks [0, 1, 2, 3, 4, 5, 6, 7]" in str(err)
    assert "rank 2 (tp0 dp0 pp1): coord dp: mesh says 0, workers say 1" in str(err)
    assert err.mismatches == mismatches
    again = pickle.loads(pickle.dumps(err))  # crosses process boundaries intact
    assert again.mismatches == mismatches and str(again) == str(err)


def test_wrong_sizes_missing_and_duplicate_ranks() -> None:
    mesh = RankMesh(tp=2, dp=2)
    reports = oracle_reports(RankMesh(tp=4))
    whats = {m.what for m in compare_reports(mesh, reports)}
    assert {"size tp", "size dp", "group tp", "coord tp"} <= whats
    good = oracle_reports(mesh)
    missing = compare_reports(mesh, good[:-1])
    assert missing == [Mismatch(3, "reports", 1, 0)]
    dup = compare_reports(mesh, good + [good[0]])
    assert dup == [Mismatch(0, "reports", 1, 2)]
    stray = RankReport(**{**good[0].to_dict(), "rank": 9})
    assert Mismatch(9, "rank", "0..3", 9) in compare_reports(mesh, good + [stray])


def test_allreduce_is_checked_when_present() -> None:
    mesh = RankMesh(tp=2, dp=2)
    reports = oracle_reports(mesh)
    reports[1].allreduce["dp"] = 99
    assert compare_reports(mesh, reports) == [Mismatch(1, "all-reduce dp", 4, 99)]
    reports[1].allreduce = {}  # coordinates-only reports are fine
    assert compare_reports(mesh, reports) == []


def test_report_round_trip() -> None:
    report = oracle_reports(RankMesh(tp=2, pp=2))[3]
    assert RankReport.from_dict(report.to_dict()) == report
    assert set(report.groups) == set(GROUPS) and set(report.coords) == set(COORDS)


def test_real_parallel_state_in_forked_group() -> None:
    """Real workers (forked processes, gloo): correct order agrees, a forced wrong order is caught."""
    from tests.megatron_workers import ReportWorker, construct_worker, run_forked

    mesh = RankMesh(tp=2, pp=2, dp=2, order="tp-pp-dp")

    def report(force: str | None):
        def fn(rank: int, world: int) -> dict:
            worker = construct_worker(ReportWorker, mesh, rank, force_order=force)
            try:
                if force is None:  # rank_info comes from parallel_state's getters
                    assert worker.rank_info == mesh.coords(rank), (worker.rank_info, mesh.coords(rank))
                    assert worker.global_info == mesh.global_info
                return worker.megatron_report(allreduce=True)
            finally:
                worker.destroy_megatron()
        return fn

    good = [RankReport.from_dict(r) for r in run_forked(report(None), mesh.world_size)]
    check_reports(mesh, good)
    bad = [RankReport.from_dict(r) for r in run_forked(report("tp-cp-ep-dp-pp"), mesh.world_size)]
    with pytest.raises(MeshMismatchError, match=r"rank 2 \(tp0 dp0 pp1\): coord dp"):
        check_reports(mesh, bad)
