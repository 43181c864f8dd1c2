"""Layout validation: world sizes, fit, colocation and node boundaries, every problem listed.

:func:`validate_layout` *returns* every problem (so ``rankmesh layout validate`` can list them
all at once); :func:`check_layout` raises on the first error, for code that is about to use the
layout.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Mapping

from rankmesh.errors import LayoutError, MeshError, RankMeshError
from rankmesh.layout.spec import Layout, LayoutRole, Problem, Severity
from rankmesh.mesh import AXES, RankMesh
from rankmesh.validate import is_int

log = logging.getLogger(__name__)


def check_layout(layout: Layout, strict: bool = False) -> Layout:
    """Raise :class:`LayoutError` naming the first error (and how many there are); return ``layout``.

    Warnings are logged, not raised: a layout that merely runs slowly still runs.
    """
    problems = validate_layout(layout, strict=strict)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more problem(s); run `rankmesh layout validate`)" if len(errors) > 1 else ""
        raise LayoutError(f"{errors[0].location}: {errors[0].message}{more}")  # raised as an error: no "error:" inside
    for problem in problems:
        log.warning("%s: %s", problem.location, problem.message)
    return layout


def validate_layout(layout: Layout, strict: bool = False) -> list[Problem]:
    """Every problem of ``layout``; ``strict=True`` turns warnings into errors.

    Checks: positive sizes; each role's world size equals its pool's process count (dp derived
    when omitted); divisibility; pools fit the cluster's nodes; colocated roles share one pool and
    an identical mesh; roles sharing a pool are declared colocated; the ``intra_node`` groups stay
    inside a node; every pool is used.
    """
    problems: list[Problem] = []

    def add(severity: Severity, message: str, role: str | None = None, field_: str | None = None) -> None:
        problems.append(Problem(severity, layout.label, role, field_, message))

    for token in layout.intra_node:
        if token not in AXES:
            add("error", f"unknown axis {token!r} (known axes: {', '.join(AXES)})", field_="intra_node")
    _check_pools_fit(layout, add)

    meshes: dict[str, RankMesh] = {}
    for role in layout.roles.values():
        mesh = _check_role_mesh(role, add)
        if mesh is None:
            continue
        meshes[role.name] = mesh
        _check_intra_node(layout, role, mesh, add)
    _check_colocation(layout, meshes, add)

    used = {role.pool.name for role in layout.roles.values()}
    for name in layout.pools:
        if name not in used:
            add("warning", f"pool {name!r} is not used by any role", field_=f"pools.{name}")

    if strict:
        problems = [replace(p, severity="error") for p in problems]
    for problem in problems:
        log.debug("%s", problem)
    return problems


def _check_pools_fit(layout: Layout, add) -> None:
    cluster = layout.cluster
    usage: dict[int, list[tuple[str, int]]] = {}
    for pool in layout.pools.values():
        for node, count in zip(pool.nodes, pool.process_on_nodes):
            if node >= cluster.num_nodes:
                add(
                    "error",
                    f"node {node} does not exist: the cluster has {cluster.num_nodes} node(s)",
                    field_=f"pools.{pool.name}.nodes",
                )
                continue
            usage.setdefault(node, []).append((pool.name, count))
    for node in sorted(usage):
        total = sum(count for _, count in usage[node])
        devices = cluster.process_on_nodes[node]
        if total > devices:
            parts = ", ".join(f"{name} ({count})" for name, count in usage[node])
            add("error", f"node {node} has {devices} devices but pools place {total} processes on it: {parts}", field_="pools")
    for conflict in layout.label_conflicts():
        add("error", f"{conflict.describe()}: no node can carry both labels; give the pools one value or "
            "different nodes", field_=f"pools.{conflict.other_pool}.node_labels")


def _check_role_mesh(role: LayoutRole, add) -> RankMesh | None:
    spec, pool = role.mesh_sizes, role.pool
    bad = False
    for axis, value in spec.sizes().items():
        if value is not None and (not is_int(value) or value <= 0):
            add("error", f"{axis} must be a positive integer, got {value!r}", role.name, f"mesh.{axis}")
            bad = True
    if bad:
        return None
    model = spec.tp * spec.cp * spec.pp
    if spec.dp is None and pool.world_size % model:
        add(
            "error",
            f"pool {pool.name!r} has {pool.world_size} processes, not divisible by "
            f"tp*cp*pp = {spec.tp}*{spec.cp}*{spec.pp} = {model}",
            role.name,
            "mesh",
        )
        return None
    if spec.dp is not None and model * spec.dp != pool.world_size:
        add(
            "error",
            f"world size tp*cp*dp*pp = {spec.tp}*{spec.cp}*{spec.dp}*{spec.pp} = {model * spec.dp} "
            f"but pool {pool.name!r} has {pool.world_size} processes",
            role.name,
            "mesh",
        )
        return None
    try:
        return spec.build(pool.world_size)
    except MeshError as exc:
        add("error", str(exc), role.name, "mesh.order" if "order" in str(exc) else "mesh")
        return None


def _check_intra_node(layout: Layout, role: LayoutRole, mesh: RankMesh, add) -> None:
    tokens = [t for t in layout.intra_node if t in AXES]
    try:
        spanning = role.placement().spanning_groups(mesh, tokens)
    except RankMeshError as exc:  # pragma: no cover - sizes were checked above
        add("error", str(exc), role.name, "mesh")
        return
    by_token: dict[str, list] = {}
    for group in spanning:
        by_token.setdefault(group.token, []).append(group)
    for token, groups in by_token.items():
        first = groups[0]
        nodes = [role.pool.nodes[n] for n in first.nodes]
        view = "expert " if first.expert else ""
        add(
            "warning",
            f"{len(groups)} {view}{token} group(s) cross a node boundary, e.g. {list(first.ranks)} "
            f"on nodes {nodes}; intra_node asks {token} to stay inside a node",
            role.name,
            "intra_node",
        )


def _check_colocation(layout: Layout, meshes: Mapping[str, RankMesh], add) -> None:
    for role in layout.roles.values():
        for other_name in role.colocate_with:
            if other_name == role.name:
                add("error", "a role cannot be colocated with itself", role.name, "colocate_with")
                continue
            other = layout.roles.get(other_name)
            if other is None:
                add("error", f"unknown role {other_name!r} (roles: {', '.join(layout.roles)})", role.name, "colocate_with")
                continue
            if role.name > other_name and role.name in other.colocate_with:
                continue  # a symmetric pair is checked once
            if other.pool.name != role.pool.name:
                add(
                    "error",
                    f"colocated with {other_name!r}, which runs in pool {other.pool.name!r}, "
                    f"not {role.pool.name!r}: colocated roles share one pool",
                    role.name,
                    "colocate_with",
                )
            elif role.name in meshes and other_name in meshes and meshes[role.name] != meshes[other_name]:
                add(
                    "error",
                    f"colocated with {other_name!r} but the meshes differ: {meshes[role.name]!r} vs "
                    f"{meshes[other_name]!r}",
                    role.name,
                    "mesh",
                )
    group_of = {name: group for group in layout.colocation_groups() for name in group}
    by_pool: dict[str, dict[tuple[str, ...], list[str]]] = {}
    for role in layout.roles.values():
        by_pool.setdefault(role.pool.name, {}).setdefault(group_of[role.name], []).append(role.name)
    for pool, groups in by_pool.items():
        if len(groups) > 1:
            names = " and ".join("+".join(g) for g in groups.values())
            add(
                "warning",
                f"pool {pool!r} is shared by {names} without colocate_with: they would run in the same processes",
                field_=f"pools.{pool}",
            )
