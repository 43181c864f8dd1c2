"""DataProto: the batch a controller hands to worker groups, and every operation on its rows.

verl's names and call semantics, fewer surprises.  A DataProto holds ``batch`` (a TensorDict
with exactly one batch dimension), ``non_tensor_batch`` (numpy arrays, first dimension = rows)
and ``meta_info`` (a plain dict).

Ownership rules, which differ from verl where verl surprised its users:

* containers are never shared: every derived DataProto (slice, chunk, select, ...) gets its own
  TensorDict, its own non_tensor dict and a meta_info whose dicts and lists are copied, so
  ``part.meta_info["x"] = 1`` or ``part.batch.pop("k")`` never shows up anywhere else;
* tensor and array *storage* may be shared: ``chunk``/``split``/slices are views, as in torch;
* every row operation is a method here (slice, chunk, concat, union, pad, unpad, fold ...);
  :mod:`rankmesh.data.ops` only gives some of them verl's module-level names, and the per-column
  work (equality, concatenation of one key, TensorDict conversion) is in :mod:`rankmesh.data.columns`;
* only operations whose verl name says so change ``self``: ``pop``, ``reorder`` and ``rename``
  (in place, as in verl).  ``union`` and ``to`` return new objects (verl's mutate ``self``), so
  write ``data = data.union(other)`` and ``data = data.to(device)``.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from rankmesh import serialization, validate
from rankmesh.data import columns
from rankmesh.data.config import AUTO_PADDING_KEY, auto_padding_enabled
from rankmesh.data.tensordicts import is_tensordict, new_tensordict
from rankmesh.errors import DataProtoError, PaddingError

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns, as in verl)."""

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False, repr=False)
class DataProto:
    """A batch of rows: tensors, numpy columns and meta data, validated on construction."""

    batch: TensorDictBase | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        nt = {} if self.non_tensor_batch is None else self.non_tensor_batch
        meta = {} if self.meta_info is None else self.meta_info
        if not isinstance(nt, Mapping):
            raise DataProtoError(f"non_tensor_batch must be a dict, got {type(nt).__name__}")
        if not isinstance(meta, Mapping):
            raise DataProtoError(f"meta_info must be a dict, got {type(meta).__name__}")
        # Own containers: the caller's dicts are never modified (list -> array conversion).
        self.non_tensor_batch = {k: columns.as_column(k, v) for k, v in nt.items()}
        self.meta_info = dict(meta)
        self.check_consistency()

    # --- validation and basic protocol ---------------------------------------------------------

    def check_consistency(self) -> None:
        """All tensors and columns share the batch length; errors name the key and lengths."""
        pivot, length = None, None
        if self.batch is not None:
            if not is_tensordict(self.batch):
                raise DataProtoError(f"batch must be a TensorDict or None, got {type(self.batch).__name__}")
            if len(self.batch.batch_size) != 1:
                raise DataProtoError(
                    f"batch must have exactly one batch dimension, got batch_size {tuple(self.batch.batch_size)}"
                )
            leaves = columns.flat_tensors(self.batch)  # rejects non-tensor entries by key
            pivot = f"batch[{leaves[0][0]!r}]" if leaves else "batch"
            length = self.batch.batch_size[0]
        if not isinstance(self.non_tensor_batch, dict):
            raise DataProtoError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        for key, val in self.non_tensor_batch.items():
            if not isinstance(val, np.ndarray):  # e.g. a list assigned after construction
                raise DataProtoError(f"non_tensor_batch[{key!r}] must be a numpy array, got {type(val).__name__}")
            columns.as_column(key, val)
            if length is None:
                pivot, length = f"non_tensor_batch[{key!r}]", val.shape[0]
            elif val.shape[0] != length:
                raise DataProtoError(
                    f"non_tensor_batch[{key!r}] has {val.shape[0]} rows but {pivot} has {length}"
                )
        if not isinstance(self.meta_info, dict):
            raise DataProtoError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")

    def __len__(self) -> int:
        if self.batch is not None:
            return int(self.batch.batch_size[0])
        for val in self.non_tensor_batch.values():
            return int(val.shape[0])
        return 0

    def __repr__(self) -> str:
        keys = [k for k, _ in columns.flat_tensors(self.batch)] if self.batch is not None else None
        return (
            f"{type(self).__name__}(len={len(self)}, batch_keys={keys}, "
            f"non_tensor_keys={list(self.non_tensor_batch)}, meta_keys={list(self.meta_info)})"
        )

    def _derive(
        self,
        tensor_fn: Callable[[torch.Tensor], torch.Tensor],
        array_fn: Callable[[np.ndarray], np.ndarray],
        length: int,
    ) -> DataProto:
        """A new DataProto with every tensor and column mapped row-wise and meta_info copied."""
        batch = None
        if self.batch is not None:
            items = [(k, tensor_fn(t)) for k, t in columns.flat_tensors(self.batch)]
            batch = columns.build_td(items, length, self.batch.device)
        non_tensor = {k: array_fn(v) for k, v in self.non_tensor_batch.items()}
        return type(self)(batch=batch, non_tensor_batch=non_tensor, meta_info=columns.copy_meta(self.meta_info))

    def __copy__(self) -> DataProto:
        """New containers, same tensors."""
        return self._derive(lambda t: t, lambda v: v, len(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> DataProto:
        batch = self.batch.clone() if self.batch is not None else None
        return type(self)(
            batch=batch,
            non_tensor_batch=copy.deepcopy(self.non_tensor_batch, memo),
            meta_info=copy.deepcopy(self.meta_info, memo),
        )

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Tensors and numeric columns as raw buffers (out of band with protocol 5)."""
        batch_state = None
        if self.batch is not None:
            device = None if self.batch.device is None else str(self.batch.device)
            tensors = [(k, serialization.reduce_tensor(t, protocol)) for k, t in columns.flat_tensors(self.batch)]
            batch_state = (len(self), device, tensors)
        arrays = [(k, serialization.reduce_ndarray(v, protocol)) for k, v in self.non_tensor_batch.items()]
        return (_rebuild_dataproto, (type(self), batch_state, arrays, self.meta_info))

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
        auto_padding: bool = False,
    ) -> DataProto:
        """Build from a dict of tensors (same first dimension) and a dict of columns."""
        tensors = dict(tensors or {})
        pivot, length = None, None
        for key, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise DataProtoError(f"tensors[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() == 0:
                raise DataProtoError(f"tensors[{key!r}] is 0-dimensional; it needs a batch dimension")
            if length is None:
                pivot, length = key, t.shape[0]
            elif t.shape[0] != length:
                raise DataProtoError(f"tensors[{key!r}] has {t.shape[0]} rows but tensors[{pivot!r}] has {length}")
        batch = new_tensordict(tensors, batch_size=[length]) if tensors else None
        meta = dict(meta_info or {})
        if auto_padding:
            meta[AUTO_PADDING_KEY] = True
        return cls(batch=batch, non_tensor_batch=dict(non_tensors or {}), meta_info=meta)

    @classmethod
    def from_single_dict(
        cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None, auto_padding: bool = False
    ) -> DataProto:
        """Build from one dict; tensors go to ``batch``, numpy arrays to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, val in data.items():
            if isinstance(val, torch.Tensor):
                tensors[key] = val
            elif isinstance(val, np.ndarray):
                non_tensors[key] = val
            else:
                raise DataProtoError(f"data[{key!r}] must be a tensor or a numpy array, got {type(val).__name__}")
        return cls.from_dict(tensors, non_tensors, meta_info, auto_padding=auto_padding)

    @classmethod
    def from_tensordict(
        cls,
        tensor_dict: TensorDictBase,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> DataProto:
        """Build from a TensorDict (not modified); the inverse of :meth:`to_tensordict`.

        Tensors become ``batch``, per-row non-tensor stacks object columns, single non-tensor
        values ``meta_info`` entries.
        """
        batch, cols, meta = columns.split_tensordict(tensor_dict)
        cols.update(non_tensors or {})
        meta.update(meta_info or {})
        return cls(batch=batch, non_tensor_batch=cols, meta_info=meta)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict in verl's layout: tensors, columns as per-row non-tensor stacks,
        meta_info entries as single non-tensor values.  Numeric columns come back as objects."""
        return columns.join_tensordict(self.batch, len(self), self.non_tensor_batch, self.meta_info)

    # --- indexing ------------------------------------------------------------------------------

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        """Slice -> DataProto (views); index list/array/mask -> DataProto (copies); int -> item."""
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (bool, np.bool_)):
            raise DataProtoError("a single bool is not a valid row index")
        if isinstance(item, (int, np.integer)):
            length = len(self)
            if not -length <= item < length:
                raise IndexError(f"row {item} out of range for a batch of {length} rows")
            i = int(item) % length
            return DataProtoItem(
                batch=self.batch[i] if self.batch is not None else None,
                non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
                meta_info=columns.copy_meta(self.meta_info),
            )
        if isinstance(item, (list, np.ndarray, torch.Tensor, range)):
            return self.select_idxs(item)
        raise DataProtoError(f"cannot index a DataProto with {type(item).__name__}")

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """Rows ``start:end:step``; views for positive steps (like torch), a copy otherwise."""
        start, end, step = slice(start, end, step).indices(len(self))
        if step < 0:
            return self.select_idxs(np.arange(start, end, step, dtype=np.int64))
        length = len(range(start, end, step))
        return self._derive(lambda t: t[start:end:step], lambda v: v[start:end:step], length)

    def select_idxs(self, idxs: Any) -> DataProto:
        """Rows at integer positions or where a boolean mask is true (a copy, as a gather is)."""
        idx = columns.row_index(idxs, len(self))
        tidx = torch.from_numpy(idx)
        return self._derive(lambda t: t[tidx.to(t.device)], lambda v: v[idx], len(idx))

    # --- splitting and joining -----------------------------------------------------------------

    def is_padding_enabled(self) -> bool:
        """verl's name: uneven chunks allowed (per-batch meta flag or the global switch)."""
        return auto_padding_enabled(self)

    padding_enabled = is_padding_enabled

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` views (no tensor bytes copied).

        Without auto padding the length must divide evenly (:class:`PaddingError` otherwise);
        with it, sizes differ by at most one and there are always exactly ``chunks`` pieces.
        """
        chunks = validate.positive_int(chunks, "chunks", DataProtoError)
        length = len(self)
        if length % chunks and not self.is_padding_enabled():
            raise PaddingError(
                f"cannot chunk a batch of {length} rows into {chunks} equal parts; pad it first "
                f"(pad_to_divisor) or enable auto padding"
            )
        return [self.slice(s, e) for s, e in columns.chunk_bounds(length, chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive views of ``split_size`` rows (the last may be shorter)."""
        split_size = validate.positive_int(split_size, "split_size", DataProtoError)
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto], meta_info: Mapping[str, Any] | None = None) -> DataProto:
        """Row-wise concatenation (copies, one ``torch.cat`` per key).

        meta_info is merged by :func:`columns.merge_meta_info`, or is ``meta_info`` when given.
        Parts without any column (e.g. empty results) are skipped; the others must have the same
        keys and, for tensors, the same dtypes.
        """
        data = list(data)
        for i, d in enumerate(data):
            if not isinstance(d, DataProto):
                raise DataProtoError(f"concat (part {i}) needs a DataProto, got {type(d).__name__}")
        cls = type(data[0]) if data else DataProto
        meta = columns.merge_meta_info([d.meta_info for d in data]) if meta_info is None else dict(meta_info)
        parts = [d for d in data if d.batch is not None or d.non_tensor_batch]
        if not parts:
            return cls(meta_info=meta)
        batch = None
        if any(p.batch is not None for p in parts):
            flats = []
            for i, p in enumerate(parts):
                if p.batch is None:
                    raise DataProtoError(f"concat: part {i} has no tensor batch while others have one")
                flats.append(dict(columns.flat_tensors(p.batch)))
            keys = list(flats[0])
            for i, f in enumerate(flats):
                if set(f) != set(keys):
                    diff = sorted(map(str, set(f) ^ set(keys)))
                    raise DataProtoError(f"concat: batch keys differ between parts (key(s) {diff}, part {i})")
            length = sum(p.batch.batch_size[0] for p in parts)
            items = [(k, columns.concat_tensors(k, [f[k] for f in flats])) for k in keys]
            batch = columns.build_td(items, length, columns.common_device([p.batch for p in parts]))
        names = set(parts[0].non_tensor_batch)
        for i, p in enumerate(parts):
            if set(p.non_tensor_batch) != names:
                diff = sorted(set(p.non_tensor_batch) ^ names)
                raise DataProtoError(f"concat: non_tensor_batch keys differ between parts (key(s) {diff}, part {i})")
        nt = {k: columns.concat_arrays(k, [p.non_tensor_batch[k] for p in parts]) for k in parts[0].non_tensor_batch}
        return cls(batch=batch, non_tensor_batch=nt, meta_info=meta)

    def union(self, other: DataProto) -> DataProto:
        """A new DataProto with the keys of both; shared keys must hold equal values."""
        if not isinstance(other, DataProto):
            raise DataProtoError(f"union needs a DataProto, got {type(other).__name__}")
        has_rows = [p.batch is not None or bool(p.non_tensor_batch) for p in (self, other)]
        if all(has_rows) and len(self) != len(other):
            raise DataProtoError(f"union: batches have {len(self)} and {len(other)} rows")
        if self.batch is None or other.batch is None:
            batch = next((b.copy() for b in (self.batch, other.batch) if b is not None), None)
        else:
            batch = columns.union_tensor_dict(self.batch, other.batch)
        return type(self)(
            batch=batch,
            non_tensor_batch=columns.union_numpy_dict(self.non_tensor_batch, other.non_tensor_batch),
            meta_info=columns.copy_meta(columns.union_two_dict(self.meta_info, other.meta_info)),
        )

    # --- key selection -------------------------------------------------------------------------

    def _check_keys(self, keys: Iterable[Any] | None, have: Iterable[Any], where: str) -> list[Any] | None:
        if keys is None:
            return None
        keys = [keys] if isinstance(keys, str) else list(dict.fromkeys(keys))
        have = set(have)
        for k in keys:
            if k not in have:
                raise DataProtoError(f"{where} key {k!r} not found (have {sorted(map(str, have))})")
        return keys

    def _batch_keys(self) -> list[Any]:
        return list(self.batch.keys(include_nested=True)) if self.batch is not None else []

    def select(
        self,
        batch_keys: Iterable[Any] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A new DataProto with only the given keys (None = all).  Missing keys are errors.

        ``deepcopy=True`` copies tensors too (verl copied only non-tensor data and meta_info).
        """
        bkeys = self._check_keys(batch_keys, self._batch_keys(), "batch")
        nkeys = self._check_keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch")
        mkeys = self._check_keys(meta_info_keys, self.meta_info, "meta_info")
        batch = None
        if self.batch is not None:
            batch = self.batch.select(*bkeys) if bkeys is not None else self.batch.copy()
            batch = batch.clone() if deepcopy else batch
        nt = {k: self.non_tensor_batch[k] for k in (nkeys if nkeys is not None else self.non_tensor_batch)}
        meta = {k: self.meta_info[k] for k in (mkeys if mkeys is not None else self.meta_info)}
        if deepcopy:
            nt, meta = copy.deepcopy(nt), copy.deepcopy(meta)
        return type(self)(batch=batch, non_tensor_batch=nt, meta_info=columns.copy_meta(meta))

    def pop(
        self,
        batch_keys: Iterable[Any] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the given keys from ``self`` (in place, as the name says) and return them."""
        bkeys = self._check_keys(batch_keys, self._batch_keys(), "batch") or []
        nkeys = self._check_keys(non_tensor_batch_keys, self.non_tensor_batch, "non_tensor_batch") or []
        mkeys = self._check_keys(meta_info_keys, self.meta_info, "meta_info") or []
        batch = None
        if bkeys:
            popped = [(k, self.batch.pop(k)) for k in bkeys]
            batch = new_tensordict(dict(popped), batch_size=self.batch.batch_size, device=self.batch.device)
        nt = {k: self.non_tensor_batch.pop(k) for k in nkeys}
        meta = {k: self.meta_info.pop(k) for k in mkeys}
        return type(self)(batch=batch, non_tensor_batch=nt, meta_info=meta)

    def rename(
        self, old_keys: str | Sequence[str] | None = None, new_keys: str | Sequence[str] | None = None
    ) -> DataProto:
        """Rename top-level tensor or non-tensor keys in place (verl's semantics); returns self."""

        def _keys(keys: Any, what: str) -> list[str]:
            if isinstance(keys, str):
                return [keys]
            if isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
                return list(keys)
            raise DataProtoError(f"rename: {what} must be a str or a list of str, got {keys!r}")

        old, new = _keys(old_keys, "old_keys"), _keys(new_keys, "new_keys")
        if len(old) != len(new):
            raise DataProtoError(f"rename: {len(old)} old keys but {len(new)} new keys")
        tkeys = list(self.batch.keys()) if self.batch is not None else []
        mapping = dict(zip(old, new))
        for o in old:
            if o not in tkeys and o not in self.non_tensor_batch:
                raise DataProtoError(f"rename: key {o!r} not found")
        for keys in (tkeys, list(self.non_tensor_batch)):
            renamed = [mapping.get(k, k) for k in keys]
            dup = {k for k in renamed if renamed.count(k) > 1}
            if dup:
                raise DataProtoError(f"rename: keys {sorted(dup)} would exist twice")
        if self.batch is not None:
            items = {mapping.get(k, k): v for k, v in self.batch.items()}
            self.batch = new_tensordict(items, batch_size=self.batch.batch_size, device=self.batch.device)
        self.non_tensor_batch = {mapping.get(k, k): v for k, v in self.non_tensor_batch.items()}
        return self

    # --- row transforms ------------------------------------------------------------------------

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row ``repeat_times`` times: ``aabb`` (interleave) or ``abab``.  A copy."""
        r = validate.non_negative_int(repeat_times, "repeat_times", DataProtoError)

        def _t(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == 0:
                return t.new_empty((t.shape[0] * r, *t.shape[1:]))
            if interleave:
                return t.repeat_interleave(r, dim=0)
            return t.repeat(r, *([1] * (t.dim() - 1)))

        def _a(v: np.ndarray) -> np.ndarray:
            if v.size == 0:
                return np.empty((v.shape[0] * r, *v.shape[1:]), dtype=v.dtype)
            return np.repeat(v, r, axis=0) if interleave else np.tile(v, (r,) + (1,) * (v.ndim - 1))

        return self._derive(_t, _a, len(self) * r)

    def sample_level_repeat(self, repeat_times: Any) -> DataProto:
        """Row ``i`` repeated ``repeat_times[i]`` times, in order (verl's name)."""
        counts = np.asarray(repeat_times.cpu() if isinstance(repeat_times, torch.Tensor) else repeat_times)
        if counts.shape != (len(self),) or (counts.size and (counts.dtype.kind not in "iu" or counts.min() < 0)):
            raise DataProtoError(f"repeat_times must be {len(self)} non-negative integers, got {counts!r}")
        return self.select_idxs(np.repeat(np.arange(len(self)), counts))

    def reorder(self, indices: Any) -> None:
        """Reorder rows in place (verl's semantics); ``data[indices]`` returns a new batch."""
        reordered = self.select_idxs(indices)
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def to(self, device: str | torch.device) -> DataProto:
        """A new DataProto with its tensors on ``device`` (verl moved ``self``)."""
        if self.batch is None:
            return copy.copy(self)
        batch = self.batch.to(device)
        batch = batch.copy() if batch is self.batch else batch
        meta = columns.copy_meta(self.meta_info)
        return type(self)(batch=batch, non_tensor_batch=dict(self.non_tensor_batch), meta_info=meta)

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int,
        seed: int | None = None,
        dataloader_kwargs: Mapping[str, Any] | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches over ``epochs`` passes; ``dataloader_kwargs={"shuffle": True}`` shuffles."""
        mini_batch_size = validate.positive_int(mini_batch_size, "mini_batch_size", DataProtoError)
        if len(self) % mini_batch_size:
            raise DataProtoError(f"{len(self)} rows do not divide into mini batches of {mini_batch_size}")
        shuffle = bool((dataloader_kwargs or {}).get("shuffle", False))
        gen = torch.Generator()
        if seed is not None:
            gen.manual_seed(seed)

        def _iter() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(len(self), generator=gen) if shuffle else torch.arange(len(self))
                for s in range(0, len(self), mini_batch_size):
                    yield self.select_idxs(order[s : s + mini_batch_size])

        return _iter()

    def fold_batch_dim(self, new_batch_size: int) -> DataProto:
        """``[bsz, ...]`` -> ``[new_bsz, bsz // new_bsz, ...]`` for every tensor and column (views)."""
        new = validate.positive_int(new_batch_size, "new_batch_size", DataProtoError)
        if len(self) % new:
            raise DataProtoError(f"fold_batch_dim: {len(self)} rows do not divide into {new}")
        k = len(self) // new
        return self._derive(lambda t: t.reshape(new, k, *t.shape[1:]), lambda v: v.reshape(new, k, *v.shape[1:]), new)

    def unfold_batch_dim(self, batch_dims: int = 2) -> DataProto:
        """Merge the first ``batch_dims`` dimensions of every tensor and column into the batch."""
        bd = validate.positive_int(batch_dims, "batch_dims", DataProtoError)
        shapes = [(k, tuple(t.shape)) for k, t in columns.flat_tensors(self.batch)] if self.batch is not None else []
        shapes += [(k, v.shape) for k, v in self.non_tensor_batch.items()]
        lead = None
        for key, shape in shapes:
            if len(shape) < bd or (lead is not None and shape[:bd] != lead):
                raise DataProtoError(
                    f"unfold_batch_dim: key {key!r} has shape {shape}; expected {bd} leading dims {lead or ''}".rstrip()
                )
            lead = shape[:bd]
        if lead is None:
            return copy.copy(self)
        n = math.prod(lead)
        return self._derive(lambda t: t.reshape(n, *t.shape[bd:]), lambda v: v.reshape(n, *v.shape[bd:]), n)

    # --- padding -------------------------------------------------------------------------------

    def pad_to_divisor(self, size_divisor: int) -> tuple[DataProto, int]:
        """Pad rows until ``len`` divides by ``size_divisor``; returns ``(new DataProto, pad_size)``.

        Pad rows repeat the batch from its start (cycling when the batch is shorter than the pad),
        as verl's ``pad_dataproto_to_divisor`` does.  ``self`` is never modified; with nothing to
        pad the result is a new DataProto sharing ``self``'s tensors.
        """
        divisor = validate.positive_int(size_divisor, "size_divisor", DataProtoError)
        length = len(self)
        pad_size = -length % divisor
        if pad_size == 0:
            if length == 0:
                logger.debug("padding a DataProto with no rows: nothing to do")
            return copy.copy(self), 0
        index = np.concatenate([np.arange(length), np.arange(pad_size) % length])
        return self.select_idxs(index), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """A new DataProto without the last ``pad_size`` rows (views)."""
        pad_size = validate.int_in_range(pad_size, "pad_size", 0, len(self), DataProtoError)
        return self.slice(0, len(self) - pad_size)

    # --- files ---------------------------------------------------------------------------------

    def save_to_disk(self, filepath: str | os.PathLike[str]) -> None:
        """Write to a plain file (pickle protocol 5, tensors as raw buffers)."""
        serialization.dump_to_file(self, filepath)

    @staticmethod
    def load_from_disk(filepath: str | os.PathLike[str]) -> DataProto:
        """Read what :meth:`save_to_disk` wrote."""
        obj = serialization.load_from_file(filepath)
        if not isinstance(obj, DataProto):
            raise DataProtoError(f"{filepath}: holds a {type(obj).__name__}, not a DataProto")
        return obj


def _rebuild_dataproto(cls: type, batch_state: tuple | None, arrays: list, meta_info: dict) -> DataProto:
    """Unpickling side of :meth:`DataProto.__reduce_ex__`."""
    batch = None
    if batch_state is not None:
        length, device, tensors = batch_state
        items = [(k, serialization.rebuild_tensor(s)) for k, s in tensors]
        if device is not None and any(str(t.device) != device for _, t in items):
            device = None  # a device this process lacks: the tensors stayed on the CPU
        batch = columns.build_td(items, length, device)
    nt = {k: serialization.rebuild_ndarray(s) for k, s in arrays}
    return cls(batch=batch, non_tensor_batch=nt, meta_info=meta_info)
