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


QUIET_START = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.pop("RAY_AUTH_MODE", None)
import ray
from rankmesh.backends.ray.runtime import ensure_ray

conn = ensure_ray(num_cpus=16)

@ray.remote(num_cpus=1)
class Slot:
    def ping(self):
        return os.environ.get("RAY_AUTH_MODE")

slots = [Slot.remote() for _ in range(16)]  # 8x this machine's cores at most: Ray's warning territory
modes = set(ray.get([s.ping.remote() for s in slots]))
print("AUTH", os.environ.get("RAY_AUTH_MODE"), sorted(map(str, modes)), flush=True)
conn.close()
"""


def test_embedded_ray_starts_silently_and_keeps_token_authentication(tmp_path: Path):
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "RAY_AUTH_MODE"}
    done = subprocess.run([sys.executable, "-c", QUIET_START], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    # Authentication stays on, in the driver and in every worker.
    assert "AUTH token ['token']" in done.stdout, done.stdout
    for notice in ("Token authentication is enabled", "worker processes have been started"):
        assert notice not in done.stderr + done.stdout, done.stderr[-3000:]
