"""Security promises: loopback Ray without dashboard, safe YAML, detached groups found by prefix only."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankmesh.backends.ray.hosts import actor_name, rank_of_name
from rankmesh.errors import LayoutError
from rankmesh.layout import load_layout, parse_layout


def test_layout_with_python_tag_is_refused_and_runs_nothing(tmp_path: Path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.yaml"
    evil.write_text(f"cluster: !!python/object/apply:os.system ['touch {marker}']\nroles: {{}}\n")
    with pytest.raises(LayoutError, match="evil.yaml"):
        load_layout(evil)
    assert not marker.exists()
    other = tmp_path / "evil2.yaml"
    other.write_text("roles: !!python/name:os.system\n")
    with pytest.raises(LayoutError):
        load_layout(other)


@pytest.mark.parametrize("data", [object(), print, {"roles": print}])
def test_parse_layout_never_calls_what_it_gets(data):
    with pytest.raises(LayoutError):
        parse_layout(data)


@pytest.mark.parametrize(
    "name,prefix,rank",
    [
        ("exp1_0", "exp1", 0),
        ("exp1_12", "exp1", 12),
        ("exp10_0", "exp1", None),  # another group whose name starts the same
        ("exp1_x_1", "exp1", None),
        ("exp1_-1", "exp1", None),
        ("xexp1_0", "exp1", None),
        ("a.b_0", "a.*", None),  # the prefix is literal text, not a pattern
        ("a.*_3", "a.*", 3),
    ],
)
def test_detached_groups_are_found_by_exact_prefix(name, prefix, rank):
    assert rank_of_name(name, prefix) == rank
    if rank is not None:
        assert actor_name(prefix, rank) == name


def test_embedded_ray_is_loopback_without_dashboard(ray_session):
    ray = pytest.importorskip("ray")
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    if ray_session.started_here:
        from ray._private.worker import global_worker

        info = global_worker.node.address_info
        assert info["node_ip_address"] == "127.0.0.1" and info["webui_url"] in ("", None)
