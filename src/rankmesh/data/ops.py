"""verl's module-level names for DataProto row operations, each one line over a DataProto method.

Ported code calls ``pad_dataproto_to_divisor(data, n)``; new code writes ``data.pad_to_divisor(n)``.
Both are the same operation, so verl's functions only check that they were given a DataProto and
delegate.  verl's versions mutate or alias their inputs in places (``fold_batch_dim`` reshaped
the caller's non_tensor dict, padding returned the input object itself); these, like the
methods, always return new objects.
"""

from __future__ import annotations

from typing import Any

from rankmesh.data.proto import DataProto
from rankmesh.errors import DataProtoError


def _check_proto(data: Any, what: str) -> DataProto:
    if not isinstance(data, DataProto):
        raise DataProtoError(f"{what} needs a DataProto, got {type(data).__name__}")
    return data


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """``(new DataProto, pad_size)``: see :meth:`DataProto.pad_to_divisor`."""
    return _check_proto(data, "pad_dataproto_to_divisor").pad_to_divisor(size_divisor)


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """A new DataProto without the last ``pad_size`` rows: see :meth:`DataProto.unpad`."""
    return _check_proto(data, "unpad_dataproto").unpad(pad_size)


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """``[bsz, ...]`` -> ``[new_bsz, bsz // new_bsz, ...]``: see :meth:`DataProto.fold_batch_dim`."""
    return _check_proto(data, "fold_batch_dim").fold_batch_dim(new_batch_size)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Merge the first ``batch_dims`` dimensions into the batch: see :meth:`DataProto.unfold_batch_dim`."""
    return _check_proto(data, "unfold_batch_dim").unfold_batch_dim(batch_dims)


__all__ = ["fold_batch_dim", "pad_dataproto_to_divisor", "unfold_batch_dim", "unpad_dataproto"]
