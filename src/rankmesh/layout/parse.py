"""Layout parsing: structure and types of a YAML document, with file, role and field in every error."""

from __future__ import annotations

from typing import Any, Mapping

from rankmesh.errors import LayoutError
from rankmesh.layout.spec import (
    DEFAULT_INTRA_NODE,
    DEFAULT_POOL,
    ClusterSpec,
    Layout,
    LayoutRole,
    MeshSizes,
    PoolSpec,
    layout_error,
)
from rankmesh.mesh import AXES
from rankmesh.validate import is_int, node_labels

# The fields each part of a layout file may have (anything else is a typo, reported as such).
_TOP_FIELDS = frozenset({"name", "description", "cluster", "pools", "roles", "intra_node"})
_CLUSTER_FIELDS = frozenset({"nodes", "devices_per_node", "process_on_nodes"})
_POOL_FIELDS = frozenset({"process_on_nodes", "devices_per_node", "nodes", "node_labels"})
_ROLE_FIELDS = frozenset({"pool", "mesh", "colocate_with"})
_MESH_FIELDS = frozenset({"tp", "pp", "cp", "dp", "ep", "etp", "order"})


class _Reader:
    """Structural checks with the file, role and field in every message."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, message: str, role: str | None = None, field_: str | None = None) -> LayoutError:
        return layout_error(message, self.file, role, field_)

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
        if not is_int(value):
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
    roles: dict[str, LayoutRole] = {}
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
    try:
        labels = node_labels(pool.get("node_labels"), "node_labels", LayoutError)
    except LayoutError as exc:
        raise r.fail(str(exc), None, f"{prefix}.node_labels") from None
    return PoolSpec(name, tuple(counts), tuple(nodes), labels)


def _parse_role(r: _Reader, name: str, raw: object, pools: Mapping[str, PoolSpec]) -> LayoutRole:
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
    return LayoutRole(name, pools[pool_name], MeshSizes(**sizes), tuple(colocate), source=r.file)
