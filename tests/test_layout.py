"""Layout files: every shipped layout loads, validates and has the hand-derived groups; bad files fail clearly."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from rankmesh import LayoutError, Placement, RankMesh, RankMeshError
from rankmesh.layout import (
    check_layout,
    LAYOUTS_ENV,
    Layout,
    LayoutNotFoundError,
    PoolSpec,
    Problem,
    LayoutRole,
    find_layout,
    layout_dirs,
    list_layouts,
    load_layout,
    parse_layout,
    validate_layout,
)

SHIPPED = ["chaos_3node", "cpu_demo", "llama70b_4x8", "long_context_cp", "moe_ep", "multinode_ppo", "single_node_8gpu"]

# Hand-derived from megatron's order tp-cp-ep-dp-pp (tp fastest): stride tp=1, then cp, dp, pp.
TP2_PP2_DP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "collect": [4, 6],
}
TP4_PP2_DP2 = {
    "tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "pp": [[i, i + 8] for i in range(8)],
    "collect": [8, 12],
}
TP2_PP2_DP2_WORLD8 = TP2_PP2_DP2

EXPECTED: dict[str, dict[str, dict]] = {
    # Order tp-cp-ep-pp-dp (pp fastest): rank = pp + 2 * dp, so each replica's ranks are consecutive.
    "chaos_3node": {
        **{role: {"world": 4, "pool": "global", "tp": [[0], [1], [2], [3]], "pp": [[0, 1], [2, 3]],
                  "dp": [[0, 2], [1, 3]], "collect": [1, 3]} for role in ("actor", "ref")},
        "critic": {"world": 2, "pool": "critic_pool", "tp": [[0], [1]], "dp": [[0, 1]], "collect": [0, 1]},
        "rollout": {"world": 2, "pool": "rollout_pool", "tp": [[0], [1]], "dp": [[0, 1]], "collect": [0, 1]},
    },
    "cpu_demo": {
        "actor": {"world": 8, "pool": "global", **TP2_PP2_DP2},
        "ref": {"world": 8, "pool": "global", **TP2_PP2_DP2},
        "critic": {
            "world": 4,
            "pool": "critic_pool",
            "tp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "pp": [[0], [1], [2], [3]],
            "collect": [0, 2],
        },
        "rollout": {
            "world": 4,
            "pool": "rollout_pool",
            "tp": [[0], [1], [2], [3]],
            "dp": [[0, 1, 2, 3]],
            "pp": [[0], [1], [2], [3]],
            "collect": [0, 1, 2, 3],
        },
    },
    "single_node_8gpu": {
        "actor": {"world": 8, "pool": "global", **TP2_PP2_DP2},
        "ref": {"world": 8, "pool": "global", **TP2_PP2_DP2},
    },
    "llama70b_4x8": {
        role: {
            "world": 32,
            "pool": "global",
            "tp": [list(range(8 * n, 8 * n + 8)) for n in range(4)],
            "pp": [[i, i + 8, i + 16, i + 24] for i in range(8)],
            "dp": [[i] for i in range(32)],
            "collect": [24],
        }
        for role in ("actor", "ref")
    },
    "long_context_cp": {
        "actor": {
            "world": 16,
            "pool": "global",
            "tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "cp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "dp": [[i, i + 8] for i in range(8)],
            "collect": [0, 8],
        }
    },
    "moe_ep": {
        role: {
            "world": 16,
            "pool": "global",
            "tp": [[2 * i, 2 * i + 1] for i in range(8)],
            "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
            "pp": [[i, i + 8] for i in range(8)],
            "expert_ep": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
            "expert_dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            "collect": [8, 10, 12, 14],
        }
        for role in ("actor", "ref")
    },
    "multinode_ppo": {
        "actor": {"world": 16, "pool": "train_pool", **TP4_PP2_DP2},
        "ref": {"world": 16, "pool": "train_pool", **TP4_PP2_DP2},
        "critic": {"world": 8, "pool": "critic_pool", **TP2_PP2_DP2_WORLD8},
        "reward": {"world": 8, "pool": "critic_pool", **TP2_PP2_DP2_WORLD8},
        "rollout": {
            "world": 8,
            "pool": "rollout_pool",
            "tp": [[0, 1, 2, 3], [4, 5, 6, 7]],
            "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            "collect": [0, 4],
        },
    },
}

CLUSTERS = {
    "chaos_3node": (4, 4),
    "cpu_demo": (16,),
    "single_node_8gpu": (8,),
    "llama70b_4x8": (8, 8, 8, 8),
    "long_context_cp": (8, 8),
    "moe_ep": (8, 8),
    "multinode_ppo": (8, 8, 8, 8),
}


def write(tmp_path: Path, text: str, name: str = "custom.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = """
name: custom
cluster: {nodes: 1, devices_per_node: 8}
roles:
  actor: {mesh: {tp: 2, pp: 2}}
"""


# ----- shipped layouts -------------------------------------------------------------------------


def test_every_shipped_layout_is_listed():
    assert set(SHIPPED) <= set(list_layouts())
    assert set(EXPECTED) == set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_layout_loads_and_validates_strictly(name):
    layout = load_layout(name)
    assert layout.description
    assert layout.cluster.process_on_nodes == CLUSTERS[name]
    assert validate_layout(layout, strict=True) == []
    assert set(layout.roles) == set(EXPECTED[name])


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_layout_groups_are_the_hand_derived_ones(name):
    layout = load_layout(name)
    for role_name, expected in EXPECTED[name].items():
        role = layout.role(role_name)
        mesh = role.mesh()
        assert isinstance(mesh, RankMesh)
        assert isinstance(role.placement(), Placement)
        assert mesh.world_size == expected["world"] == role.pool.world_size
        assert role.pool.name == expected["pool"]
        for token in ("tp", "cp", "dp", "pp"):
            if token in expected:
                assert mesh.groups(token) == expected[token], (role_name, token)
        if "expert_ep" in expected:
            assert mesh.groups("ep", expert=True) == expected["expert_ep"]
            assert mesh.groups("dp", expert=True) == expected["expert_dp"]
        assert mesh.collect_ranks() == expected["collect"]


def test_load_by_hyphenated_name_and_by_path():
    by_name = load_layout("cpu-demo")
    path = find_layout("cpu_demo")
    assert path.name == "cpu_demo.yaml"
    assert load_layout(path) == by_name
    assert load_layout(str(path)).name == "cpu_demo"
    assert load_layout("cpu_demo.yaml") == by_name  # a bare file name falls back to the name lookup


def test_every_shipped_layout_is_named_by_its_file_stem():
    # One spelling: what `layout list` shows, what reports print and what the file is called.
    for name in list_layouts():
        assert load_layout(name, check=False).name == name == find_layout(name).stem


def test_multinode_pools_sit_on_their_nodes():
    layout = load_layout("multinode_ppo")
    assert layout.pools["train_pool"].nodes == (0, 1)
    assert layout.pools["critic_pool"].nodes == (2,)
    assert layout.role("rollout").cluster_node(5) == 3
    assert layout.role("actor").cluster_node(9) == 1
    groups = {frozenset(g) for g in layout.colocation_groups()}
    assert groups == {frozenset({"actor", "ref"}), frozenset({"critic", "reward"}), frozenset({"rollout"})}


def test_env_var_directory_is_searched_first(tmp_path, monkeypatch):
    write(tmp_path, MINIMAL.replace("name: custom", "name: mine"), "mine.yaml")
    monkeypatch.setenv(LAYOUTS_ENV, str(tmp_path))
    assert layout_dirs()[0] == tmp_path
    assert "mine" in list_layouts() and "cpu_demo" in list_layouts()
    layout = load_layout("mine")
    assert layout.role("actor").mesh().size("dp") == 2  # derived: 8 / (tp2 * pp2)


def test_from_mesh_round_trip():
    mesh = RankMesh(tp=2, cp=2, dp=2, ep=2)
    layout = Layout.from_mesh(mesh, [4, 4])
    assert layout.role("mesh").mesh() == mesh
    assert validate_layout(layout) == []


# ----- structural errors: LayoutError naming file, role and field ------------------------------


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("name: x\ncluster: {nodes: 1\n", ["malformed YAML", "line"]),
        ("- just\n- a list\n", ["expected a mapping"]),
        ("cluster: {nodes: 1, devices_per_node: 8}\nroles: {a: {mesh: {}}}\n", ["field 'name'", "missing"]),
        (MINIMAL + "colour: blue\n", ["field 'colour'", "unknown field"]),
        (MINIMAL.replace("tp: 2, pp: 2", "tp: 2, pp: 2, zp: 3"), ["role 'actor'", "field 'mesh.zp'", "unknown"]),
        (MINIMAL.replace("tp: 2", "tp: two"), ["role 'actor'", "field 'mesh.tp'", "expected an integer", "'two'"]),
        (MINIMAL.replace("tp: 2", "tp: 2.0"), ["role 'actor'", "field 'mesh.tp'", "float"]),
        (MINIMAL.replace("tp: 2", "tp: true"), ["role 'actor'", "field 'mesh.tp'"]),
        (MINIMAL.replace("{mesh:", "{colocate_with: ref, mesh:"), ["role 'actor'", "field 'colocate_with'", "list"]),
        (MINIMAL.replace("{mesh:", "{pool: gpus, mesh:"), ["role 'actor'", "field 'pool'", "unknown pool 'gpus'"]),
        (MINIMAL.replace("{mesh: {tp: 2, pp: 2}}", "{pool: global}"), ["role 'actor'", "field 'mesh'", "missing"]),
        (MINIMAL.replace("mesh: {tp: 2, pp: 2}", "mesh: [2, 2]"), ["role 'actor'", "field 'mesh'", "mapping"]),
        (MINIMAL.replace("devices_per_node: 8", "devices_per_node: 0"), ["field 'cluster.devices_per_node'", "positive"]),
        (MINIMAL.replace("{nodes: 1, devices_per_node: 8}", "{nodes: 1}"), ["field 'cluster.devices_per_node'"]),
        (MINIMAL + "intra_node: [tp, zz]\n", ["field 'intra_node'", "unknown axis 'zz'"]),
        (MINIMAL + "pools: {p: {process_on_nodes: [4, -1]}}\n", ["pools.p.process_on_nodes[1]", "positive"]),
        (MINIMAL + "pools: {p: {devices_per_node: 4}}\n", ["pools.p.nodes", "devices_per_node needs nodes"]),
        (MINIMAL + "pools: {p: {process_on_nodes: [4], nodes: [0, 1]}}\n", ["pools.p.nodes", "differ in length"]),
    ],
)
def test_structural_errors_name_file_role_and_field(tmp_path, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(LayoutError) as info:
        load_layout(path, check=False)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_unknown_name_lists_known_layouts():
    with pytest.raises(LayoutNotFoundError, match="unknown layout 'no_such'.*cpu_demo"):
        load_layout("no_such")
    with pytest.raises(LayoutNotFoundError, match="no such layout file"):
        load_layout("missing/dir/x.yaml")


def test_unknown_role_names_the_known_roles():
    with pytest.raises(LayoutError, match="unknown role 'critic'.*actor, ref"):
        load_layout("single_node_8gpu").role("critic")


# ----- semantic problems: validate_layout lists them all ---------------------------------------


def problems_of(tmp_path: Path, text: str, strict: bool = False) -> list[Problem]:
    return validate_layout(load_layout(write(tmp_path, text), check=False), strict=strict)


def only(problems: list[Problem], severity: str) -> list[Problem]:
    return [p for p in problems if p.severity == severity]


def test_world_size_mismatch_and_indivisible_are_both_listed(tmp_path):
    text = """
    name: custom
    cluster: {nodes: 1, devices_per_node: 12}
    pools: {a: {process_on_nodes: [8]}, b: {process_on_nodes: [4]}}
    roles:
      actor: {pool: a, mesh: {tp: 2, pp: 2, dp: 4}}
      critic: {pool: b, mesh: {tp: 3}}
    """
    problems = problems_of(tmp_path, text)
    assert [(p.role, p.field) for p in problems] == [("actor", "mesh"), ("critic", "mesh")]
    assert "2*1*4*2 = 16" in problems[0].message and "8 processes" in problems[0].message
    assert "not divisible" in problems[1].message
    assert all(p.severity == "error" for p in problems)
    with pytest.raises(LayoutError, match=r"role 'actor', field 'mesh'.*1 more problem"):
        load_layout(tmp_path / "custom.yaml")


def test_non_positive_sizes_are_errors(tmp_path):
    problems = problems_of(tmp_path, MINIMAL.replace("tp: 2, pp: 2", "tp: 0, pp: -2"))
    assert [(p.field, p.severity) for p in problems] == [("mesh.tp", "error"), ("mesh.pp", "error")]
    # raised, the text says where and what, without the problem's "error:" (the CLI adds one: issue 45 item 12)
    with pytest.raises(LayoutError, match="role 'actor', field 'mesh.tp': tp must be a positive"):
        load_layout(tmp_path / "custom.yaml")
    with pytest.raises(LayoutError, match="role 'actor', field 'mesh': tp must be a positive integer, got 0"):
        load_layout(tmp_path / "custom.yaml", check=False).role("actor").mesh()


def test_expert_divisibility_and_bad_order(tmp_path):
    problems = problems_of(tmp_path, MINIMAL.replace("tp: 2, pp: 2", "tp: 2, ep: 3"))
    assert len(problems) == 1 and "etp*ep*pp" in problems[0].message
    problems = problems_of(tmp_path, MINIMAL.replace("tp: 2, pp: 2", "tp: 2, pp: 2, order: tp-dp"))
    assert len(problems) == 1 and problems[0].field == "mesh.order" and "leaves out axis 'pp'" in problems[0].message


def test_pools_must_fit_the_cluster(tmp_path):
    text = """
    name: custom
    cluster: {process_on_nodes: [8, 4]}
    pools:
      a: {process_on_nodes: [8, 4]}
      b: {nodes: [1], process_on_nodes: [4]}
      c: {nodes: [2], process_on_nodes: [4]}
    roles:
      x: {pool: a, mesh: {tp: 4}}
      y: {pool: b, mesh: {tp: 4}}
      z: {pool: c, mesh: {tp: 4}}
    """
    errors = only(problems_of(tmp_path, text), "error")
    messages = {p.field: p.message for p in errors}
    assert "node 2 does not exist" in messages["pools.c.nodes"]
    assert "node 1 has 4 devices but pools place 8 processes" in messages["pools"]


def test_colocation_rules(tmp_path):
    text = """
    name: custom
    cluster: {nodes: 2, devices_per_node: 8}
    pools: {a: {process_on_nodes: [8]}, b: {nodes: [1], process_on_nodes: [8]}}
    roles:
      actor: {pool: a, mesh: {tp: 2, pp: 2}, colocate_with: [ref, critic, ghost]}
      ref: {pool: a, mesh: {tp: 4}, colocate_with: [actor]}
      critic: {pool: b, mesh: {tp: 2}}
      loner: {pool: b, mesh: {tp: 8}}
    """
    problems = problems_of(tmp_path, text)
    text_of = [f"{p.severity} {p.role} {p.field} {p.message}" for p in problems]
    assert any("error actor mesh colocated with 'ref' but the meshes differ" in t for t in text_of), text_of
    assert any("error actor colocate_with" in t and "pool 'b'" in t for t in text_of), text_of
    assert any("error actor colocate_with unknown role 'ghost'" in t for t in text_of), text_of
    shared = [p for p in problems if p.field == "pools.b"]
    assert len(shared) == 1 and shared[0].severity == "warning" and "without colocate_with" in shared[0].message


def test_unused_pool_is_a_warning(tmp_path):
    problems = problems_of(tmp_path, MINIMAL + "pools: {global: {process_on_nodes: [4]}, spare: {process_on_nodes: [4]}}\n")
    assert [(p.severity, p.field) for p in problems] == [("warning", "pools.spare")]


SPANNING = """
name: custom
cluster: {process_on_nodes: [6, 6]}
roles:
  actor: {mesh: {tp: 4, dp: 3}}
intra_node: [tp]
"""


def test_tp_across_nodes_is_a_warning_and_an_error_when_strict(tmp_path, caplog):
    problems = problems_of(tmp_path, SPANNING)
    assert len(problems) == 1
    warning = problems[0]
    assert (warning.severity, warning.role, warning.field) == ("warning", "actor", "intra_node")
    # ranks 4-7 form a tp group; 4, 5 sit on node 0 and 6, 7 on node 1 (hand-derived)
    assert "1 tp group(s) cross a node boundary, e.g. [4, 5, 6, 7] on nodes [0, 1]" in warning.message
    with caplog.at_level(logging.WARNING, logger="rankmesh"):
        assert load_layout(tmp_path / "custom.yaml").name == "custom"  # warnings do not block loading
    assert "cross a node boundary" in caplog.text
    strict = problems_of(tmp_path, SPANNING, strict=True)
    assert [p.severity for p in strict] == ["error"]
    assert str(strict[0]).startswith(f"{tmp_path / 'custom.yaml'}: role 'actor', field 'intra_node': error: ")


def test_expert_groups_checked_when_listed(tmp_path):
    text = """
    name: custom
    cluster: {nodes: 2, devices_per_node: 4}
    roles:
      actor: {mesh: {tp: 1, dp: 8, ep: 8}}
    intra_node: [tp, ep]
    """
    (problem,) = problems_of(tmp_path, text)
    assert "expert ep group(s)" in problem.message and "[0, 1, 2, 3, 4, 5, 6, 7]" in problem.message


def test_programmatic_specs_check_their_counts():
    with pytest.raises(LayoutError):
        PoolSpec("p", (4, 0))
    with pytest.raises(LayoutError):
        PoolSpec("p", (4, 4), (0, 0))
    pool = PoolSpec("p", (4, 4))
    assert pool.nodes == (0, 1)
    role = LayoutRole("r", pool)
    assert role.mesh().world_size == 8 and role.mesh().size("dp") == 8


def test_parse_layout_accepts_a_dict_and_errors_are_rankmesh_errors():
    layout = parse_layout(
        {"name": "d", "cluster": {"process_on_nodes": [2, 2]}, "roles": {"a": {"mesh": {"tp": 2}}}}, "<dict>"
    )
    assert layout.role("a").mesh().groups("dp") == [[0, 2], [1, 3]]
    with pytest.raises(RankMeshError, match="<dict>: field 'roles'"):
        parse_layout({"name": "d", "cluster": {"process_on_nodes": [2]}, "roles": {}}, "<dict>")


CLASHING_LABELS = """
name: clashing
cluster: {nodes: 2, devices_per_node: 8}
pools:
  train: {process_on_nodes: [4], nodes: [0], node_labels: {gpu: a100, zone: a}}
  gen: {process_on_nodes: [4], nodes: [0], node_labels: {gpu: h100, zone: a}}
  spare: {process_on_nodes: [4], nodes: [1], node_labels: {gpu: h100}}
roles:
  actor: {pool: train, mesh: {tp: 4}}
  rollout: {pool: gen, mesh: {tp: 4}}
  ref: {pool: spare, mesh: {tp: 4}}
"""


def test_validate_reports_pools_that_want_different_labels_on_one_node(tmp_path):
    layout = load_layout(write(tmp_path, CLASHING_LABELS), check=False)
    errors = [p for p in validate_layout(layout) if p.severity == "error"]
    # Node 0: train wants gpu=a100, gen gpu=h100 (zone agrees); node 1 has one pool: no conflict.
    assert [p.message for p in errors] == [
        "pool 'train' requires gpu=a100 and pool 'gen' requires gpu=h100 on node 0: no node can carry both labels; "
        "give the pools one value or different nodes"
    ]
    assert errors[0].field == "pools.gen.node_labels"
    for check in (lambda: check_layout(layout), lambda: load_layout(layout.source)):
        with pytest.raises(LayoutError, match="pool 'train' requires gpu=a100 and pool 'gen' requires gpu=h100 on node 0"):
            check()
    # Agreeing labels on a shared node, or different labels on different nodes, are fine.
    agreeing = load_layout(write(tmp_path, CLASHING_LABELS.replace("gpu: h100, zone: a", "gpu: a100, zone: a")), check=False)
    assert [p for p in validate_layout(agreeing) if p.severity == "error"] == []
    apart = load_layout(write(tmp_path, CLASHING_LABELS.replace("[4], nodes: [0], node_labels: {gpu: h100", "[4], nodes: [1], node_labels: {gpu: h100")), check=False)
    assert [p for p in validate_layout(apart) if p.severity == "error"] == []
