"""Batches that travel between the controller and worker groups.

``DataProto`` keeps verl's names and call semantics (port worker code by changing imports) and
owns every operation on its rows; ``DataProtoFuture`` is what a non-blocking worker-group call
returns.  This package knows no Ray: backends hand futures their own ``fetch``.

Modules, in import order: ``config`` (verl's auto-padding switch), ``columns`` (per-column work:
checks, equality, concatenation, unions, TensorDict conversion), ``proto`` (DataProto),
``ops`` (verl's module-level names over DataProto methods), ``future`` (DataProtoFuture),
``receive`` (private copies of copy-on-write inputs, for ``receive="copy"`` calls).
"""

from rankmesh.data.columns import (
    list_of_dict_to_dict_of_list,
    union_numpy_dict,
    union_tensor_dict,
    union_two_dict,
)
from rankmesh.data.config import AUTO_PADDING_KEY, DataProtoConfig, auto_padding_enabled
from rankmesh.data.future import DataProtoFuture, FuturePart, identity_fetch
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
    "union_numpy_dict",
    "union_tensor_dict",
    "union_two_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]
