"""Module-level DataProto operations with verl's names (re-exported by the verl compat layer).

verl's versions mutate or alias their inputs in places (``fold_batch_dim`` reshaped the caller's
non_tensor dict, padding returned the input object itself); these always return new objects.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tensordict import TensorDict, TensorDictBase

from rankmesh.data import collate
from rankmesh.errors import DataProtoError

if TYPE_CHECKING:
    from rankmesh.data.proto import DataProto

logger = logging.getLogger(__name__)


def _proto() -> type:
    # proto imports this module at load time, so it is looked up at call time.
    from rankmesh.data.proto import DataProto

    return DataProto


def _check_proto(data: Any, what: str) -> None:
    if not isinstance(data, _proto()):
        raise DataProtoError(f"{what} needs a DataProto, got {type(data).__name__}")


def concat_dataprotos(data: Sequence[DataProto], meta_info: dict[str, Any] | None = None) -> DataProto:
    """Row-wise concatenation (copies, one ``torch.cat`` per key).

    ``meta_info`` replaces the merged meta_info (:func:`collate.merge_meta_info`) when given.
    Parts without any column (e.g. empty results) are skipped; the others must have the same
    keys and, for tensors, the same dtypes.
    """
    data = list(data)
    for i, d in enumerate(data):
        _check_proto(d, f"concat (part {i})")
    cls = type(data[0]) if data else _proto()
    meta = collate.merge_meta_info([d.meta_info for d in data]) if meta_info is None else meta_info
    parts = [d for d in data if d.batch is not None or d.non_tensor_batch]
    if not parts:
        return cls(meta_info=meta)
    batch = None
    if any(p.batch is not None for p in parts):
        flats = []
        for i, p in enumerate(parts):
            if p.batch is None:
                raise DataProtoError(f"concat: part {i} has no tensor batch while others have one")
            flats.append(dict(collate.flat_tensors(p.batch)))
        keys = list(flats[0])
        for i, f in enumerate(flats):
            if set(f) != set(keys):
                diff = sorted(map(str, set(f) ^ set(keys)))
                raise DataProtoError(f"concat: batch keys differ between parts (key(s) {diff}, part {i})")
        length = sum(p.batch.batch_size[0] for p in parts)
        items = [(k, collate.concat_tensors(k, [f[k] for f in flats])) for k in keys]
        batch = collate.build_td(items, length, collate.common_device([p.batch for p in parts]))
    names = set(parts[0].non_tensor_batch)
    for i, p in enumerate(parts):
        if set(p.non_tensor_batch) != names:
            diff = sorted(set(p.non_tensor_batch) ^ names)
            raise DataProtoError(f"concat: non_tensor_batch keys differ between parts (key(s) {diff}, part {i})")
    nt = {k: collate.concat_arrays(k, [p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch}
    return cls(batch=batch, non_tensor_batch=nt, meta_info=meta)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Pad rows until ``len`` divides by ``size_divisor``; returns ``(new DataProto, pad_size)``.

    Pad rows repeat the batch from its start (cycling when the batch is shorter than the pad),
    as verl's function does.  The input is never modified; with nothing to pad the result is a
    new DataProto sharing the input's tensors.
    """
    _check_proto(data, "pad_dataproto_to_divisor")
    divisor = collate.check_positive_int(size_divisor, "size_divisor")
    length = len(data)
    pad_size = -length % divisor
    if pad_size == 0:
        if length == 0:
            logger.debug("padding a DataProto with no rows: nothing to do")
        return copy.copy(data), 0
    index = np.concatenate([np.arange(length), np.arange(pad_size) % length])
    return data.select_idxs(index), pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """A new DataProto without the last ``pad_size`` rows (views)."""
    _check_proto(data, "unpad_dataproto")
    if isinstance(pad_size, bool) or not isinstance(pad_size, (int, np.integer)) or not 0 <= pad_size <= len(data):
        raise DataProtoError(f"pad_size must be an integer in [0, {len(data)}], got {pad_size!r}")
    return data.slice(0, len(data) - int(pad_size))


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """``[bsz, ...]`` -> ``[new_bsz, bsz // new_bsz, ...]`` for every tensor and column."""
    _check_proto(data, "fold_batch_dim")
    new = collate.check_positive_int(new_batch_size, "new_batch_size")
    if len(data) % new:
        raise DataProtoError(f"fold_batch_dim: {len(data)} rows do not divide into {new}")
    k = len(data) // new
    return data._derive(lambda t: t.reshape(new, k, *t.shape[1:]), lambda v: v.reshape(new, k, *v.shape[1:]), new)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """Merge the first ``batch_dims`` dimensions of every tensor and column into the batch."""
    _check_proto(data, "unfold_batch_dim")
    bd = collate.check_positive_int(batch_dims, "batch_dims")
    shapes = [(k, tuple(t.shape)) for k, t in collate.flat_tensors(data.batch)] if data.batch is not None else []
    shapes += [(k, v.shape) for k, v in data.non_tensor_batch.items()]
    lead = None
    for key, shape in shapes:
        if len(shape) < bd or (lead is not None and shape[:bd] != lead):
            raise DataProtoError(
                f"unfold_batch_dim: key {key!r} has shape {shape}; expected {bd} leading dims {lead or ''}".rstrip()
            )
        lead = shape[:bd]
    if lead is None:
        return copy.copy(data)
    n = math.prod(lead)
    return data._derive(lambda t: t.reshape(n, *t.shape[bd:]), lambda v: v.reshape(n, *v.shape[bd:]), n)


def split_tensordict(td: TensorDictBase) -> tuple[TensorDict, dict[str, np.ndarray], dict[str, Any]]:
    """Tensors, per-row non-tensor stacks (as object columns) and single non-tensor values."""
    from tensordict import NonTensorStack, is_non_tensor

    if not isinstance(td, TensorDictBase):
        raise DataProtoError(f"from_tensordict needs a TensorDict, got {type(td).__name__}")
    if len(td.batch_size) != 1:
        raise DataProtoError(f"TensorDict must have exactly one batch dimension, got {tuple(td.batch_size)}")
    tensors: dict[str, Any] = {}
    columns: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for key, val in td.items():
        if isinstance(val, NonTensorStack):
            columns[key] = collate.to_object_array(val.tolist())
        elif is_non_tensor(val):
            meta[key] = val.data
        else:
            tensors[key] = val
    return TensorDict(tensors, batch_size=td.batch_size, device=td.device), columns, meta


def join_tensordict(
    batch: TensorDictBase | None, length: int, columns: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> TensorDict:
    """Inverse of :func:`split_tensordict`; key clashes are errors."""
    from tensordict import NonTensorData, NonTensorStack

    td = batch.copy() if batch is not None else TensorDict({}, batch_size=[length])
    for key, col in columns.items():
        if key in td.keys():
            raise DataProtoError(f"to_tensordict: key {key!r} is both a tensor and a non-tensor column")
        if len(col) == 0:
            raise DataProtoError(f"to_tensordict: non-tensor column {key!r} has no rows to stack")
        td.set(key, NonTensorStack(*[NonTensorData(data=v, batch_size=[]) for v in col]))
    for key, val in meta.items():
        if key in td.keys():
            raise DataProtoError(f"to_tensordict: meta_info key {key!r} clashes with a column")
        td.set_non_tensor(key, val)
    return td
