"""Binding a worker class's ``@register`` methods to a group: each method resolved for a mesh, once, with no backend.

Why apart from the groups: what a method of a group does is decided before any process starts
(its mode resolved, its plan made for the mesh, its name checked against the group's own
attributes), and the same way for every backend; :class:`rankmesh.group.WorkerGroup` then only
installs the table (:class:`MethodTable`) over its backend and calls through it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rankmesh.data.tensordicts import TENSORDICT
from rankmesh.dispatch.modes import DEFAULT_REGISTRY, DispatchMode, DispatchRegistry, Execute, UserMode
from rankmesh.dispatch.register import MethodSpec, registered_methods
from rankmesh.dispatch.spec import DEFAULT_MESH, MEGATRON_COLLECT, DispatchPlan, MeshSpec
from rankmesh.dispatch.split import CallSite
from rankmesh.errors import DispatchError
from rankmesh.mesh import RankMesh

#: verl's execute_all rule (ALL_TO_ALL), fixed here so that updating ALL_TO_ALL leaves it alone.
EXECUTE_ALL = MeshSpec(split=("rank",), broadcast_fallback=True, name="execute_all")


#: Class attributes of a colocated method table (see ``rankmesh.backends.ray.classes``): the role
#: classes by name, and each group method's route ``name -> (role, worker method)``.
ROLES_ATTR = "rankmesh_roles"
ROUTES_ATTR = "rankmesh_routes"


@dataclass(frozen=True)
class PerRank:
    """The entry of a :meth:`WorkerGroup.call_ranks` binding: each call names its ranks and their arguments."""

    label: str = "per rank"

    @staticmethod
    def collect_fn(group: Any, outputs: list[Any]) -> list[Any]:
        return outputs


@dataclass(frozen=True)
class Binding:
    """One group method, resolved: what to run, how to split, where outputs come from.

    ``role``/``target`` name the worker object and its method that a call of ``name`` runs
    (``target == name`` except on a colocated method table, where ``actor_x`` runs ``x`` of role
    ``actor``).  ``plan`` is ``None`` only for verl-style meshes the workers register themselves
    (the group asks them on the first call) and for :class:`PerRank` entries (the call names its ranks).
    """

    name: str
    method: MethodSpec
    entry: MeshSpec | UserMode | PerRank
    plan: DispatchPlan | None
    site: CallSite
    role: str | None
    target: str


def mode_label(mode: DispatchMode | MeshSpec | UserMode) -> str:
    return mode.name if isinstance(mode, DispatchMode) else mode.label


def public_signature(func: Callable[..., Any], static: bool) -> inspect.Signature:
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    return sig.replace(parameters=params if static else params[1:])


def check_meshes(world: int, mesh: RankMesh, extra: Mapping[str, RankMesh]) -> dict[str, RankMesh]:
    """``{"default": mesh, **extra}`` after checking that every mesh covers ``world`` ranks."""
    if not isinstance(mesh, RankMesh):
        raise DispatchError(f"mesh must be a RankMesh, got {type(mesh).__name__}")
    if DEFAULT_MESH in extra and extra[DEFAULT_MESH] != mesh:
        raise DispatchError(f"meshes[{DEFAULT_MESH!r}] differs from mesh; pass the training mesh as mesh=")
    meshes = {DEFAULT_MESH: mesh, **extra}
    for name, m in meshes.items():
        if not isinstance(m, RankMesh):
            raise DispatchError(f"mesh {name!r} must be a RankMesh, got {type(m).__name__}")
        if m.world_size != world:
            raise DispatchError(f"mesh {name!r} ({m}) covers {m.world_size} ranks but the group has {world}")
    return meshes


@dataclass(frozen=True)
class BoundMethod:
    """A group method to install: its binding plus what it shows of the worker method."""

    binding: Binding
    signature: inspect.Signature
    doc: str | None
    module: str


@dataclass(frozen=True)
class MethodTable:
    """A worker class's group methods resolved for a mesh: everything binding decides, no backend.

    Built by :meth:`build` before any process starts, so a bad mesh or mode fails before a
    backend spends anything; :class:`WorkerGroup` then installs it over a backend.
    """

    worker_cls: type
    mesh: RankMesh
    meshes: dict[str, RankMesh]
    role: str | None
    registry: DispatchRegistry
    methods: dict[str, BoundMethod]
    late_meshes: bool = False

    @classmethod
    def build(
        cls,
        worker_cls: type,
        world_size: int,
        mesh: RankMesh | None = None,
        meshes: Mapping[str, RankMesh] | None = None,
        role: str | None = None,
        registry: DispatchRegistry | None = None,
        group_type: type = object,
        late_meshes: bool = False,
    ) -> "MethodTable":
        """Resolve every ``@register`` method of ``worker_cls`` for ``mesh`` (default ``RankMesh(dp=world_size)``).

        ``group_type`` is the group class the methods will be set on: a registered method may
        not shadow one of its attributes.  ``late_meshes``: a method on a mesh the table does not
        hold gets its plan at call time (``WorkerGroup._late_plan``) instead of failing now (a
        replica view plans its group's named meshes that way).
        """
        mesh = mesh if mesh is not None else RankMesh(dp=world_size)
        meshes = check_meshes(world_size, mesh, meshes or {})
        table = cls(worker_cls, mesh, meshes, role, registry or DEFAULT_REGISTRY, {}, late_meshes)
        taken = set(dir(group_type))
        for name, (func, spec, static) in registered_methods(worker_cls).items():
            if name in taken:
                raise DispatchError(f"{worker_cls.__name__}.{name} is registered but clashes with {group_type.__name__}.{name}")
            signature = public_signature(func, static)
            params = tuple(
                p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            )
            table.methods[name] = BoundMethod(
                table.resolve(name, spec, params), signature, func.__doc__, getattr(func, "__module__", __name__)
            )
        return table

    @property
    def preload(self) -> tuple[str, ...]:
        """Modules each rank imports as it starts, before its workers are built.

        tensordict, when a method may be sent DataProto or TensorDict batches (a proto mode, or a
        user mode, whose own functions decide what it sends): a rank would otherwise import it on
        its first batch, and the group's first data call would take seconds (about 1-2 CPU-s a
        rank) against milliseconds for the next, misleading every trace of it.  A group that
        takes no batches does not pay it (:mod:`rankmesh.data.tensordicts`).
        """
        takes_batches = any(
            isinstance(m.binding.entry, UserMode) or (isinstance(m.binding.entry, MeshSpec) and m.binding.entry.proto)
            for m in self.methods.values()
        )
        return (TENSORDICT,) if takes_batches else ()

    @property
    def extra_meshes(self) -> dict[str, RankMesh]:
        """The named meshes besides the default one (what a group was given as ``meshes``)."""
        return {k: v for k, v in self.meshes.items() if k != DEFAULT_MESH}

    @property
    def roles(self) -> dict[str, type]:
        """Role name -> class, for a colocated worker class (:data:`ROLES_ATTR`); empty otherwise."""
        return dict(getattr(self.worker_cls, ROLES_ATTR, {}))

    def route(self, name: str) -> tuple[str | None, str]:
        """The (role, worker method) a call of group method ``name`` runs."""
        routes: Mapping[str, tuple[str, str]] = getattr(self.worker_cls, ROUTES_ATTR, {})
        return routes.get(name, (self.role, name))

    def resolve(self, name: str, spec: MethodSpec, params: tuple[str, ...]) -> Binding:
        """The binding of method ``name`` registered with ``spec`` (``params``: its positional names)."""
        label = mode_label(spec.dispatch_mode)
        site = CallSite(f"{self.worker_cls.__name__}.{name}", params, label)
        role, target = self.route(name)
        try:
            entry = self.registry.resolve(spec.dispatch_mode)
        except DispatchError as exc:  # one error naming the method: the registry's has nothing more to say
            raise site.error(str(exc)) from None
        if isinstance(entry, UserMode):
            return Binding(name, spec, entry, None, site, role, target)
        if spec.execute_mode is Execute.RANK_ZERO:
            if entry.split and not entry.broadcast_fallback:
                raise site.error(
                    f"Execute.RANK_ZERO runs rank 0 alone and cannot serve a mode that splits arguments over {entry.split}"
                )
            entry = entry.replace(
                split=(), broadcast_fallback=False, padding=False, collect={"rank": 0}, run="collect", output="single"
            )
        return Binding(name, spec, entry, self._plan(entry, site), site, role, target)

    def _plan(self, spec: MeshSpec, site: CallSite) -> DispatchPlan | None:
        mesh = self.meshes.get(spec.mesh)
        if mesh is None:
            if self.late_meshes or (spec.split == ("dp",) and spec.collect_map == dict(MEGATRON_COLLECT) and spec.run == "all"):
                return None  # verl style: the workers register this mesh; asked on first call
            raise site.error(f"uses mesh {spec.mesh!r}, but the group has meshes {sorted(self.meshes)}")
        try:
            return spec.plan(mesh)
        except DispatchError as exc:
            raise site.error(str(exc)) from exc
