"""Colocated roles: several worker classes (actor, critic, ref ...) in the same processes.

verl has two overlapping mechanisms for this (a generated ``WorkerDict`` class plus ``spawn``,
and ``fuse``).  Here there is one: every process hosts one object per role, all built with the
same rank context (roles colocated in one process share its mesh), and

* the group started from :func:`create_colocated_worker_cls` exposes every role's registered
  methods as ``{role}_{method}`` (verl's naming), routed by the host to the right object;
* :func:`spawn` (``wg.spawn(prefix_set)``) returns one group per role over the same processes,
  whose methods keep their own names;
* ``wg.fuse(prefix_set)`` is ``spawn`` plus ``wg.actor``-style attributes.

Shutting down any of these groups stops the shared processes, hence all of them.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

from rankmesh.errors import BackendError

from .actor import RoleSpec
from .group import RayClassWithInitArgs, RayWorkerGroup, unwrap_actor_class


def fused_worker_class(roles: Mapping[str, type]) -> type:
    """A method table (never instantiated) with each role's methods renamed ``{role}_{name}``.

    The group binds its registered methods like any worker class's; the host routes
    ``{role}_{name}`` to ``name`` on that role's object.
    """
    attrs: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"Colocated roles {sorted(roles)} (a method table; the roles live in the workers).",
        "rankmesh_roles": dict(roles),
    }
    for role, cls in roles.items():
        for name in dir(cls):
            if name.startswith("__"):
                continue
            attr = inspect.getattr_static(cls, name, None)
            func = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            if isinstance(attr, property) or not callable(func):
                continue
            attrs[f"{role}_{name}"] = attr
    return type("Colocated_" + "_".join(roles), (), attrs)


class ColocatedClassWithInitArgs(RayClassWithInitArgs):
    """Several :class:`RayClassWithInitArgs` to build side by side in every process."""

    def __init__(self, class_dict: Mapping[str, RayClassWithInitArgs]) -> None:
        if not class_dict:
            raise BackendError("create_colocated_worker_cls needs at least one role")
        members: dict[str, RayClassWithInitArgs] = {}
        for role, item in class_dict.items():
            if not isinstance(role, str) or not role.isidentifier():
                raise BackendError(f"role names must be identifiers, got {role!r}")
            members[role] = item if isinstance(item, RayClassWithInitArgs) else RayClassWithInitArgs(item)
        self.members = members
        super().__init__(fused_worker_class({role: m.cls for role, m in members.items()}))
        for member in members.values():
            self.update_options(member.options)

    @property
    def roles(self) -> dict[str | None, RoleSpec]:
        return {role: RoleSpec(m.cls, tuple(m.args), dict(m.kwargs)) for role, m in self.members.items()}

    def __repr__(self) -> str:
        return f"ColocatedClassWithInitArgs({ {r: m.cls.__qualname__ for r, m in self.members.items()} })"


def create_colocated_worker_cls(class_dict: Mapping[str, Any]) -> ColocatedClassWithInitArgs:
    """verl's entry point: ``{"actor": RayClassWithInitArgs(...), "critic": ...}`` -> one class.

    Pass the result to :class:`RayWorkerGroup`, then :meth:`RayWorkerGroup.spawn` the roles.
    """
    return ColocatedClassWithInitArgs(class_dict)


def spawn(group: RayWorkerGroup, prefix_set: Sequence[str]) -> dict[str, RayWorkerGroup]:
    """One group per role in ``prefix_set``, over ``group``'s processes."""
    roles: Mapping[str, type] = getattr(group.worker_cls, "rankmesh_roles", {})
    if isinstance(prefix_set, str):
        prefix_set = [prefix_set]
    unknown = [p for p in prefix_set if p not in roles]
    if unknown:
        raise BackendError(f"no colocated role {unknown} in this group (roles: {sorted(roles)})")
    return {role: group._view(unwrap_actor_class(roles[role]), role) for role in prefix_set}
