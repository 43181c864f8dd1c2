"""Layout data model: cluster, pools, role meshes and the problems validation reports.

The classes check their own fields when built (so a ``Layout`` made in code is as sound as one
read from a file); the arithmetic across fields (world sizes, fit, colocation) is
:mod:`rankmesh.layout.checks`, which reads this model and is not imported by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

from rankmesh.errors import LayoutError, MeshError
from rankmesh.mesh import DEFAULT_ORDER, RankMesh
from rankmesh.placement import Placement
from rankmesh.validate import node_labels, non_negative_int, positive_int

LAYOUTS_ENV = "RANKMESH_LAYOUTS"
"""Environment variable: extra layout directories (``os.pathsep``-separated), searched first."""

DEFAULT_POOL = "global"
DEFAULT_INTRA_NODE: tuple[str, ...] = ("tp",)
SUFFIXES: tuple[str, ...] = (".yaml", ".yml")

Severity = Literal["error", "warning"]


def _where(file: str | None, role: str | None = None, field_: str | None = None) -> str:
    """``file: role 'r', field 'f'``: how every layout message says where the problem is."""
    parts = [file or "<layout>"]
    context = []
    if role is not None:
        context.append(f"role {role!r}")
    if field_ is not None:
        context.append(f"field {field_!r}")
    if context:
        parts.append(", ".join(context))
    return ": ".join(parts)


def layout_error(message: str, file: str | None, role: str | None = None, field_: str | None = None) -> LayoutError:
    """A :class:`LayoutError` whose text starts with where the problem is: file, role, field."""
    return LayoutError(f"{_where(file, role, field_)}: {message}")


def _counts(value: object, what: str) -> tuple[int, ...]:
    """Positive process counts, one per node (raises LayoutError without file context)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise LayoutError(f"{what} must be a non-empty list of positive integers, got {value!r}")
    return tuple(positive_int(count, f"{what}[{i}]", LayoutError) for i, count in enumerate(value))


# ----- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """The machines: how many devices (processes) each node offers."""

    process_on_nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "process_on_nodes", _counts(self.process_on_nodes, "cluster.process_on_nodes"))

    @classmethod
    def uniform(cls, nodes: int, devices_per_node: int) -> "ClusterSpec":
        nodes = positive_int(nodes, "cluster.nodes", LayoutError)
        devices_per_node = positive_int(devices_per_node, "cluster.devices_per_node", LayoutError)
        return cls((devices_per_node,) * nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.process_on_nodes)

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)


@dataclass(frozen=True)
class LabelConflict:
    """Two pools that put layout node ``node`` under different values of label ``key`` (:meth:`Layout.label_conflicts`)."""

    node: int
    key: str
    pool: str
    value: str
    other_pool: str
    other_value: str

    def describe(self) -> str:
        return (f"pool {self.pool!r} requires {self.key}={self.value} and pool {self.other_pool!r} requires "
                f"{self.key}={self.other_value} on node {self.node}")


@dataclass(frozen=True)
class PoolSpec:
    """A resource pool: the processes one worker group (or several colocated ones) runs in.

    ``nodes[i]`` is the cluster node that hosts ``process_on_nodes[i]`` of the pool's processes;
    the pool's ranks fill those nodes in order.  ``node_labels``: labels every node of the pool
    must carry, exact ``key: value`` matches (Ray: ``ray start --labels``; a pool honours them
    as the placement groups' ``bundle_label_selector``).
    """

    name: str
    process_on_nodes: tuple[int, ...]
    nodes: tuple[int, ...] = ()
    node_labels: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        counts = _counts(self.process_on_nodes, f"pools.{self.name}.process_on_nodes")
        nodes = tuple(self.nodes) if self.nodes else tuple(range(len(counts)))
        if len(nodes) != len(counts):
            raise LayoutError(
                f"pools.{self.name}: nodes {list(nodes)} and process_on_nodes {list(counts)} differ in length"
            )
        nodes = tuple(non_negative_int(node, f"pools.{self.name}.nodes[{i}]", LayoutError) for i, node in enumerate(nodes))
        if len(set(nodes)) != len(nodes):
            raise LayoutError(f"pools.{self.name}.nodes lists a node twice: {list(nodes)}")
        object.__setattr__(self, "process_on_nodes", counts)
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "node_labels", node_labels(self.node_labels, f"pools.{self.name}.node_labels", LayoutError))

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    def placement(self) -> Placement:
        """Ranks of the pool onto its nodes (node indices relative to the pool, see :attr:`nodes`)."""
        return Placement(list(self.process_on_nodes))


@dataclass(frozen=True)
class MeshSizes:
    """A role's megatron sizes as written in the file; ``dp=None`` means derived from the pool size.

    Not to be confused with :class:`rankmesh.dispatch.MeshSpec` (how a call maps onto a mesh):
    these are the sizes a :class:`RankMesh` is built from, kept as written so that validation can
    report a bad size instead of failing on the first one.
    """

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
    def of(cls, mesh: RankMesh) -> "MeshSizes":
        s = mesh.sizes
        return cls(tp=s["tp"], pp=s["pp"], cp=s["cp"], dp=s["dp"], ep=s["ep"], etp=s["etp"], order=mesh.order)


@dataclass(frozen=True)
class LayoutRole:
    """One role of a layout (actor, critic, rollout, ...): a mesh running in a pool."""

    name: str
    pool: PoolSpec
    mesh_sizes: MeshSizes = field(default_factory=MeshSizes)
    colocate_with: tuple[str, ...] = ()
    source: str | None = field(default=None, compare=False)

    def mesh(self) -> RankMesh:
        """The role's :class:`RankMesh` (dp derived from the pool when omitted)."""
        try:
            return self.mesh_sizes.build(self.pool.world_size)
        except MeshError as exc:
            raise layout_error(f"{exc} (pool {self.pool.name!r})", self.source, self.name, "mesh") from exc

    def placement(self) -> Placement:
        """Where the role's ranks run: its pool's nodes, filled in rank order."""
        return self.pool.placement()

    def cluster_node(self, rank: int) -> int:
        """The cluster node index of ``rank`` (the placement's node index mapped through the pool)."""
        return self.pool.nodes[self.placement().node_of(rank)]


@dataclass(frozen=True)
class Layout:
    """A named deployment: a cluster, its pools and the roles placed on them.

    To check one: :func:`~rankmesh.layout.validate_layout` lists every problem,
    :func:`~rankmesh.layout.check_layout` raises on the first error.
    """

    name: str
    cluster: ClusterSpec
    pools: Mapping[str, PoolSpec]
    roles: Mapping[str, LayoutRole]
    description: str = ""
    intra_node: tuple[str, ...] = DEFAULT_INTRA_NODE
    source: str | None = field(default=None, compare=False)

    def role(self, name: str) -> LayoutRole:
        try:
            return self.roles[name]
        except KeyError:
            raise layout_error(f"unknown role {name!r} (roles: {', '.join(self.roles)})", self.source) from None

    @property
    def label(self) -> str:
        """How messages name this layout: its file, else its name."""
        return self.source or f"<{self.name}>"

    def label_conflicts(self) -> list["LabelConflict"]:
        """Layout nodes on which two used pools require different values of one ``node_labels`` key.

        No live node can carry both, so such a layout cannot be placed anywhere: the one rule that
        both the static check (:func:`~rankmesh.layout.validate_layout`) and the live-cluster
        pre-flight (:func:`~rankmesh.layout.preflight.preflight`) report.  Pools no role uses are
        not placed, so they are left out.
        """
        used = {role.pool.name: role.pool for role in self.roles.values()}
        first: dict[tuple[int, str], tuple[str, str]] = {}  # (node, key) -> (pool, value) first seen
        conflicts = []
        for pool in used.values():
            for node in pool.nodes:
                for key, value in pool.node_labels.items():
                    seen = first.setdefault((node, key), (pool.name, value))
                    if seen[1] != value:
                        conflicts.append(LabelConflict(node, key, seen[0], seen[1], pool.name, value))
        return conflicts

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
        spec = LayoutRole(role, pool, MeshSizes.of(mesh))
        return cls(name=name, cluster=ClusterSpec(counts), pools={pool.name: pool}, roles={role: spec})


# ----- problems -----------------------------------------------------------------


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


