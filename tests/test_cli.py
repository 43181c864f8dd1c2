"""The ``rankmesh`` command line, run in-process through ``main([...])`` (plus the real console script once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import textwrap
from pathlib import Path

import pytest

from rankmesh import cli
from rankmesh.cli import main

SHIPPED = ["chaos_3node", "cpu_demo", "llama70b_4x8", "long_context_cp", "moe_ep", "multinode_ppo", "single_node_8gpu"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str, prefix: str = "rankmesh: error: ") -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


# ----- list / show -----------------------------------------------------------------------------


def test_layout_list_names_and_describes_every_shipped_layout(capsys):
    code, out, err = run(capsys, "layout", "list")
    assert code == 0 and err == ""
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert set(SHIPPED) <= set(lines)
    assert "Llama-3-70B" in lines["llama70b_4x8"]


def test_show_prints_the_rank_table_and_groups(capsys):
    code, out, err = run(capsys, "layout", "show", "cpu_demo", "--role", "actor")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("layout cpu_demo · role actor · tp2 dp2 pp2")
    header = lines[2].split()
    assert header == ["rank", "node", "local", "tp", "cp", "ep", "dp", "pp", "collect"]
    rows = {int(line.split()[0]): line.split() for line in lines[3:11]}
    assert rows[4] == ["4", "0", "4", "0", "0", "0", "0", "1", "*"]  # dp0's collect rank: tp0, last stage
    assert rows[3] == ["3", "0", "3", "1", "0", "0", "1", "0"]
    assert "  tp  [0, 1] [2, 3] [4, 5] [6, 7]" in out
    assert "  pp  [0, 4] [1, 5] [2, 6] [3, 7]" in out


def test_show_all_roles_of_a_layout(capsys):
    code, out, _ = run(capsys, "layout", "show", "multinode-ppo")
    assert code == 0
    assert [line.split(" · ")[1] for line in out.splitlines() if line.startswith("layout ")] == [
        "role actor", "role ref", "role critic", "role reward", "role rollout",
    ]


def megatron_groups(report: dict, token: str, expert: bool = False) -> list[list[int]]:
    from megatron.core.parallel_state import RankGenerator

    m = report["mesh"]
    if expert:
        gen = RankGenerator(tp=m["etp"], ep=m["ep"], dp=m["edp"], pp=m["pp"], cp=1, order=m["order"])
    else:
        gen = RankGenerator(tp=m["tp"], ep=1, dp=m["dp"], pp=m["pp"], cp=m["cp"], order=m["order"])
    return gen.get_ranks(token)


@pytest.mark.parametrize("name", SHIPPED)
def test_json_groups_equal_megatrons(capsys, name):
    code, out, _ = run(capsys, "layout", "show", name, "--json")
    assert code == 0
    document = json.loads(out)
    assert document["source"].endswith(f"{name}.yaml")
    for report in document["roles"]:
        assert len(report["ranks"]) == report["mesh"]["world_size"]
        for token in ("tp", "cp", "dp", "pp"):
            assert report["groups"][token] == megatron_groups(report, token), (name, report["role"], token)
        assert report["groups"]["ep"] == megatron_groups(report, "ep", expert=True)
        assert report["groups"]["etp"] == megatron_groups(report, "tp", expert=True)


def test_explicit_sizes_with_nodes(capsys):
    code, out, _ = run(capsys, "layout", "show", "--tp", "2", "--pp", "2", "--process-on-nodes", "4,4", "--json")
    assert code == 0
    (report,) = json.loads(out)["roles"]
    assert report["mesh"]["dp"] == 2  # derived: 8 processes / (tp2 * pp2)
    assert [row["node"] for row in report["ranks"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [row["local_rank"] for row in report["ranks"]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert report["collect_ranks"] == [4, 6]
    code, out, _ = run(capsys, "layout", "show", "--tp", "2", "--dp", "4", "--devices-per-node", "4", "--json")
    assert [row["node"] for row in json.loads(out)["roles"][0]["ranks"]] == [0] * 4 + [1] * 4


def test_cp_and_ep_together_use_the_dense_and_expert_views(capsys):
    args = ["layout", "show", "--tp", "1", "--cp", "2", "--ep", "2", "--dp", "2", "--order", "tp-cp-ep-dp-pp", "--json"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    (report,) = json.loads(out)["roles"]
    assert report["groups"]["cp"] == [[0, 1], [2, 3]] == megatron_groups(report, "cp")
    assert report["groups"]["ep"] == [[0, 1], [2, 3]] == megatron_groups(report, "ep", expert=True)


def test_show_one_rank(capsys):
    code, out, _ = run(capsys, "layout", "show", "--tp", "2", "--pp", "2", "--dp", "2", "--rank", "5", "--json")
    assert code == 0
    (report,) = json.loads(out)["roles"]
    assert [row["rank"] for row in report["ranks"]] == [5]
    assert report["groups"]["tp"] == [[4, 5]] and report["groups"]["pp"] == [[1, 5]] and report["groups"]["dp"] == [[5, 7]]


# ----- bad input: one line on stderr, exit 2 ---------------------------------------------------

BAD_FILE = "name: bad\ncluster: {nodes: 1, devices_per_node: 8\n"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--tp", "0"], "tp must be a positive integer, got 0"),
        (["--tp", "-2"], "tp must be a positive integer, got -2"),
        (["--tp", "x"], "argument --tp: invalid int value: 'x'"),
        (["--pp", "1.5"], "argument --pp: invalid int value: '1.5'"),
        (["--tp", "3", "--process-on-nodes", "4,4"], "world_size 8 is not divisible by tp*pp*cp = 3*1*1 = 3"),
        (["--tp", "2", "--dp", "3", "--process-on-nodes", "4,4"], "the mesh has 6 ranks"),
        (["--tp", "2", "--ep", "3"], "not divisible by etp*ep*pp"),
        (["--tp", "2", "--order", "tp-xp-dp-pp"], "unknown axis 'xp'"),
        (["--tp", "2", "--order", "tp-dp-tp"], "axis 'tp' appears twice"),
        (["--tp", "2", "--pp", "2", "--order", "tp-dp"], "leaves out axis 'pp', whose size is 2"),
        (["--process-on-nodes", "4,x"], "expected comma-separated integers"),
        (["--process-on-nodes", "4,0"], "process counts must be positive"),
        (["--tp", "2", "--nodes", "0"], "--nodes must be a positive integer"),
        (["--tp", "2", "--nodes", "2", "--process-on-nodes", "1,1"], "cannot be combined"),
        (["--tp", "2", "--pp", "2", "--dp", "2", "--rank", "8"], "rank 8 is out of range for a mesh of world size 8"),
        (["cpu_demo", "--rank", "-1"], "rank -1 is out of range"),
        (["no_such_layout"], "unknown layout 'no_such_layout' (known layouts: chaos_3node, cpu_demo"),
        (["cpu_demo", "--role", "judge"], "unknown role 'judge' (roles: actor, ref, critic, rollout)"),
        (["cpu_demo", "--tp", "2"], "either a layout or explicit sizes"),
        ([], "give a layout name or file, or explicit sizes"),
        # A bad layout *file* exits 1, as `layout validate` does: test_show_draw_and_validate_exit_alike_for_one_bad_file.
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    code, out, err = run(capsys, "layout", "show", *argv)
    assert code == 2
    assert out == ""
    assert fragment in one_error_line(err)


def test_usage_errors_of_the_parser_are_one_line(capsys):
    # A missing subcommand (`rankmesh`, `rankmesh layout`) prints the usage and the subcommands first:
    # test_a_command_without_its_subcommand_prints_usage_and_the_subcommands.
    for argv in (["frobnicate"], ["layout", "frobnicate"], ["layout", "show", "--bogus"], ["-v", "layout", "show", "-x"]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "", argv
        one_error_line(err)


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "layout", "show", "--help")
    assert code == 0 and "--process-on-nodes" in out


# ----- validate --------------------------------------------------------------------------------

SPANNING = """\
name: spanning
cluster: {process_on_nodes: [6, 6]}
roles:
  actor: {mesh: {tp: 4, dp: 3}}
"""


def test_validate_shipped_layouts_exit_0(capsys):
    code, out, err = run(capsys, "layout", "validate", "--all", "--strict")
    assert code == 0, out + err
    assert sorted(line.split(":")[0] for line in out.splitlines()) == sorted(SHIPPED)
    assert all(line.endswith(": ok") for line in out.splitlines())


def test_validate_warns_on_tp_across_nodes_and_fails_when_strict(capsys, tmp_path):
    path = tmp_path / "spanning.yaml"
    path.write_text(SPANNING)
    code, out, _ = run(capsys, "layout", "validate", str(path))
    assert code == 0
    assert f"{path}: role 'actor', field 'intra_node': warning: 1 tp group(s) cross a node boundary" in out
    assert out.splitlines()[-1] == f"{path}: 0 error(s), 1 warning(s)"
    code, out, _ = run(capsys, "layout", "validate", str(path), "--strict")
    assert code == 1
    assert "field 'intra_node': error: 1 tp group(s)" in out
    # show still works (a warning is not an error) and logs the warning
    code, out, err = run(capsys, "layout", "show", str(path))
    assert code == 0 and out.startswith("layout spanning")
    assert err.startswith(f"rankmesh: WARNING: {path}: role 'actor', field 'intra_node': 1 tp group(s)")


def test_validate_lists_every_problem_and_exits_1(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            name: broken
            cluster: {nodes: 1, devices_per_node: 8}
            roles:
              actor: {mesh: {tp: 0}}
              critic: {mesh: {tp: 3}}
              ref: {mesh: {tp: 2, dp: 2}, colocate_with: [actor]}
            """
        )
    )
    code, out, _ = run(capsys, "layout", "validate", str(path))
    assert code == 1
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert len(errors) == 3, out
    assert "role 'actor', field 'mesh.tp'" in errors[0]
    assert "role 'critic', field 'mesh'" in errors[1]
    assert "role 'ref', field 'mesh'" in errors[2]
    code, out, err = run(capsys, "layout", "show", str(path))
    assert code == 1 and "(and 2 more problem(s)" in one_error_line(err)  # an invalid file: 1, as validate


def test_validate_malformed_yaml_exits_1_with_one_line(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_FILE)
    code, out, err = run(capsys, "layout", "validate", str(path))
    assert code == 1 and out == ""
    assert "malformed YAML" in one_error_line(err)


def test_validate_unknown_name_is_a_usage_error(capsys):
    code, out, err = run(capsys, "layout", "validate", "cpu_demo", "nope")
    assert code == 2 and out == ""
    assert "unknown layout 'nope'" in one_error_line(err)


# ----- extending the command line --------------------------------------------------------------


def test_other_modules_can_register_commands(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_COMMANDS", dict(cli._COMMANDS))
    seen = []

    def setup(parser):
        parser.add_argument("--steps", type=int, default=1)
        parser.set_defaults(handler=lambda args: seen.append(args.steps) or 0)

    cli.add_command("demo-test", setup, help="a test command")
    cli.add_command("demo-test", setup)  # idempotent
    with pytest.raises(ValueError):
        cli.add_command("demo-test", lambda parser: None)
    code, _, _ = run(capsys, "demo-test", "--steps", "3")
    assert code == 0 and seen == [3]


# ----- the real console script -----------------------------------------------------------------


def test_console_script_and_python_m(tmp_path):
    script = Path(sys.executable).with_name("rankmesh")
    if not script.exists():
        pytest.skip("the rankmesh console script is not installed in this environment")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [str(script), "layout", "show", "cpu_demo", "--role", "critic", "--json"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["roles"][0]["groups"]["tp"] == [[0, 1], [2, 3]]
    done = subprocess.run(
        [sys.executable, "-m", "rankmesh", "layout", "show", "--tp", "0"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert one_error_line(done.stderr) == "rankmesh: error: tp must be a positive integer, got 0"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kill-at-iteration", "2"], "--kill-at-iteration needs --kill-rank"),
        (["--kill-rank", "8"], "--kill-rank must be an actor rank, 0 to 7"),  # cpu_demo's actor: tp2·pp2·dp2
        (["--kill-rank", "1", "--kill-at-iteration", "5"], "between 1 and --iterations (4)"),
        (["--spares", "-1"], "--spares must be 0 or more (warm standby processes of each group), got -1"),
        (["--call-timeout", "0"], "--call-timeout must be a positive number of seconds, got 0.0"),
        # Every option against the layout and the model (the demo model: 4 heads, hidden 32, 2 layers, 32 rows).
        (["--layout", "nosuch"], "--layout nosuch: unknown layout 'nosuch'"),
        (["--no-layout", "--actor-tp", "3"], "--actor-tp 3: the demo model's num_heads=4 is not divisible by tp=3"),
        (["--no-layout", "--critic-tp", "8"], "--critic-tp 8: the demo model's num_heads=4 is not divisible by tp=8"),
        (["--actor-tp", "4"], "--actor-tp: explicit mesh sizes need --no-layout"),
        (["--no-layout", "--actor-pp", "3"], "--actor-pp 3: the demo model has 2 layers"),
        (["--no-layout", "--actor-dp", "3"], "32 rows do not split evenly over the actor's dp=3 (--actor-dp)"),
        (["--no-layout", "--rollout-dp", "0"], "--rollout-dp must be a positive integer, got 0"),
        (["--prompts", "0"], "--prompts must be a positive integer, got 0"),
        (["--iterations", "1"], "--iterations must be at least 2"),
        (["--hang-rank", "99"], "--hang-rank 99 is not a rank of the actor group"),
    ],
)
def test_demo_options_are_checked_before_anything_starts(capsys, argv, message):
    started = time.perf_counter()
    code, out, err = run(capsys, "demo", *argv)
    assert code == 2 and out == ""
    line = one_error_line(err, prefix="rankmesh demo: error: ")
    assert message in line, line
    assert time.perf_counter() - started < 5  # no Ray start-up before the verdict


def test_validate_pools_with_conflicting_labels_on_one_node_exits_1(capsys, tmp_path):
    path = tmp_path / "labels.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            name: labels
            cluster: {nodes: 1, devices_per_node: 8}
            pools:
              train: {process_on_nodes: [4], node_labels: {gpu: a100}}
              gen: {process_on_nodes: [4], node_labels: {gpu: h100}}
            roles:
              actor: {pool: train, mesh: {tp: 4}}
              rollout: {pool: gen, mesh: {tp: 4}}
            """
        )
    )
    code, out, _ = run(capsys, "layout", "validate", str(path))
    assert code == 1
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert len(errors) == 1, out
    assert "pool 'train' requires gpu=a100 and pool 'gen' requires gpu=h100 on node 0" in errors[0]


# ----- bad paths: one line naming the path and what is wrong ------------------------------------


def test_every_bad_layout_path_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    cases = {
        "./missing.yaml": "./missing.yaml: no such layout file",
        str(tmp_path / "missing.yaml"): f"{tmp_path / 'missing.yaml'}: no such layout file",
        "adir": "adir: is a directory, not a layout file",
        str(tmp_path / "adir"): f"{tmp_path / 'adir'}: is a directory, not a layout file",
        "missing.yaml": "unknown layout 'missing'",  # a bare file name is looked up like a name
    }
    for arg, fragment in cases.items():
        code, out, err = run(capsys, "layout", "show", arg)
        assert code == 2 and out == "", arg
        assert fragment in one_error_line(err), (arg, err)


def test_draw_to_a_missing_directory_is_one_line_and_writes_nothing(capsys, tmp_path):
    target = tmp_path / "nonexistent" / "x.png"
    code, out, err = run(capsys, "layout", "draw", "cpu_demo", "-o", str(target))
    assert code == 2 and out == ""
    assert f"directory '{target.parent}' does not exist" in one_error_line(err)
    code, out, err = run(capsys, "layout", "draw", "cpu_demo", "-o", str(tmp_path))
    assert code == 2 and "must end in" in one_error_line(err)


def test_trace_commands_name_a_bad_path(capsys, tmp_path):
    code, out, err = run(capsys, "trace", "summarize", str(tmp_path))
    assert code == 2 and f"{tmp_path}: is a directory, not a trace file" in one_error_line(err)
    code, out, err = run(capsys, "trace", "plot", str(tmp_path / "t.json"), "-o", str(tmp_path / "no" / "t.png"))
    assert code == 2 and "does not exist" in one_error_line(err)


def test_top_level_help_names_every_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    description = out.split("positional arguments")[0]
    for word in ("layouts", "traces", "demo"):
        assert word in description, description


def test_show_says_where_a_pool_runs_in_words(capsys):
    expected = {  # hand-written from the shipped YAML files
        "cpu_demo": "pool global: 8 ranks, 8 on node 0 ·",
        "multinode_ppo": "pool train_pool: 16 ranks, 8 on node 0 and 8 on node 1 ·",
        "llama70b_4x8": "pool global: 32 ranks, 8 on each of nodes 0-3 ·",
    }
    for name, fragment in expected.items():
        code, out, _ = run(capsys, "layout", "show", name, "--role", "actor")
        assert code == 0 and fragment in out.splitlines()[0], out.splitlines()[0]
        assert "node(s)" not in out


# ----- issue 45, item 12: the first hour at the command line ------------------------------------


@pytest.mark.parametrize(
    "argv, prog, subcommands",
    [
        ([], "rankmesh", ("layout", "trace", "demo")),
        (["layout"], "rankmesh layout", ("list", "show", "validate", "draw")),
        (["trace"], "rankmesh trace", ("summarize", "plot")),
    ],
)
def test_a_command_without_its_subcommand_prints_usage_and_the_subcommands(capsys, argv, prog, subcommands):
    """argparse's convention for a usage error: usage on stderr, exit 2, nothing on stdout."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", (argv, out)
    assert err.startswith(f"usage: {prog} "), err
    listed = {line.split()[0] for line in err.splitlines() if line.startswith("    ")}
    assert set(subcommands) <= listed, err
    last = err.splitlines()[-1]
    assert last.startswith(f"{prog}: error: ") and "Traceback" not in err
    assert all(name in last for name in subcommands), last


def test_verbose_works_before_and_after_the_subcommand(capsys, tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("name: one\ncluster: {nodes: 1, devices_per_node: 2}\nroles:\n  actor: {mesh: {tp: 2}}\n")
    quiet, _, err = run(capsys, "layout", "show", str(path))
    assert quiet == 0 and "loaded layout" not in err
    for argv in (["-vv", "layout", "show", str(path)], ["layout", "show", str(path), "-vv"],
                 ["-v", "layout", "show", str(path), "-v"], ["layout", "-v", "show", "-v", str(path)]):
        code, out, err = run(capsys, *argv)
        assert code == 0 and out.startswith("layout one"), (argv, err)
        assert f"rankmesh: DEBUG: loaded layout one from {path}" in err, (argv, err)  # -vv: debug
    code, _, err = run(capsys, "layout", "show", str(path), "-v")
    assert code == 0 and "DEBUG" not in err  # one -v is info, not debug


def test_layout_list_json_has_the_fields_the_text_shows(capsys):
    code, text, _ = run(capsys, "layout", "list")
    code_json, out, err = run(capsys, "layout", "list", "--json")
    assert code == code_json == 0 and err == ""
    listed = json.loads(out)
    assert [entry["name"] for entry in listed] == [line.split()[0] for line in text.splitlines()]
    by_name = {entry["name"]: entry for entry in listed}
    assert set(SHIPPED) <= set(by_name)
    assert by_name["llama70b_4x8"]["description"].startswith("Llama-3-70B on 4x8 GPUs")
    assert by_name["cpu_demo"]["source"].endswith("cpu_demo.yaml")


BROKEN = """\
name: broken
cluster: {nodes: 1, devices_per_node: 8}
roles:
  actor: {mesh: {tp: 0}}
  critic: {mesh: {tp: 3}}
"""


def test_show_names_a_bad_file_in_one_clean_line(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(BROKEN)
    code, out, err = run(capsys, "layout", "show", str(path))
    line = one_error_line(err)
    assert out == "" and line.count("error") == 1, line
    assert line == (f"rankmesh: error: {path}: role 'actor', field 'mesh.tp': tp must be a positive integer, got 0"
                    " (and 1 more problem(s); run `rankmesh layout validate`)")


@pytest.mark.parametrize("content", [BAD_FILE, BROKEN], ids=["malformed", "invalid"])
def test_show_draw_and_validate_exit_alike_for_one_bad_file(capsys, tmp_path, content):
    """A file that is found but is not a valid layout exits 1 in every command; 2 is the command line's fault."""
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    codes = {}
    for argv in (["show", str(path)], ["show", str(path), "--json"], ["draw", str(path), "-o", str(tmp_path / "x.png")],
                 ["validate", str(path)]):
        codes[argv[0] + " ".join(argv[2:3])] = run(capsys, "layout", *argv)[0]
    assert set(codes.values()) == {1}, codes
    code, _, err = run(capsys, "layout", "show", str(tmp_path / "missing.yaml"))  # no such file: usage, as before
    assert code == 2 and "no such layout file" in one_error_line(err)
