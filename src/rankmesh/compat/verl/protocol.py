"""verl's ``protocol`` semantics over rankmesh's DataProto: in-place unions and padding, asserts.

verl 0.9.1 code relies on a few behaviours rankmesh's own API changed on purpose: ``union`` and
the dict unions update their first argument, ``padding`` pads ``self``, checks fail with
``AssertionError``, ``concat`` refuses conflicting non-metric ``meta_info``.  This module gives
ported code exactly those, as a thin subclass: every operation is still
:class:`rankmesh.data.DataProto`'s (one implementation of rows, padding and concatenation);
the subclass only adds verl's in-place writes, its extra arguments and its error types
(:class:`~rankmesh.errors.DataProtoAssertionError` is both rankmesh's error and an
``AssertionError``).

Which class comes back: every derived batch keeps ``type(self)`` (slices, chunks, concat of
parts, pickling to and from workers), so a compat DataProto sent through a worker group comes
back a compat DataProto, and a worker that builds its output with the compat class returns one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rankmesh.data import columns
from rankmesh.data import proto as core
from rankmesh.errors import DataProtoAssertionError, DataProtoError, PaddingAssertionError, PaddingError

if TYPE_CHECKING:
    from tensordict import TensorDictBase

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def as_assertions() -> Iterator[None]:
    """Re-raise rankmesh's DataProto errors with verl's type (message and cause kept)."""
    try:
        yield
    except (DataProtoAssertionError, PaddingAssertionError):
        raise
    except PaddingError as exc:
        raise PaddingAssertionError(str(exc)) from exc
    except DataProtoError as exc:
        raise DataProtoAssertionError(str(exc)) from exc


def check(ok: bool, message: str) -> None:
    """verl's ``assert ok, message``, as a rankmesh error that is also an AssertionError."""
    if not ok:
        raise DataProtoAssertionError(message)


# --- verl's module-level unions: in place, returning the first argument ----------------------


def union_tensor_dict(tensor_dict1: TensorDictBase, tensor_dict2: TensorDictBase) -> TensorDictBase:
    """Add ``tensor_dict2``'s keys to ``tensor_dict1`` in place and return it (verl's semantics).

    Shared keys must hold equal tensors (NaN equals NaN), checked before anything is written.
    """
    with as_assertions():
        columns.union_tensor_dict(tensor_dict1, tensor_dict2)  # the checks; the merged copy is dropped
    have = set(tensor_dict1.keys())
    for key in tensor_dict2.keys():
        if key not in have:
            tensor_dict1[key] = tensor_dict2[key]
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Add ``tensor_dict2``'s arrays to ``tensor_dict1`` in place and return it (verl's semantics).

    Shared keys must hold equal arrays: element-wise for n-dimensional and object arrays, NaN
    equal to NaN (a float NaN is not the string ``"nan"``).
    """
    for key, val in tensor_dict2.items():
        if key in tensor_dict1:
            check(isinstance(val, np.ndarray), f"`{key}` in tensor_dict2 is not a numpy array")
            check(isinstance(tensor_dict1[key], np.ndarray), f"`{key}` in tensor_dict1 is not a numpy array")
            # verl's own words: its tests match them
            check(columns.arrays_equal(tensor_dict1[key], val), f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
    tensor_dict1.update(tensor_dict2)
    return tensor_dict1


def union_two_dict(dict1: dict[str, Any], dict2: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``dict2``'s entries to ``dict1`` in place and return it; shared keys must be equal."""
    with as_assertions():
        columns.union_two_dict(dict1, dict2)
    dict1.update(dict2)
    return dict1


# --- DataProto ---------------------------------------------------------------------------------


class DataProto(core.DataProto):
    """rankmesh's DataProto with verl 0.9.1's in-place operations, arguments and assert types."""

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        num_batch_dims: int = 1,
        auto_padding: bool = False,
    ) -> DataProto:
        """verl's ``from_dict``: ``num_batch_dims`` leading dimensions must agree across tensors.

        Like verl 0.9.1, a batch of tensors has exactly one batch dimension: ``num_batch_dims > 1``
        fails verl's own consistency assert ("only support num_batch_dims=1") once the leading
        dimensions agree; fold the other dimensions into the rows first (``unfold_batch_dim``).
        """
        check(isinstance(num_batch_dims, int) and num_batch_dims > 0, "num_batch_dims must be greater than zero")
        if non_tensors is not None:
            check(num_batch_dims == 1, "only support num_batch_dims=1 when non_tensors is not None.")
        pivot, lead = None, None
        for key, t in (tensors or {}).items():
            shape = tuple(getattr(t, "shape", ()))[:num_batch_dims]
            if lead is None:
                pivot, lead = key, shape
            else:
                check(
                    shape == lead,
                    f"Not all the tensor in tensors have the same batch size with batch_dims={num_batch_dims}. "
                    f"Got {pivot} has {lead}, {key} has {shape}",
                )
        check(num_batch_dims == 1 or not tensors, "only support num_batch_dims=1")  # verl's check_consistency
        with as_assertions():
            return super().from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(  # type: ignore[override]
        cls, tensor_dict: TensorDictBase | None = None, meta_info: Mapping[str, Any] | None = None, num_batch_dims: int = 1
    ) -> DataProto:
        """verl's spelling: ``from_tensordict(tensor_dict, meta_info=None, num_batch_dims=1)``."""
        check(isinstance(num_batch_dims, int) and num_batch_dims > 0, "num_batch_dims must be greater than zero")
        check(tensor_dict is not None, "from_tensordict needs a TensorDict")
        if num_batch_dims != 1:
            check(
                all(isinstance(v, torch.Tensor) for v in tensor_dict.values()),
                "only support num_batch_dims=1 when tensor_dict contains non tensor data.",
            )
        with as_assertions():
            return super().from_tensordict(tensor_dict, None, meta_info)

    def chunk(self, chunks: int) -> list[DataProto]:
        """Equal chunks; an uneven split without auto padding fails as verl's assert does."""
        with as_assertions():
            return super().chunk(chunks)  # type: ignore[return-value]

    @staticmethod
    def concat(data: Sequence[core.DataProto], meta_info: Mapping[str, Any] | None = None) -> DataProto:
        """Row-wise concatenation; conflicting non-metric ``meta_info`` values fail, naming the key."""
        data = list(data)
        if meta_info is None:
            seen: dict[str, Any] = {}
            for d in data:
                for key, value in getattr(d, "meta_info", {}).items():
                    if key == columns.METRICS_KEY:
                        continue
                    if key in seen:
                        check(columns.values_equal(seen[key], value), f"Conflicting values for meta_info key '{key}'")
                    else:
                        seen[key] = value
        with as_assertions():
            out = core.DataProto.concat(data, meta_info)
        return out if isinstance(out, DataProto) else DataProto(out.batch, out.non_tensor_batch, out.meta_info)

    def union(self, other: core.DataProto) -> DataProto:
        """Add ``other``'s keys to ``self`` in place and return ``self`` (verl's semantics).

        Everything is checked before anything is written, so a failed union leaves ``self`` as it was.
        """
        with as_assertions():
            merged = super().union(other)  # every check, on copies
        if self.batch is not None and other.batch is not None:
            union_tensor_dict(self.batch, other.batch)
        else:
            self.batch = merged.batch
        union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch)
        union_two_dict(self.meta_info, other.meta_info)
        return self

    def to(self, device: str | torch.device) -> DataProto:
        """Move ``self``'s tensors to ``device`` in place and return ``self`` (verl's semantics)."""
        self.batch = super().to(device).batch
        return self

    def padding(self, padding_size: int, padding_candidate: str = "") -> None:
        """Append ``padding_size`` copies of the first (``"first"``) or last row, in place (verl's)."""
        check(isinstance(padding_size, int) and padding_size >= 0, f"padding_size must be >= 0, got {padding_size!r}")
        if padding_size == 0:
            return
        check(len(self) > 0, "cannot pad a DataProto with no rows")
        row = 0 if padding_candidate == "first" else len(self) - 1
        with as_assertions():
            padded = self.select_idxs(np.concatenate([np.arange(len(self)), np.full(padding_size, row)]))
        self.batch, self.non_tensor_batch = padded.batch, padded.non_tensor_batch

    def unfold_column_chunks(self, n_split: int, split_keys: Sequence[str] | None = None) -> DataProto:
        """Cut each ``split_keys`` column's second dimension into ``n_split`` rows; repeat the others.

        ``[b, n_split * k, ...]`` becomes ``[b * n_split, k, ...]`` for split keys; every other key
        repeats each row ``n_split`` times, so rows stay aligned.
        """
        check(isinstance(n_split, int) and n_split > 0, f"n_split must be a positive int, got {n_split!r}")
        split = set(split_keys or ())

        def unfold(key: Any, value: Any) -> Any:
            if key not in split:
                if isinstance(value, torch.Tensor):
                    return torch.repeat_interleave(value, n_split, dim=0)
                return np.repeat(value, n_split, axis=0)
            if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == object and len(value):
                # verl stores a column of equal-length lists as a 2-D array: split each row's list the same way
                rows = [list(row) if isinstance(row, (list, tuple, np.ndarray)) else row for row in value]
                if all(isinstance(row, list) for row in rows) and len({len(row) for row in rows}) == 1:
                    value = np.array(rows)
            check(value.ndim >= 2 and value.shape[1] % n_split == 0,
                  f"key {key!r} of shape {tuple(value.shape)}: dim 1 does not divide into {n_split}")
            return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])

        rows = len(self) * n_split
        batch = None
        if self.batch is not None:
            items = [(k, unfold(k, t)) for k, t in columns.flat_tensors(self.batch)]
            batch = columns.build_td(items, rows, self.batch.device)
        nt = {k: unfold(k, v) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=nt, meta_info=columns.copy_meta(self.meta_info))

    def print_size(self, prefix: str = "") -> None:
        """Log the size of the tensors and the numpy columns in GB (verl printed it)."""
        tensor_bytes = sum(t.element_size() * t.numel() for _, t in columns.flat_tensors(self.batch)) if self.batch is not None else 0
        array_bytes = sum(v.nbytes for v in self.non_tensor_batch.values())
        message = f"Size of tensordict: {tensor_bytes / 1024**3} GB, size of non_tensor_batch: {array_bytes / 1024**3} GB"
        logger.info(f"{prefix}, {message}" if prefix else message)

    def get_data_info(self) -> str:
        """Keys with shapes, dtypes and devices, then meta_info keys with their value types."""
        lines = ["batch"]
        for key, t in columns.flat_tensors(self.batch) if self.batch is not None else []:
            lines.append(f"  {key}: {tuple(t.shape)} ({t.dtype}) {t.device}")
        lines.append("non_tensor_batch")
        lines += [f"  {k}: ndarray{v.shape} ({v.dtype})" for k, v in self.non_tensor_batch.items()]
        lines.append("meta_info")
        lines += [f"  {k}: {_type_info(v)}" for k, v in self.meta_info.items()]
        return "\n".join(lines)


def _type_info(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({_type_info(v) for v in value[:3]})
        return f"list[{'|'.join(kinds) if kinds else '...'}]"
    if isinstance(value, tuple):
        return f"tuple({', '.join(_type_info(v) for v in value)})"
    if isinstance(value, dict):
        if not value:
            return "dict"
        k, v = next(iter(value.items()))
        return f"dict[{_type_info(k)}: {_type_info(v)}]"
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    return type(value).__name__


def collate_fn(x: Sequence[core.DataProtoItem]) -> DataProto:
    """verl's DataLoader collate: stack the items' TensorDicts, gather their columns as objects."""
    check(len(x) > 0, "collate_fn needs at least one DataProtoItem")
    batch = torch.stack([item.batch for item in x]).contiguous()
    cols = columns.list_of_dict_to_dict_of_list([item.non_tensor_batch for item in x])
    return DataProto(batch=batch, non_tensor_batch={k: columns.to_object_array(v) for k, v in cols.items()})


def fold_batch_dim(data: core.DataProto, new_batch_size: int) -> core.DataProto:
    """``[bsz, ...]`` -> ``[new_bsz, bsz // new_bsz, ...]`` (a new batch; the input is unchanged)."""
    with as_assertions():
        return data.fold_batch_dim(new_batch_size)


def unfold_batch_dim(data: core.DataProto, batch_dims: int = 2) -> core.DataProto:
    """Merge the first ``batch_dims`` dimensions into the batch (a new batch)."""
    with as_assertions():
        return data.unfold_batch_dim(batch_dims)


def pad_dataproto_to_divisor(data: core.DataProto, size_divisor: int) -> tuple[core.DataProto, int]:
    """``(padded copy, pad_size)``: rows repeated from the start; the input is never modified."""
    with as_assertions():
        return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: core.DataProto, pad_size: int) -> core.DataProto:
    """``data`` without its last ``pad_size`` rows."""
    with as_assertions():
        return data.unpad(pad_size)


__all__ = [
    "DataProto",
    "as_assertions",
    "collate_fn",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "union_numpy_dict",
    "union_tensor_dict",
    "union_two_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]
