"""verl ``single_controller`` names, for porting worker classes by changing imports.

``from verl.single_controller.base.decorator import register, Dispatch`` becomes
``from rankmesh.compat.verl import register, Dispatch``; the same for ``DataProto``, ``Worker``,
``RayWorkerGroup`` and every other public name of verl 0.9.1's ``protocol`` module and its
``Worker`` / ``WorkerGroup`` / ``RayWorkerGroup`` / ``RayResourcePool`` classes, and the few
``verl.utils`` helpers ported code calls (``get_device_name``, ``parallel_put``: :mod:`.ray_utils`)
(``tests/compat/verl_0_9_1_names.json`` is the list, ``docs/porting.md`` the map).

Behaviour is verl 0.9.1's wherever verl code depends on it: ``DataProto`` here
(:mod:`.protocol`) unions and pads in place and fails verl's asserts with errors that are
rankmesh's *and* ``AssertionError``; ``Worker`` and ``RayWorkerGroup`` (:mod:`.workers`) add
verl's extra methods, fused workers and ObjectRef futures (``ray.get(wg.execute_all_async(...))``).
All three are thin subclasses of rankmesh's own classes, so ported code and new code mix
freely.  verl's defects stay fixed (padding never mutates the caller's batch in dispatch,
futures drop pad rows, ``RANK_ZERO`` runs on rank 0 only); ``docs/porting.md`` lists every
deliberate difference.

Importing this module imports Ray (the Ray backend's names live here too).
"""

from __future__ import annotations

from rankmesh.backends.ray import (
    RayClassWithInitArgs,
    create_colocated_worker_cls,
    merge_resource_pool,
    split_resource_pool,
)
from rankmesh.compat.verl.protocol import (
    DataProto,
    collate_fn,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    union_numpy_dict,
    union_tensor_dict,
    union_two_dict,
    unfold_batch_dim,
    unpad_dataproto,
)
from rankmesh.compat.verl.ray_utils import parallel_put
from rankmesh.compat.verl.workers import (
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
    get_device_name,
)
from rankmesh.data import DataProtoConfig, DataProtoFuture, list_of_dict_to_dict_of_list
from rankmesh.data.proto import DataProtoItem
from rankmesh.dispatch import (
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
    register_dispatch_mode,
    update_dispatch_mode,
)
from rankmesh.group import WorkerGroup
from rankmesh.mesh import DistGlobalInfo, DistRankInfo

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
    "WorkerGroup",
    "collate_fn",
    "create_colocated_worker_cls",
    "create_colocated_worker_cls_fused",
    "create_colocated_worker_raw_cls",
    "fold_batch_dim",
    "get_device_name",
    "list_of_dict_to_dict_of_list",
    "make_nd_compute_dataproto_dispatch_fn",
    "merge_resource_pool",
    "pad_dataproto_to_divisor",
    "parallel_put",
    "register",
    "register_dispatch_mode",
    "split_resource_pool",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "union_two_dict",
    "unpad_dataproto",
    "update_dispatch_mode",
]
