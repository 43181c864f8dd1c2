"""MegatronWorker groups on Ray: scripts/validate_rank_mapping.py over several layouts, the live
mismatch detector, and one real subprocess run of the script.

megatron's ``RankGenerator`` is the oracle for what parallel_state must have built.  Every group
costs ~2 s per rank (each process imports megatron-core), so the layouts are 4 ranks except one,
and the subprocess run of the real command, which adds a Ray of its own, has 2.
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


CASES = {
    "cpu_demo-actor-tp2pp2dp2": (["--layout", "cpu_demo", "--role", "actor"], RankMesh(tp=2, pp=2, dp=2)),
    "cpu_demo-critic-tp2dp2": (["--layout", "cpu_demo", "--role", "critic"], RankMesh(tp=2, dp=2)),
    "cp2dp2": (["--cp", "2", "--dp", "2"], RankMesh(cp=2, dp=2)),
    "tp2dp2-ep2-etp1": (["--tp", "2", "--dp", "2", "--ep", "2", "--etp", "1"], RankMesh(tp=2, dp=2, ep=2, etp=1)),
    "file-pp2dp2-tp-pp-dp": (["--layout", "<file>"], RankMesh(pp=2, dp=2, order="tp-pp-dp")),
}


def _check_against_oracle(document: dict, mesh: RankMesh) -> None:
    assert document["ok"], document["results"][0]["verdict"]
    (result,) = document["results"]
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


@pytest.mark.parametrize("case", list(CASES))
def test_validate_script_in_process(case, validate_script, ray_session, tmp_path_factory, capsys) -> None:
    argv, mesh = CASES[case]
    argv = [_layout_file(tmp_path_factory) if a == "<file>" else a for a in argv]
    assert validate_script.main([*argv, "--json"]) == 0
    _check_against_oracle(json.loads(capsys.readouterr().out), mesh)


def test_validate_script_reports_a_mismatch(validate_script, ray_session, capsys) -> None:
    """Workers forced to the default order while the controller's mesh says tp-pp-dp: exit 1."""
    code = validate_script.main(["--pp", "2", "--dp", "2", "--order", "tp-pp-dp", "--force-order", "tp-cp-ep-dp-pp"])
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
