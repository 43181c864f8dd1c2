"""MegatronWorker groups on Ray: scripts/validate_rank_mapping.py over several meshes, the live
mismatch detector, and one real subprocess run of the script.

megatron's ``RankGenerator`` is the oracle for what parallel_state must have built.  Every process
costs ~2-4 s to start (it imports torch and megatron-core), so the meshes are 4 ranks except
cpu_demo's actor, the 4-rank meshes share processes (a layout's meshes of one size share a group in
the script; the explicit ones are reported on by one running group), the in-process runs build
their groups in the host bank's running processes (tests/hosts.py), and the subprocess run of the
real command, which adds a Ray of its own and starts its own processes, has 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankmesh.errors import MeshMismatchError
from rankmesh.mesh import RankMesh

pytest.importorskip("megatron.core")
pytest.importorskip("ray")

from tests.megatron_workers import oracle_reports  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "validate_rank_mapping.py"

PP_DP_LAYOUT = """\
name: pp-dp-swapped
description: pp2*dp2 with pp varying before dp (order tp-pp-dp)
cluster: {nodes: 1, devices_per_node: 4}
roles:
  actor: {mesh: {pp: 2, dp: 2, order: tp-pp-dp}}
"""


def _load_script():
    spec = importlib.util.spec_from_file_location("validate_rank_mapping", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def validate_script():
    return _load_script()


def _layout_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("layouts") / "pp_dp_swapped.yaml"
    path.write_text(PP_DP_LAYOUT)
    return str(path)


#: Checked in the command's whole run over every role of cpu_demo (one ``main`` call, below).
CPU_DEMO = {
    "cpu_demo-actor-tp2pp2dp2": ("actor", RankMesh(tp=2, pp=2, dp=2)),
    "cpu_demo-critic-tp2dp2": ("critic", RankMesh(tp=2, dp=2)),
    "cpu_demo-rollout-tp1dp4": ("rollout", RankMesh(dp=4)),
}
#: Checked one by one on a running group of 4 processes, arguments resolved as the command does.
CASES = {
    "cp2dp2": (["--cp", "2", "--dp", "2"], RankMesh(cp=2, dp=2)),
    "tp2dp2-ep2-etp1": (["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1"], RankMesh(tp=2, dp=2, ep=2, etp=1)),
    "file-pp2dp2-tp-pp-dp": (["--layout", "<file>"], RankMesh(pp=2, dp=2, order="tp-pp-dp")),
}


def _check_against_oracle(result: dict, mesh: RankMesh) -> None:
    assert result["ok"], result["verdict"]
    assert result["mesh"]["order"] == mesh.order and result["mesh"]["world_size"] == mesh.world_size
    oracle = {r.rank: r for r in oracle_reports(mesh)}
    assert sorted(r["rank"] for r in result["ranks"]) == list(range(mesh.world_size))
    for row in result["ranks"]:
        got, want = row["parallel_state"], oracle[row["rank"]]
        assert got["groups"] == want.groups, row["rank"]
        assert got["coords"] == want.coords, row["rank"]
        assert got["allreduce"] == want.allreduce, row["rank"]
        assert row["controller"]["groups"] == want.groups
        assert row["mismatches"] == []


@pytest.fixture(scope="module")
def cpu_demo_document(validate_script, host_bank):
    """``validate_rank_mapping.py --layout cpu_demo --json`` in-process: actor (+ colocated ref) on 8
    ranks, critic and rollout on 4 each; the two 4-rank meshes share one group of processes."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = validate_script.main(["--layout", "cpu_demo", "--json"], processes=host_bank.processes())
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize("case", list(CPU_DEMO))
def test_validate_script_in_process_on_cpu_demo(case, cpu_demo_document) -> None:
    code, document = cpu_demo_document
    assert code == 0 and document["ok"]
    role, mesh = CPU_DEMO[case]
    (result,) = [r for r in document["results"] if r["source"] == f"layout cpu_demo role {role}"]
    _check_against_oracle(result, mesh)


def test_meshes_of_one_process_count_are_checked_on_one_group(cpu_demo_document) -> None:
    """critic (tp2·dp2) and rollout (tp1·dp4) ran in the same 4 processes; the actor in 8 others."""
    _, document = cpu_demo_document
    pids = {r["source"].rsplit(" ", 1)[1]: {row["parallel_state"]["pid"] for row in r["ranks"]} for r in document["results"]}
    assert sorted(pids) == ["actor", "critic", "rollout"]  # ref shares the actor's mesh and processes
    assert pids["critic"] == pids["rollout"] and len(pids["critic"]) == 4
    assert len(pids["actor"]) == 8 and not pids["actor"] & pids["critic"]


def test_validate_script_reports_a_mismatch(validate_script, host_bank, capsys) -> None:
    """Workers forced to the default order while the controller's mesh says tp-pp-dp: exit 1."""
    code = validate_script.main(["--pp", "2", "--dp", "2", "--order", "tp-pp-dp", "--force-order", "tp-cp-ep-dp-pp"],
                                processes=host_bank.processes())
    out = capsys.readouterr().out
    assert code == 1
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("VERDICT: FAIL - 4 of 4 ranks disagree"), verdict
    assert "rank 1 (dp0 pp1): coord dp: mesh says 0, workers say 1" in out
    assert "MISMATCH" in out


def test_start_megatron_group_raises_on_mismatch(ray_session) -> None:
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool
    from rankmesh.megatron.group import start_megatron_group
    from rankmesh.megatron.worker import MegatronWorker

    mesh = RankMesh(tp=2, pp=2, order="tp-pp-dp")  # same as default for dp=1 ...
    with pytest.raises(MeshMismatchError) as info:
        # ... so force an order that swaps tp and pp instead.
        start_megatron_group(RayResourcePool([4], use_gpu=False),
                             RayClassWithInitArgs(MegatronWorker, force_order="pp-tp-dp"), mesh)
    err = info.value
    assert sorted({m.rank for m in err.mismatches if m.what == "coord tp"}) == [1, 2]
    assert "rank 1 (tp1 pp0): coord tp: mesh says 1, workers say 0" in str(err)


def test_validate_script_subprocess(ray_session) -> None:
    """The real command: its own local Ray on 127.0.0.1, human output, verdict line, exit 0.

    The session's Ray is running meanwhile (``ray_session``): the script must start a private Ray,
    not attach to it.
    """
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(  # 2 ranks: the in-process cases above cover the larger meshes
        [sys.executable, str(SCRIPT), "--tp", "1", "--pp", "2"],
        capture_output=True, text=True, timeout=280, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("VERDICT: PASS - all 2 ranks agree"), lines[-1]
    assert any(line.strip().startswith("pp     [0, 1]") for line in lines), lines


# ----- other meshes on one running group (last: its processes live until the module ends) -----


@pytest.fixture(scope="module")
def four_ranks(host_bank):
    """ONE running group of 4 MegatronWorkers (own mesh dp=4) that every case of CASES is checked on,
    in processes from the session's host bank (the script's own start-up is run above)."""
    from rankmesh.backends.ray import RayClassWithInitArgs
    from rankmesh.megatron.worker import MegatronWorker

    group = host_bank.build(RayClassWithInitArgs(MegatronWorker), RankMesh(dp=4))
    yield group
    group.destroy_megatron()
    host_bank.give_back(group)


@pytest.mark.parametrize("case", list(CASES))
def test_validate_script_in_process(case, validate_script, four_ranks, tmp_path_factory) -> None:
    argv, mesh = CASES[case]
    argv = [_layout_file(tmp_path_factory) if a == "<file>" else a for a in argv]
    ((label, resolved, counts),) = validate_script.resolve_meshes(validate_script.build_parser().parse_args(argv))
    assert resolved == mesh and counts == [4]
    (result,) = validate_script.report_document([validate_script.validate_on(four_ranks, resolved, source=label)])["results"]
    _check_against_oracle(result, mesh)


def test_reports_on_other_meshes_leave_the_groups_own_parallel_state(four_ranks) -> None:
    """After the reports on other meshes above, every rank is back on its own mesh (dp=4), same processes."""
    from rankmesh.megatron.group import collect_reports

    before = [r.pid for r in collect_reports(four_ranks)]
    other = collect_reports(four_ranks, allreduce=True, mesh=RankMesh(tp=2, dp=2))
    assert [r.coords["tp"] for r in other] == [0, 1, 0, 1]  # the report was on tp2·dp2 ...
    oracle = {r.rank: r for r in oracle_reports(RankMesh(dp=4))}
    for report in collect_reports(four_ranks, allreduce=True):  # ... and the group is back on dp=4
        want = oracle[report.rank]
        assert (report.coords, report.groups, report.allreduce) == (want.coords, want.groups, want.allreduce)
    assert [r.pid for r in collect_reports(four_ranks)] == before


def test_a_report_on_a_mesh_of_another_size_is_refused(four_ranks) -> None:
    from rankmesh.errors import WorkerError
    from rankmesh.megatron.group import collect_reports

    with pytest.raises(WorkerError, match=r"has 8 ranks; this group has 4"):
        collect_reports(four_ranks, mesh=RankMesh(tp=2, dp=4))
