"""Named parallel layouts: which roles run where, with which megatron mesh, read from YAML.

A layout file describes one deployment (a cluster, its resource pools, and each role's mesh), so
a setup that works can be named, reviewed and checked before anything is launched.  Loading only
checks structure (fields, types) and raises :class:`LayoutError`; :func:`validate_layout` checks
the arithmetic (world sizes, divisibility, fit, colocation, node boundaries) and *returns* every
problem, so ``rankmesh layout validate`` can list them all at once.

The schema is documented in ``parallel_layouts/cpu_demo.yaml`` and ``docs/layouts.md``.
"""

from __future__ import annotations

import logging
import os
import site
import sys
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml

from rankmesh.errors import LayoutError, MeshError, RankMeshError
from rankmesh.mesh import AXES, DEFAULT_ORDER, RankMesh
from rankmesh.placement import Placement

log = logging.getLogger(__name__)

LAYOUTS_ENV = "RANKMESH_LAYOUTS"
"""Environment variable: extra layout directories (``os.pathsep``-separated), searched first."""

DEFAULT_POOL = "global"
DEFAULT_INTRA_NODE: tuple[str, ...] = ("tp",)
SUFFIXES: tuple[str, ...] = (".yaml", ".yml")

Severity = Literal["error", "warning"]

_TOP_FIELDS = {"name", "description", "cluster", "pools", "roles", "intra_node"}
_CLUSTER_FIELDS = {"nodes", "devices_per_node", "process_on_nodes"}
_POOL_FIELDS = {"process_on_nodes", "devices_per_node", "nodes"}
_ROLE_FIELDS = {"pool", "mesh", "colocate_with"}
_MESH_FIELDS = {"tp", "pp", "cp", "dp", "ep", "etp", "order"}


class LayoutNotFoundError(LayoutError):
    """No layout of that name, or no such file: a usage error rather than a broken layout."""


def _where(file: str | None, role: str | None = None, field_: str | None = None) -> str:
    parts = [file or "<layout>"]
    context = []
    if role is not None:
        context.append(f"role {role!r}")
    if field_ is not None:
        context.append(f"field {field_!r}")
    if context:
        parts.append(", ".join(context))
    return ": ".join(parts)


def _error(message: str, file: str | None, role: str | None = None, field_: str | None = None) -> LayoutError:
    return LayoutError(f"{_where(file, role, field_)}: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _counts(value: object, what: str) -> tuple[int, ...]:
    """Positive process counts, one per node (raises LayoutError without file context)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise LayoutError(f"{what} must be a non-empty list of positive integers, got {value!r}")
    for i, count in enumerate(value):
        if not _is_int(count) or count <= 0:
            raise LayoutError(f"{what}[{i}] must be a positive integer, got {count!r}")
    return tuple(int(c) for c in value)


# ----- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """The machines: how many devices (processes) each node offers."""

    process_on_nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "process_on_nodes", _counts(self.process_on_nodes, "cluster.process_on_nodes"))

    @classmethod
    def uniform(cls, nodes: int, devices_per_node: int) -> "ClusterSpec":
        for name, value in (("nodes", nodes), ("devices_per_node", devices_per_node)):
            if not _is_int(value) or value <= 0:
                raise LayoutError(f"cluster.{name} must be a positive integer, got {value!r}")
        return cls((devices_per_node,) * nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.process_on_nodes)

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)


@dataclass(frozen=True)
class PoolSpec:
    """A resource pool: the processes one worker group (or several colocated ones) runs in.

    ``nodes[i]`` is the cluster node that hosts ``process_on_nodes[i]`` of the pool's processes;
    the pool's ranks fill those nodes in order.
    """

    name: str
    process_on_nodes: tuple[int, ...]
    nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        counts = _counts(self.process_on_nodes, f"pools.{self.name}.process_on_nodes")
        nodes = tuple(self.nodes) if self.nodes else tuple(range(len(counts)))
        if len(nodes) != len(counts):
            raise LayoutError(
                f"pools.{self.name}: nodes {list(nodes)} and process_on_nodes {list(counts)} differ in length"
            )
        for node in nodes:
            if not _is_int(node) or node < 0:
                raise LayoutError(f"pools.{self.name}.nodes must hold node indices >= 0, got {node!r}")
        if len(set(nodes)) != len(nodes):
            raise LayoutError(f"pools.{self.name}.nodes lists a node twice: {list(nodes)}")
        object.__setattr__(self, "process_on_nodes", counts)
        object.__setattr__(self, "nodes", nodes)

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def placement(self) -> Placement:
        """Ranks of the pool onto its nodes (node indices relative to the pool, see :attr:`nodes`)."""
        return Placement(list(self.process_on_nodes))


@dataclass(frozen=True)
class MeshSpec:
    """Megatron sizes as written in the file; ``dp=None`` means derived from the pool size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None
    ep: int = 1
    etp: int | None = None
    order: str = DEFAULT_ORDER

    def sizes(self) -> dict[str, int | None]:
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp, "ep": self.ep, "etp": self.etp}

    def build(self, world_size: int) -> RankMesh:
        """The mesh over ``world_size`` ranks; raises MeshError if the sizes do not fit."""
        if self.dp is None:
            return RankMesh.for_world(
                world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=self.etp, order=self.order
            )
        mesh = RankMesh(tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, ep=self.ep, etp=self.etp, order=self.order)
        if mesh.world_size != world_size:
            raise MeshError(
                f"tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {mesh.world_size} "
                f"does not equal the pool's {world_size} processes"
            )
        return mesh

    @classmethod
    def of(cls, mesh: RankMesh) -> "MeshSpec":
        s = mesh.sizes
        return cls(tp=s["tp"], pp=s["pp"], cp=s["cp"], dp=s["dp"], ep=s["ep"], etp=s["etp"], order=mesh.order)


@dataclass(frozen=True)
class RoleSpec:
    """One role (actor, critic, rollout, ...): a mesh running in a pool."""

    name: str
    pool: PoolSpec
    mesh_spec: MeshSpec = field(default_factory=MeshSpec)
    colocate_with: tuple[str, ...] = ()
    source: str | None = field(default=None, compare=False)

    def mesh(self) -> RankMesh:
        """The role's :class:`RankMesh` (dp derived from the pool when omitted)."""
        try:
            return self.mesh_spec.build(self.pool.world_size)
        except MeshError as exc:
            raise _error(f"{exc} (pool {self.pool.name!r})", self.source, self.name, "mesh") from exc

    def placement(self) -> Placement:
        """Where the role's ranks run: its pool's nodes, filled in rank order."""
        return self.pool.placement()

    def cluster_node(self, rank: int) -> int:
        """The cluster node index of ``rank`` (the placement's node index mapped through the pool)."""
        return self.pool.nodes[self.placement().node_of(rank)]


@dataclass(frozen=True)
class Layout:
    """A named deployment: a cluster, its pools and the roles placed on them."""

    name: str
    cluster: ClusterSpec
    pools: Mapping[str, PoolSpec]
    roles: Mapping[str, RoleSpec]
    description: str = ""
    intra_node: tuple[str, ...] = DEFAULT_INTRA_NODE
    source: str | None = field(default=None, compare=False)

    def role(self, name: str) -> RoleSpec:
        try:
            return self.roles[name]
        except KeyError:
            raise _error(f"unknown role {name!r} (roles: {', '.join(self.roles)})", self.source) from None

    @property
    def label(self) -> str:
        """How messages name this layout: its file, else its name."""
        return self.source or f"<{self.name}>"

    def colocation_groups(self) -> list[tuple[str, ...]]:
        """Roles that share processes, as groups (the symmetric, transitive closure of colocate_with)."""
        parent = {name: name for name in self.roles}

        def find(name: str) -> str:
            while parent[name] != name:
                parent[name] = parent[parent[name]]
                name = parent[name]
            return name

        for role in self.roles.values():
            for other in role.colocate_with:
                if other in parent:
                    parent[find(other)] = find(role.name)
        groups: dict[str, list[str]] = {}
        for name in self.roles:
            groups.setdefault(find(name), []).append(name)
        return [tuple(g) for g in groups.values()]

    def validate(self, strict: bool = False) -> list["Problem"]:
        return validate_layout(self, strict=strict)

    def check(self, strict: bool = False) -> "Layout":
        """Raise :class:`LayoutError` naming the first error (and how many there are); return self.

        Warnings are logged, not raised: a layout that merely runs slowly still runs.
        """
        problems = validate_layout(self, strict=strict)
        errors = [p for p in problems if p.severity == "error"]
        if errors:
            more = f" (and {len(errors) - 1} more problem(s); run `rankmesh layout validate`)" if len(errors) > 1 else ""
            raise LayoutError(f"{errors[0]}{more}")
        for problem in problems:
            log.warning("%s: %s", problem.location, problem.message)
        return self

    @classmethod
    def from_mesh(
        cls,
        mesh: RankMesh,
        process_on_nodes: Sequence[int] | None = None,
        name: str = "explicit",
        role: str = "mesh",
    ) -> "Layout":
        """A one-role layout around an existing mesh (what ``rankmesh layout show --tp ...`` uses)."""
        counts = tuple(process_on_nodes) if process_on_nodes else (mesh.world_size,)
        pool = PoolSpec(DEFAULT_POOL, counts)
        spec = RoleSpec(role, pool, MeshSpec.of(mesh))
        return cls(name=name, cluster=ClusterSpec(counts), pools={pool.name: pool}, roles={role: spec})


# ----- problems and validation -----------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One finding of :func:`validate_layout`."""

    severity: Severity
    file: str
    role: str | None
    field: str | None
    message: str

    @property
    def location(self) -> str:
        """``file: role 'r', field 'f'``: where the problem is."""
        return _where(self.file, self.role, self.field)

    def __str__(self) -> str:
        return f"{self.location}: {self.severity}: {self.message}"


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


def _check_role_mesh(role: RoleSpec, add) -> RankMesh | None:
    spec, pool = role.mesh_spec, role.pool
    bad = False
    for axis, value in spec.sizes().items():
        if value is not None and (not _is_int(value) or value <= 0):
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


def _check_intra_node(layout: Layout, role: RoleSpec, mesh: RankMesh, add) -> None:
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


# ----- parsing ---------------------------------------------------------------------------------


class _Reader:
    """Structural checks with the file, role and field in every message."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, message: str, role: str | None = None, field_: str | None = None) -> LayoutError:
        return _error(message, self.file, role, field_)

    def mapping(
        self,
        value: object,
        required: set[str],
        optional: set[str],
        role: str | None = None,
        prefix: str | None = None,
    ) -> dict[str, Any]:
        where = prefix or None
        if not isinstance(value, dict):
            raise self.fail(f"expected a mapping, got {_describe(value)}", role, where)
        for key in value:
            if not isinstance(key, str):
                raise self.fail(f"keys must be strings, got {key!r}", role, where)
        known = required | optional
        unknown = sorted(set(value) - known)
        if unknown:
            path = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
            raise self.fail(f"unknown field (known fields: {', '.join(sorted(known))})", role, path)
        missing = sorted(required - set(value))
        if missing:
            path = f"{prefix}.{missing[0]}" if prefix else missing[0]
            raise self.fail("missing required field", role, path)
        return value

    def integer(self, value: object, role: str | None, field_: str) -> int:
        if not _is_int(value):
            raise self.fail(f"expected an integer, got {_describe(value)}", role, field_)
        return int(value)

    def positive(self, value: object, role: str | None, field_: str) -> int:
        number = self.integer(value, role, field_)
        if number <= 0:
            raise self.fail(f"must be a positive integer, got {number}", role, field_)
        return number

    def string(self, value: object, role: str | None, field_: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"expected a string, got {_describe(value)}", role, field_)
        return value

    def list_of(self, value: object, kind: str, role: str | None, field_: str) -> list:
        if not isinstance(value, list):
            raise self.fail(f"expected a list of {kind}, got {_describe(value)}", role, field_)
        return value


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})" if value is not None else "nothing (null)"


def parse_layout(data: object, source: str = "<layout>") -> Layout:
    """Build a :class:`Layout` from parsed YAML (raises :class:`LayoutError` on structure errors)."""
    r = _Reader(source)
    top = r.mapping(data, {"name", "cluster", "roles"}, _TOP_FIELDS - {"name", "cluster", "roles"})
    name = r.string(top["name"], None, "name")
    description = r.string(top.get("description", ""), None, "description")
    cluster = _parse_cluster(r, top["cluster"])

    pools: dict[str, PoolSpec] = {}
    if top.get("pools") is None:
        pools[DEFAULT_POOL] = PoolSpec(DEFAULT_POOL, cluster.process_on_nodes)
    else:
        raw_pools = top["pools"]
        if not isinstance(raw_pools, dict) or not raw_pools:
            raise r.fail(f"expected a mapping of at least one pool, got {_describe(raw_pools)}", None, "pools")
        for pool_name, raw in raw_pools.items():
            pools[pool_name] = _parse_pool(r, pool_name, raw)

    raw_roles = top["roles"]
    if not isinstance(raw_roles, dict) or not raw_roles:
        raise r.fail(f"expected a mapping of at least one role, got {_describe(raw_roles)}", None, "roles")
    roles: dict[str, RoleSpec] = {}
    for role_name, raw in raw_roles.items():
        if not isinstance(role_name, str):
            raise r.fail(f"role names must be strings, got {role_name!r}", None, "roles")
        roles[role_name] = _parse_role(r, role_name, raw, pools)

    intra_node = DEFAULT_INTRA_NODE
    if "intra_node" in top:
        tokens = r.list_of(top["intra_node"], "axis names", None, "intra_node")
        for token in tokens:
            if r.string(token, None, "intra_node") not in AXES:
                raise r.fail(f"unknown axis {token!r} (known axes: {', '.join(AXES)})", None, "intra_node")
        intra_node = tuple(tokens)
    return Layout(
        name=name,
        cluster=cluster,
        pools=pools,
        roles=roles,
        description=description,
        intra_node=intra_node,
        source=source,
    )


def _parse_cluster(r: _Reader, raw: object) -> ClusterSpec:
    cluster = r.mapping(raw, set(), _CLUSTER_FIELDS, prefix="cluster")
    if "process_on_nodes" in cluster:
        if "nodes" in cluster or "devices_per_node" in cluster:
            raise r.fail("give either process_on_nodes or nodes + devices_per_node, not both", None, "cluster")
        counts = _positive_list(r, cluster["process_on_nodes"], None, "cluster.process_on_nodes")
        return ClusterSpec(tuple(counts))
    for key in ("nodes", "devices_per_node"):
        if key not in cluster:
            raise r.fail("missing required field (or give process_on_nodes)", None, f"cluster.{key}")
    nodes = r.positive(cluster["nodes"], None, "cluster.nodes")
    per_node = r.positive(cluster["devices_per_node"], None, "cluster.devices_per_node")
    return ClusterSpec.uniform(nodes, per_node)


def _positive_list(r: _Reader, value: object, role: str | None, field_: str) -> list[int]:
    items = r.list_of(value, "positive integers", role, field_)
    if not items:
        raise r.fail("must list at least one node", role, field_)
    return [r.positive(v, role, f"{field_}[{i}]") for i, v in enumerate(items)]


def _parse_pool(r: _Reader, name: object, raw: object) -> PoolSpec:
    if not isinstance(name, str):
        raise r.fail(f"pool names must be strings, got {name!r}", None, "pools")
    prefix = f"pools.{name}"
    pool = r.mapping(raw, set(), _POOL_FIELDS, prefix=prefix)
    nodes: list[int] = []
    if "nodes" in pool:
        items = r.list_of(pool["nodes"], "node indices", None, f"{prefix}.nodes")
        for i, node in enumerate(items):
            if r.integer(node, None, f"{prefix}.nodes[{i}]") < 0:
                raise r.fail(f"node indices must be >= 0, got {node}", None, f"{prefix}.nodes[{i}]")
        nodes = items
        if len(set(nodes)) != len(nodes):
            raise r.fail(f"lists a node twice: {nodes}", None, f"{prefix}.nodes")
    if "process_on_nodes" in pool:
        if "devices_per_node" in pool:
            raise r.fail("give either process_on_nodes or devices_per_node, not both", None, prefix)
        counts = _positive_list(r, pool["process_on_nodes"], None, f"{prefix}.process_on_nodes")
        if nodes and len(nodes) != len(counts):
            raise r.fail(
                f"nodes {nodes} and process_on_nodes {counts} differ in length", None, f"{prefix}.nodes"
            )
    elif "devices_per_node" in pool:
        if not nodes:
            raise r.fail("devices_per_node needs nodes: [...] to say which nodes", None, f"{prefix}.nodes")
        counts = [r.positive(pool["devices_per_node"], None, f"{prefix}.devices_per_node")] * len(nodes)
    else:
        raise r.fail("missing required field (or give devices_per_node with nodes)", None, f"{prefix}.process_on_nodes")
    return PoolSpec(name, tuple(counts), tuple(nodes))


def _parse_role(r: _Reader, name: str, raw: object, pools: Mapping[str, PoolSpec]) -> RoleSpec:
    role = r.mapping(raw, {"mesh"}, _ROLE_FIELDS - {"mesh"}, role=name)
    pool_name = r.string(role.get("pool", DEFAULT_POOL), name, "pool")
    if pool_name not in pools:
        raise r.fail(f"unknown pool {pool_name!r} (pools: {', '.join(pools)})", name, "pool")
    mesh = r.mapping(role["mesh"], set(), _MESH_FIELDS, role=name, prefix="mesh")
    sizes: dict[str, Any] = {}
    for axis in ("tp", "pp", "cp", "dp", "ep", "etp"):
        if axis in mesh:
            sizes[axis] = r.integer(mesh[axis], name, f"mesh.{axis}")
    if "order" in mesh:
        sizes["order"] = r.string(mesh["order"], name, "mesh.order")
    colocate: list[str] = []
    if role.get("colocate_with") is not None:
        items = r.list_of(role["colocate_with"], "role names", name, "colocate_with")
        colocate = [r.string(item, name, "colocate_with") for item in items]
    return RoleSpec(name, pools[pool_name], MeshSpec(**sizes), tuple(colocate), source=r.file)


# ----- finding and loading files ---------------------------------------------------------------


def layout_dirs() -> list[Path]:
    """Where layout names are looked up, first match wins.

    1. every directory in ``$RANKMESH_LAYOUTS`` (``os.pathsep``-separated);
    2. ``parallel_layouts/`` at the repository root (source checkout, editable install);
    3. ``<sys.prefix or user base>/share/rankmesh/parallel_layouts`` (installed as wheel data-files);
    4. ``rankmesh/parallel_layouts`` inside the package, if a build copied it there.
    """
    dirs = [Path(p) for p in os.environ.get(LAYOUTS_ENV, "").split(os.pathsep) if p]
    share = Path("share") / "rankmesh" / "parallel_layouts"
    candidates = [
        Path(__file__).resolve().parents[2] / "parallel_layouts",
        Path(sys.prefix) / share,
        Path(site.getuserbase()) / share,  # pip install --user
    ]
    try:
        packaged = resources.files("rankmesh") / "parallel_layouts"
        candidates.append(Path(str(packaged)))
    except (ModuleNotFoundError, TypeError):  # pragma: no cover - zipped installs
        pass
    for candidate in candidates:
        if candidate.is_dir():
            dirs.append(candidate)
            break
    return dirs


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def list_layouts() -> list[str]:
    """Names (file stems) of every layout found in :func:`layout_dirs`, sorted."""
    names: set[str] = set()
    for directory in layout_dirs():
        if directory.is_dir():
            names.update(p.stem for p in directory.iterdir() if p.suffix in SUFFIXES and p.is_file())
    return sorted(names)


def _looks_like_path(text: str) -> bool:
    return os.sep in text or "/" in text or text.endswith(SUFFIXES)


def find_layout(name_or_path: str | os.PathLike[str]) -> Path:
    """The file for a layout name (``cpu_demo`` or ``cpu-demo``) or a path to a YAML file."""
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(text) or Path(text).is_file():
        path = Path(text)
        if path.is_file():
            return path
        if len(path.parts) != 1 or path.suffix not in SUFFIXES:
            raise LayoutNotFoundError(f"{text}: no such layout file")
        text = path.stem  # a bare file name such as cpu_demo.yaml: look it up like a name
    wanted = _normalize(text)
    for directory in layout_dirs():
        for suffix in SUFFIXES:
            path = directory / f"{wanted}{suffix}"
            if path.is_file():
                return path
    known = ", ".join(list_layouts()) or "none found"
    raise LayoutNotFoundError(f"unknown layout {text!r} (known layouts: {known}; or give a path to a .yaml file)")


def load_layout(name_or_path: str | os.PathLike[str], *, check: bool = True) -> Layout:
    """Load a layout by name or path.

    ``check=True`` also raises :class:`LayoutError` if :func:`validate_layout` finds an error
    (warnings pass); ``check=False`` returns any structurally sound layout, for reporting.
    """
    path = find_layout(name_or_path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutError(f"{source}: cannot read: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise LayoutError(f"{source}: malformed YAML: {_yaml_message(exc)}") from exc
    layout = parse_layout(data, source)
    log.debug("loaded layout %s from %s", layout.name, source)
    return layout.check() if check else layout


def _yaml_message(exc: yaml.YAMLError) -> str:
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
