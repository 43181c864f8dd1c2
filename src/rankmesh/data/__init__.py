"""Batches that travel between the controller and worker groups.

``DataProto`` keeps verl's names and call semantics (port worker code by changing imports);
``DataProtoFuture`` is what a non-blocking worker-group call returns.
"""

from rankmesh.data.collate import (
    list_of_dict_to_dict_of_list,
    union_numpy_dict,
    union_tensor_dict,
    union_two_dict,
)
from rankmesh.data.config import AUTO_PADDING_KEY, DataProtoConfig, auto_padding_enabled
from rankmesh.data.future import DataProtoFuture, FuturePart, identity_fetch, ray_fetch
from rankmesh.data.ops import (
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)
from rankmesh.data.proto import DataProto, DataProtoItem

__all__ = [
    "AUTO_PADDING_KEY",
    "DataProto",
    "DataProtoConfig",
    "DataProtoFuture",
    "DataProtoItem",
    "FuturePart",
    "auto_padding_enabled",
    "fold_batch_dim",
    "identity_fetch",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "ray_fetch",
    "union_numpy_dict",
    "union_tensor_dict",
    "union_two_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]
