"""verl ``single_controller`` names, for porting worker classes by changing imports.

``from verl.single_controller.base.decorator import register, Dispatch`` becomes
``from rankmesh.compat.verl import register, Dispatch``; the same for ``DataProto``,
``RayWorkerGroup`` and the rest below.  verl's mechanics
(``make_nd_compute_dataproto_dispatch_fn``, ``update_dispatch_mode``, ``DataProtoConfig``, the
``*_dataproto`` functions) live here and in their own modules, not on rankmesh's front door.
Where a name is also part of rankmesh's own API it is the very same object
(``rankmesh.compat.verl.DataProto is rankmesh.DataProto``), so ported code and new code mix
freely.  The semantics are verl's, without its defects: padding never mutates the caller's
batch, futures drop pad rows, ``DP_COMPUTE_METRIC`` is never trimmed, ``RANK_ZERO`` works, node
order is numeric, and worker failures name their rank.

Importing this module imports Ray (the Ray backend's names live here too).
"""

from __future__ import annotations

from typing import Any, Mapping

from rankmesh.backends.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    create_colocated_worker_cls,
    split_resource_pool,
)
from rankmesh.backends.ray.classes import fused_worker_class, unwrap_actor_class
from rankmesh.data import (
    DataProto,
    DataProtoConfig,
    DataProtoFuture,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    union_numpy_dict,
    union_tensor_dict,
    unpad_dataproto,
)
from rankmesh.data.proto import DataProtoItem
from rankmesh.dispatch import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rankmesh.mesh import DistGlobalInfo, DistRankInfo
from rankmesh.worker import Worker


def create_colocated_worker_raw_cls(class_dict: Mapping[str, Any]) -> type:
    """verl's raw (not ``ray.remote``-wrapped) colocated class: one method table over the roles.

    Each role's methods appear as ``{role}_{method}``.  To run the roles, pass the dict to
    :func:`create_colocated_worker_cls` instead; this raw form is for inspecting the fused methods.
    """
    roles = {}
    for role, item in class_dict.items():
        cls = item.cls if isinstance(item, RayClassWithInitArgs) else item
        roles[role] = unwrap_actor_class(cls)
    return fused_worker_class(roles)


__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "Dispatch",
    "DistGlobalInfo",
    "DistRankInfo",
    "Execute",
    "RayClassWithInitArgs",
    "RayResourcePool",
    "RayWorkerGroup",
    "Worker",
    "create_colocated_worker_cls",
    "create_colocated_worker_raw_cls",
    "fold_batch_dim",
    "make_nd_compute_dataproto_dispatch_fn",
    "pad_dataproto_to_divisor",
    "register",
    "register_dispatch_mode",
    "split_resource_pool",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
    "update_dispatch_mode",
]
