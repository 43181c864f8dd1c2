"""What to build in each process of a Ray group: one worker class, or several colocated roles.

verl has two overlapping mechanisms for colocated roles (a generated ``WorkerDict`` class plus
``spawn``, and ``fuse``).  Here there is one: every process hosts one object per role, all built
with the same rank context (roles colocated in one process share its mesh), and

* the group started from :func:`create_colocated_worker_cls` binds a *method table*
  (:func:`fused_worker_class`) exposing every role's registered methods as ``{role}_{method}``
  (verl's naming); the table records the route ``(role, method)`` of each, so calls carry the
  role explicitly and no name is ever parsed back;
* ``wg.spawn(prefix_set)`` returns one group per role over the same processes, whose methods
  keep their own names;
* ``wg.fuse(prefix_set)`` is ``spawn`` plus ``wg.actor``-style attributes.

Shutting down any of these groups stops the shared processes, hence all of them.

Each role travels to the processes as :func:`.pickling.sent_role` makes it: checked, when the
group starts, to pickle.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from rankmesh.errors import BackendError
from rankmesh.binding import ROLES_ATTR, ROUTES_ATTR

from .hostapi import RoleInit
from .pickling import sent_role


def unwrap_actor_class(cls: Any) -> type:
    """The plain class behind a ``@ray.remote`` class (or ``cls`` itself)."""
    inner = getattr(cls, "__ray_actor_class__", None)
    if inner is not None:
        return inner
    if not isinstance(cls, type):
        raise BackendError(f"expected a worker class, got {type(cls).__name__}: {cls!r}")
    return cls


class RayClassWithInitArgs:
    """A worker class and its constructor arguments, as verl's ``RayClassWithInitArgs``.

    ``cls`` may be a plain class or a ``@ray.remote`` class (its options are not used; pass Ray
    actor options, e.g. ``runtime_env``, with :meth:`update_options`).
    """

    def __init__(self, cls: Any, *args: Any, **kwargs: Any) -> None:
        self.cls = unwrap_actor_class(cls)
        self.args = args
        self.kwargs = kwargs
        self._options: dict[str, Any] = {}

    def update_options(self, options: Mapping[str, Any]) -> None:
        """Extra Ray actor options for every rank (``runtime_env``, ``max_concurrency`` ...)."""
        reserved = {"scheduling_strategy", "name", "namespace", "lifetime", "num_cpus", "num_gpus"} & set(options)
        if reserved:
            raise BackendError(f"options {sorted(reserved)} are set by the resource pool and the group")
        self._options.update(options)

    @property
    def options(self) -> dict[str, Any]:
        return dict(self._options)

    @property
    def role_names(self) -> list[str]:
        """The named roles (none here), without pickling anything (:attr:`roles` pickles every class)."""
        return []

    @property
    def roles(self) -> dict[str | None, RoleInit]:
        """Role name -> what to build in each process (one unnamed role here), checked to pickle.

        Each read pickles the classes and tries the arguments: read it once per start."""
        return {None: sent_role(self.cls, self.args, self.kwargs)}

    def __repr__(self) -> str:
        return f"RayClassWithInitArgs({self.cls.__qualname__}, args={self.args!r}, kwargs={self.kwargs!r})"


def fused_worker_class(roles: Mapping[str, type]) -> type:
    """A method table (never instantiated) with each role's methods renamed ``{role}_{name}``.

    The group binds its registered methods like any worker class's; the table's routes
    (``{role}_{name}`` -> ``(role, name)``) tell it which role object each call goes to.
    """
    routes: dict[str, tuple[str, str]] = {}
    attrs: dict[str, Any] = {
        "__module__": __name__,
        "__doc__": f"Colocated roles {sorted(roles)} (a method table; the roles live in the workers).",
        ROLES_ATTR: dict(roles),
        ROUTES_ATTR: routes,
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
            routes[f"{role}_{name}"] = (role, name)
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
    def role_names(self) -> list[str]:
        return list(self.members)

    @property
    def roles(self) -> dict[str | None, RoleInit]:
        return {role: sent_role(m.cls, m.args, m.kwargs) for role, m in self.members.items()}

    def __repr__(self) -> str:
        return f"ColocatedClassWithInitArgs({ {r: m.cls.__qualname__ for r, m in self.members.items()} })"


def create_colocated_worker_cls(class_dict: Mapping[str, Any]) -> ColocatedClassWithInitArgs:
    """verl's entry point: ``{"actor": RayClassWithInitArgs(...), "critic": ...}`` -> one class.

    Pass the result to :class:`~.group.RayWorkerGroup`, then :meth:`~.group.RayWorkerGroup.spawn` the roles.
    """
    return ColocatedClassWithInitArgs(class_dict)
