"""Columns behind DataProto: checks, equality, concatenation, unions, meta_info merging, TensorDicts.

DataProto's row operations are written in terms of its columns (the tensor leaves of ``batch``,
the numpy arrays of ``non_tensor_batch``) and its meta dict; the per-column work lives here, so
``proto.py`` reads as the operations themselves.  Every function works on plain TensorDicts,
numpy dicts and meta dicts, never on the caller's containers in place: each returns new
containers (tensor storage may be shared, containers never).  verl's module-level names for the
dict unions (``union_tensor_dict`` ...) are these functions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch

from rankmesh import serialization
from rankmesh.data.tensordicts import is_tensordict, module as tensordict_module, new_tensordict
from rankmesh.errors import DataProtoError

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

logger = logging.getLogger(__name__)

#: A TensorDict key: a string, or a tuple of strings for nested entries.
Key = Union[str, tuple[str, ...]]

#: Concat outputs at least this large are allocated through numpy (huge pages, see
#: :func:`rankmesh.serialization.numpy_backed_empty`).
BIG_OUTPUT_BYTES = 4 << 20

#: meta_info key whose per-part dicts are gathered into a dict of lists by concat (verl's rule).
METRICS_KEY = "metrics"


# --- small utilities ---------------------------------------------------------------------------


def to_object_array(values: Sequence[Any]) -> np.ndarray:
    """A 1-D object array with one row per element (never a 2-D array from nested lists)."""
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _copy_containers(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _copy_containers(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_copy_containers(x) for x in v]
    return v


def copy_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Copy meta_info containers (dicts and lists, recursively) but not the values in them.

    Why: derived batches (chunks, slices, ...) must not see each other's
    ``meta_info["x"] = ...`` or ``meta_info["metrics"]["m"] = ...``, while copying tensors or
    arrays stored in meta_info would be needlessly expensive.
    """
    return {k: _copy_containers(v) for k, v in meta.items()}


def as_column(key: Any, val: Any) -> np.ndarray:
    """Validate one non-tensor column; lists and tuples become 1-D object arrays."""
    if not isinstance(key, str):
        raise DataProtoError(f"non_tensor_batch keys must be str, got {key!r}")
    if isinstance(val, (list, tuple)):
        return to_object_array(val)
    if not isinstance(val, np.ndarray):
        raise DataProtoError(
            f"non_tensor_batch[{key!r}] must be a numpy array or a list, got {type(val).__name__}"
        )
    if val.ndim == 0:
        raise DataProtoError(f"non_tensor_batch[{key!r}] is 0-dimensional; it needs a batch dimension")
    return val


def row_index(idxs: Any, length: int) -> np.ndarray:
    """Normalize list / numpy / torch indices or boolean masks to a non-negative int64 array."""
    if isinstance(idxs, torch.Tensor):
        idxs = idxs.detach().cpu().numpy()
    elif isinstance(idxs, (list, tuple, range)):
        idxs = np.asarray(idxs) if len(idxs) else np.zeros(0, dtype=np.int64)
    if not isinstance(idxs, np.ndarray):
        raise DataProtoError(f"unsupported row index of type {type(idxs).__name__}")
    if idxs.ndim != 1:
        raise DataProtoError(f"row index must be 1-dimensional, got shape {idxs.shape}")
    if idxs.dtype == np.bool_:
        if idxs.shape[0] != length:
            raise DataProtoError(f"boolean mask has {idxs.shape[0]} entries but the batch has {length} rows")
        return np.flatnonzero(idxs)
    if idxs.dtype.kind not in "iu":
        raise DataProtoError(f"row index must hold integers or booleans, got dtype {idxs.dtype}")
    idxs = idxs.astype(np.int64, copy=False)
    if idxs.size and (idxs.min() < -length or idxs.max() >= length):
        raise IndexError(f"row index out of range for a batch of {length} rows")
    return np.where(idxs < 0, idxs + length, idxs)


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges of ``chunks`` pieces; sizes differ by at most one, larger ones first."""
    base, extra = divmod(length, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


# --- equality (NaN-aware, type-strict) ---------------------------------------------------------


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values; NaN equals NaN (unlike ``torch.equal``)."""
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if b.device != a.device:
        b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        try:
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        except (RuntimeError, NotImplementedError):  # e.g. float8 lacks comparisons: compare bits
            width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            return torch.equal(a.view(width), b.view(width))
    return torch.equal(a, b)


def arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and values; NaN equals NaN; object arrays compared element by element."""
    return _arrays_equal(a, b, set())


def values_equal(a: Any, b: Any) -> bool:
    """Equality for meta_info values and object-array cells; never raises.

    Containers that hold themselves (an object array whose cell is the array) compare without
    recursing forever: a pair of containers already being compared counts as equal, so two
    cycles of the same shape are equal and a cycle never equals a non-cycle.
    """
    return _values_equal(a, b, set())


def _arrays_equal(a: np.ndarray, b: np.ndarray, seen: set[tuple[int, int]]) -> bool:
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.hasobject:
        pair = (id(a), id(b))
        if pair in seen:
            return True
        seen.add(pair)
        return all(_values_equal(x, y, seen) for x, y in zip(a.reshape(-1), b.reshape(-1)))
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def _values_equal(a: Any, b: Any, seen: set[tuple[int, int]]) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _arrays_equal(a, b, seen)
    if isinstance(a, (Mapping, list, tuple)):
        pair = (id(a), id(b))
        if pair in seen:
            return True
        seen.add(pair)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k], seen) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y, seen) for x, y in zip(a, b))
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)):
        if math.isnan(a) and math.isnan(b):
            return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects with odd __eq__ are simply "not equal"
        return False


# --- TensorDict access -------------------------------------------------------------------------


def _walk_tensors(node: TensorDictBase, prefix: tuple[str, ...], out: list[tuple[Key, torch.Tensor]]) -> None:
    # A module-level function on purpose: a recursive closure would form a reference cycle
    # that keeps ``out`` (and so every tensor in it) alive until the cyclic GC runs.
    for k, v in node.items():
        key = prefix + (k,)
        name = key[0] if len(key) == 1 else key
        if isinstance(v, torch.Tensor):
            out.append((name, v))
        elif tensordict_module().is_non_tensor(v) or not is_tensordict(v):
            raise DataProtoError(
                f"batch key {name!r} holds {type(v).__name__}, not a tensor; put non-tensor data in non_tensor_batch"
            )
        else:
            _walk_tensors(v, key, out)


def flat_tensors(td: TensorDictBase) -> list[tuple[Key, torch.Tensor]]:
    """All tensor leaves of ``td`` (nested keys as tuples); non-tensor entries are rejected."""
    out: list[tuple[Key, torch.Tensor]] = []
    _walk_tensors(td, (), out)
    return out


def build_td(
    items: Iterable[tuple[Key, torch.Tensor]], length: int, device: Any = None
) -> TensorDict:
    """A fresh TensorDict with one batch dimension of ``length`` rows."""
    return new_tensordict(dict(items), batch_size=[length], device=device)


def common_device(tds: Sequence[TensorDictBase]) -> Any:
    """The device shared by all TensorDicts, or None when they disagree."""
    devices = {td.device for td in tds}
    return devices.pop() if len(devices) == 1 else None


# --- concatenation -----------------------------------------------------------------------------


def concat_tensors(key: Key, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along rows, refusing silent dtype promotion; errors name the key."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise DataProtoError(f"cannot concat batch key {key!r}: parts have dtypes {sorted(map(str, dtypes))}")
    try:
        first = tensors[0]
        rows = sum(t.shape[0] for t in tensors)
        nbytes = rows * math.prod(first.shape[1:]) * first.element_size()
        plain = all(t.shape[1:] == first.shape[1:] and t.device.type == "cpu" and not t.requires_grad for t in tensors)
        if nbytes >= BIG_OUTPUT_BYTES and plain:  # out= does not support autograd
            out = serialization.numpy_backed_empty((rows, *first.shape[1:]), first.dtype)
            if _numpy_concat_into(out, tensors):
                return out
            return torch.cat(list(tensors), dim=0, out=out)
        return torch.cat(list(tensors), dim=0)
    except RuntimeError as exc:
        shapes = [tuple(t.shape) for t in tensors]
        raise DataProtoError(f"cannot concat batch key {key!r} (shapes {shapes}): {exc}") from exc


def _numpy_concat_into(out: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
    """Fill ``out`` with ``tensors`` stacked by rows through ``numpy.concatenate``.

    Why: for large CPU tensors ``torch.cat`` runs 2-6x slower than a memcpy here (measured on
    a 256 MiB batch: torch.cat 166 ms, torch.cat(out=) 72 ms, numpy.concatenate 28 ms).
    Returns False (nothing written) when a part has no plain numpy view (conj/neg bits ...).
    """
    try:
        dst = serialization.numpy_view(out)
        srcs = [serialization.numpy_view(t.detach()) for t in tensors]
    except (TypeError, RuntimeError):
        return False
    if any(s.dtype != dst.dtype for s in srcs):
        return False
    np.concatenate(srcs, axis=0, out=dst)
    return True


def concat_arrays(key: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``np.concatenate`` along rows (numpy's own dtype promotion); errors name the key."""
    try:
        return np.concatenate(list(arrays), axis=0)
    except ValueError as exc:
        shapes = [a.shape for a in arrays]
        raise DataProtoError(f"cannot concat non_tensor_batch key {key!r} (shapes {shapes}): {exc}") from exc


def list_of_dict_to_dict_of_list(list_of_dict: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """``[{"a": 1}, {"a": 2, "b": 3}]`` -> ``{"a": [1, 2], "b": [3]}`` (keys in first-seen order)."""
    out: dict[str, list[Any]] = {}
    for d in list_of_dict:
        for k, v in d.items():
            out.setdefault(k, []).append(v)
    return out


def merge_meta_info(metas: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the meta_info of concatenated parts.

    * ``metrics``: each part's value (a dict of per-rank metrics, or a list of such dicts) is
      gathered and turned into a dict of lists, as verl does;
    * any other key: equal values are kept; when parts disagree the first part's value wins
      (old verl kept ``data[0].meta_info`` whole) and the keys are logged at DEBUG level.  Not an
      error, because per-rank values such as timings legitimately differ.
    """
    merged: dict[str, Any] = {}
    metrics: list[Any] = []
    conflicts: list[str] = []
    for meta in metas:
        for k, v in meta.items():
            if k == METRICS_KEY:
                if isinstance(v, list):
                    metrics.extend(v)
                elif v is not None:
                    metrics.append(v)
            elif k not in merged:
                merged[k] = v
            elif k not in conflicts and not values_equal(merged[k], v):
                conflicts.append(k)
    if conflicts:
        logger.debug("concat: meta_info keys %s differ between parts; keeping the first part's", conflicts)
    if metrics:
        if all(isinstance(m, Mapping) for m in metrics):
            merged[METRICS_KEY] = list_of_dict_to_dict_of_list(metrics)
        else:
            merged[METRICS_KEY] = metrics
    return copy_meta(merged)


# --- unions ------------------------------------------------------------------------------------


def union_tensor_dict(tensor_dict1: TensorDictBase, tensor_dict2: TensorDictBase) -> TensorDict:
    """Keys of both; a key in both must hold equal tensors.  Returns a new TensorDict.

    Unlike verl, ``tensor_dict1`` is not modified.
    """
    if tensor_dict1.batch_size != tensor_dict2.batch_size:
        raise DataProtoError(
            f"union: batch sizes differ: {tuple(tensor_dict1.batch_size)} vs {tuple(tensor_dict2.batch_size)}"
        )
    merged = dict(flat_tensors(tensor_dict1))
    for key, t in flat_tensors(tensor_dict2):
        if key in merged:
            if not tensors_equal(merged[key], t):
                raise DataProtoError(f"union: batch key {key!r} exists in both with different values")
        else:
            merged[key] = t
    device = common_device([tensor_dict1, tensor_dict2])
    return new_tensordict(merged, batch_size=tensor_dict1.batch_size, device=device)


def union_numpy_dict(
    tensor_dict1: Mapping[str, np.ndarray], tensor_dict2: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Keys of both; a key in both must hold equal arrays (NaN-aware).  Returns a new dict."""
    out = dict(tensor_dict1)
    for key, val in tensor_dict2.items():
        if key in out:
            if not (isinstance(val, np.ndarray) and isinstance(out[key], np.ndarray)):
                raise DataProtoError(f"union: non_tensor_batch key {key!r} is not a numpy array")
            if not arrays_equal(out[key], val):
                raise DataProtoError(f"union: non_tensor_batch key {key!r} exists in both with different values")
        else:
            out[key] = val
    return out


def union_two_dict(dict1: Mapping[str, Any], dict2: Mapping[str, Any]) -> dict[str, Any]:
    """Keys of both; a key in both must hold equal values.  Returns a new dict."""
    out = dict(dict1)
    for key, val in dict2.items():
        if key in out and not values_equal(out[key], val):
            raise DataProtoError(f"union: meta_info key {key!r} exists in both with different values")
        out.setdefault(key, val)
    return out


# --- TensorDict conversion ---------------------------------------------------------------------


def split_tensordict(td: TensorDictBase) -> tuple[TensorDict, dict[str, np.ndarray], dict[str, Any]]:
    """Tensors, per-row non-tensor stacks (as object columns) and single non-tensor values."""
    if not is_tensordict(td):
        raise DataProtoError(f"from_tensordict needs a TensorDict, got {type(td).__name__}")
    tdm = tensordict_module()
    if len(td.batch_size) != 1:
        raise DataProtoError(f"TensorDict must have exactly one batch dimension, got {tuple(td.batch_size)}")
    tensors: dict[str, Any] = {}
    columns: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    for key, val in td.items():
        if isinstance(val, tdm.NonTensorStack):
            columns[key] = to_object_array(val.tolist())
        elif tdm.is_non_tensor(val):
            meta[key] = val.data
        else:
            tensors[key] = val
    return new_tensordict(tensors, batch_size=td.batch_size, device=td.device), columns, meta


def join_tensordict(
    batch: TensorDictBase | None, length: int, columns: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> TensorDict:
    """Inverse of :func:`split_tensordict`; key clashes are errors."""
    tdm = tensordict_module()
    td = batch.copy() if batch is not None else tdm.TensorDict({}, batch_size=[length])
    for key, col in columns.items():
        if key in td.keys():
            raise DataProtoError(f"to_tensordict: key {key!r} is both a tensor and a non-tensor column")
        if len(col) == 0:
            raise DataProtoError(f"to_tensordict: non-tensor column {key!r} has no rows to stack")
        td.set(key, tdm.NonTensorStack(*[tdm.NonTensorData(data=v, batch_size=[]) for v in col]))
    for key, val in meta.items():
        if key in td.keys():
            raise DataProtoError(f"to_tensordict: meta_info key {key!r} clashes with a column")
        td.set_non_tensor(key, val)
    return td
