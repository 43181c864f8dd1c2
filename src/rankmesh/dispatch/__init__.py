"""Dispatch: how a group call's arguments reach the ranks and whose outputs come back.

* :mod:`~rankmesh.dispatch.spec`: :class:`MeshSpec` (a mode as data) and :class:`DispatchPlan`.
* :mod:`~rankmesh.dispatch.modes`: verl's named modes, :class:`Dispatch`, :class:`Execute` and
  the :class:`DispatchRegistry` holding them.
* :mod:`~rankmesh.dispatch.register`: the ``@register`` decorator.
* :mod:`~rankmesh.dispatch.split`: splitting/padding arguments and joining outputs.
"""

from rankmesh.dispatch.modes import (
    DEFAULT_REGISTRY,
    Dispatch,
    DispatchMode,
    DispatchRegistry,
    Execute,
    UserMode,
    make_nd_compute_dataproto_dispatch_fn,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rankmesh.dispatch.register import MethodSpec, method_spec, register, registered_methods
from rankmesh.dispatch.spec import MEGATRON_COLLECT, DispatchPlan, MeshSpec

__all__ = [
    "DEFAULT_REGISTRY",
    "MEGATRON_COLLECT",
    "Dispatch",
    "DispatchMode",
    "DispatchPlan",
    "DispatchRegistry",
    "Execute",
    "MeshSpec",
    "MethodSpec",
    "UserMode",
    "make_nd_compute_dataproto_dispatch_fn",
    "method_spec",
    "register",
    "register_dispatch_mode",
    "registered_methods",
    "update_dispatch_mode",
]
