"""DataProtoFuture: the result of a non-blocking worker-group call, not yet fetched.

Backend-neutral (this module knows no Ray): a future holds an ordered list of *parts* (an opaque
handle, e.g. a Ray ObjectRef, plus the part's row count when known), a ``fetch`` callable turning
a list of handles into DataProtos (the backend's fetch; :func:`identity_fetch` in process) and a
selection of rows over the concatenation of the parts.  The selection already excludes the pad
rows a dispatch added.

Why rows and not just handles: ``chunk`` and ``slice_rows`` narrow the selection without
fetching anything, and keep only the parts they overlap.  Handing a future to another worker
group therefore routes each rank exactly the pieces it needs, instead of every rank fetching
every part and cutting its share afterwards (verl's ``DataProtoFuture.chunk``).

When row counts are unknown (a worker returned a number of rows nobody predicted), narrowing
can't be planned; ``chunk``/``slice_rows``/``unpad`` are then recorded (as :data:`Deferred`
values) and applied after fetching all parts, which is what verl does in every case.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

from rankmesh import validate
from rankmesh.data import columns
from rankmesh.data.config import DataProtoConfig
from rankmesh.data.proto import DataProto
from rankmesh.errors import DataProtoError, PaddingError

Fetch = Callable[[list[Any]], list[DataProto]]
Segment = tuple[int, int]


def identity_fetch(handles: list[Any]) -> list[DataProto]:
    """Fetch for the in-process backend: the handles are the DataProtos themselves."""
    return list(handles)


def fetch_futures(futures: list[DataProtoFuture]) -> list[DataProto]:
    """Fetch for parts that are futures themselves (concat of futures with unknown rows)."""
    return [f.get() for f in futures]


@dataclass(frozen=True)
class FuturePart:
    """One fetchable piece: a backend handle and its row count (None when unknown)."""

    handle: Any
    rows: int | None = None


# --- narrowing recorded while row counts are unknown ----------------------------------------------


@dataclass(frozen=True, slots=True)
class DeferredSlice:
    """Rows ``start:stop`` (Python slice rules), taken after fetching."""

    start: int | None
    stop: int | None

    def apply(self, data: DataProto) -> DataProto:
        return data.slice(self.start, self.stop)


@dataclass(frozen=True, slots=True)
class DeferredChunk:
    """Piece ``index`` of ``chunks``, taken after fetching (uneven lengths need auto padding)."""

    index: int
    chunks: int

    def apply(self, data: DataProto) -> DataProto:
        return data.chunk(self.chunks)[self.index]


@dataclass(frozen=True, slots=True)
class DeferredUnpad:
    """The last ``pad_size`` rows dropped after fetching."""

    pad_size: int

    def apply(self, data: DataProto) -> DataProto:
        return data.unpad(self.pad_size)


Deferred = Union[DeferredSlice, DeferredChunk, DeferredUnpad]


# --- row bookkeeping ---------------------------------------------------------------------------


def _offsets(parts: Sequence[FuturePart]) -> list[int]:
    return [0, *itertools.accumulate(p.rows for p in parts)]


def _pieces(parts: Sequence[FuturePart], segments: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """Split absolute row segments at part boundaries: ``(part index, local start, local stop)``."""
    offs = _offsets(parts)
    out = []
    for a, b in segments:
        for i, p in enumerate(parts):
            lo, hi = max(a, offs[i]), min(b, offs[i + 1])
            if lo < hi:
                out.append((i, lo - offs[i], hi - offs[i]))
    return out


def _sub_segments(segments: Sequence[Segment], start: int, stop: int) -> list[Segment]:
    """Absolute segments covering logical rows ``start:stop`` of a selection."""
    out, pos = [], 0
    for a, b in segments:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def _normalize(
    parts: Sequence[FuturePart], segments: Sequence[Segment], schema_part: FuturePart | None
) -> tuple[tuple[FuturePart, ...], tuple[Segment, ...]]:
    """Keep only the parts the segments touch (deduplicated by handle identity), re-offset.

    An empty selection keeps ``schema_part`` so ``get`` can still return the right keys.
    """
    pieces = _pieces(parts, segments)
    kept: list[FuturePart] = []
    slot: dict[int, int] = {}
    for i, _, _ in pieces:
        if i not in slot:
            same = next((j for j, q in enumerate(kept) if q.handle is parts[i].handle), None)
            slot[i] = same if same is not None else len(kept)
            if same is None:
                kept.append(parts[i])
    if not kept:
        return ((schema_part,) if schema_part is not None else ()), ()
    offs = _offsets(kept)
    merged: list[Segment] = []
    for i, s, e in pieces:
        a, b = offs[slot[i]] + s, offs[slot[i]] + e
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return tuple(kept), tuple(merged)


@dataclass(frozen=True, eq=False)
class DataProtoFuture:
    """A DataProto still held by workers; picklable when its handles and ``fetch`` are.

    ``segments`` are row ranges over the concatenation of ``parts`` (None: row counts unknown,
    everything is selected and ``deferred`` operations run after fetching).  ``auto_padding``:
    the future was computed from a batch with verl's ``meta_info['_verl_auto_padding']``, so a
    call it is passed to pads it as it would pad that batch (the flag on the batch it will fetch
    is not visible before fetching).
    """

    parts: tuple[FuturePart, ...]
    fetch: Fetch
    segments: tuple[Segment, ...] | None = None
    deferred: tuple[Deferred, ...] = ()
    auto_padding: bool = False

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_parts(
        cls,
        handles: Sequence[Any],
        fetch: Fetch,
        rows: Sequence[int] | None = None,
        pad_size: int = 0,
        auto_padding: bool = False,
    ) -> DataProtoFuture:
        """A future over ``handles`` (in order) whose last ``pad_size`` rows are padding."""
        handles = list(handles)
        if rows is None:
            fut = cls(tuple(FuturePart(h) for h in handles), fetch, auto_padding=auto_padding)
            return fut.unpad(pad_size) if pad_size else fut
        rows = [validate.non_negative_int(r, f"rows[{i}]", DataProtoError) for i, r in enumerate(rows)]
        if len(rows) != len(handles):
            raise DataProtoError(f"rows {rows} must be {len(handles)} non-negative counts, one per handle")
        total = sum(rows)
        pad_size = validate.int_in_range(pad_size, "pad_size", 0, total, DataProtoError)
        parts = tuple(FuturePart(h, r) for h, r in zip(handles, rows))
        return cls._select(parts, [(0, total - pad_size)], fetch, auto_padding)

    @classmethod
    def _select(
        cls, parts: Sequence[FuturePart], segments: Sequence[Segment], fetch: Fetch, auto_padding: bool = False
    ) -> DataProtoFuture:
        kept, segs = _normalize(parts, segments, parts[0] if parts else None)
        return cls(kept, fetch, segs, auto_padding=auto_padding)

    @staticmethod
    def concat(data: Sequence[Any], fetch: Fetch | None = None) -> DataProtoFuture:
        """Concatenate futures; or, verl's spelling, build one from raw handles (ObjectRefs).

        Futures that share ``fetch`` and know their rows are merged flat (one fetch call for
        all); otherwise each becomes a part of a nesting future.  Raw handles need ``fetch``,
        the backend's way to turn them into DataProtos (this module knows no backend).
        """
        items = list(data)
        futures = [x for x in items if isinstance(x, DataProtoFuture)]
        if not futures and items:
            if fetch is None:
                raise DataProtoError(
                    f"DataProtoFuture.concat got {len(items)} raw handle(s) ({type(items[0]).__name__}) and no fetch; "
                    f"pass fetch=..., the backend's fetch for those handles (e.g. the Ray backend's fetch for "
                    f"ObjectRefs), or concat DataProtoFutures instead"
                )
            return DataProtoFuture.from_parts(items, fetch)
        if len(futures) != len(items):
            raise DataProtoError("concat: mix of DataProtoFutures and raw handles")
        if not items:
            return DataProtoFuture((), fetch or identity_fetch, ())
        first = futures[0].fetch
        padded = any(f.auto_padding for f in futures)  # as DataProto.concat merges the meta flag
        if all(f.rows_known and f.fetch == first for f in futures):
            parts: list[FuturePart] = []
            segments: list[Segment] = []
            for f in futures:
                base = sum(p.rows for p in parts)
                parts.extend(f.parts)
                segments.extend((a + base, b + base) for a, b in f.segments)
            return DataProtoFuture._select(parts, segments, first, padded)
        nested = tuple(FuturePart(f, f.num_rows) for f in futures)
        if all(p.rows is not None for p in nested):
            return DataProtoFuture._select(nested, [(0, sum(p.rows for p in nested))], fetch_futures, padded)
        return DataProtoFuture(nested, fetch_futures, auto_padding=padded)

    # --- shape -----------------------------------------------------------------------------------

    @property
    def rows_known(self) -> bool:
        """Whether the row count (and so chunk planning) is known without fetching."""
        return self.segments is not None

    @property
    def num_rows(self) -> int | None:
        """Rows ``get()`` will return, or None when unknown before fetching."""
        return None if self.segments is None else sum(b - a for a, b in self.segments)

    @property
    def handles(self) -> list[Any]:
        """The handles this future would fetch (at most; empty selections fetch one)."""
        return [p.handle for p in self.parts]

    def __len__(self) -> int:
        if self.segments is None:
            raise DataProtoError("the row count of this DataProtoFuture is unknown until it is fetched")
        return self.num_rows

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        rows = self.num_rows if self.rows_known else "unknown"
        return f"DataProtoFuture(rows={rows}, parts={len(self.parts)}, deferred={list(self.deferred)})"

    # --- narrowing without fetching -----------------------------------------------------------------

    def _defer(self, op: Deferred) -> DataProtoFuture:
        return dataclasses.replace(self, deferred=(*self.deferred, op))

    def slice_rows(self, start: int | None = None, stop: int | None = None) -> DataProtoFuture:
        """Rows ``start:stop`` (Python slice rules, step 1) as a new future; fetches nothing."""
        if self.segments is None:
            return self._defer(DeferredSlice(start, stop))
        start, stop, _ = slice(start, stop).indices(len(self))
        schema = self.parts[0] if self.parts else None
        kept, segs = _normalize(self.parts, _sub_segments(self.segments, start, stop), schema)
        return dataclasses.replace(self, parts=kept, segments=segs)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures over consecutive rows, each holding only the parts it overlaps.

        Like :meth:`DataProto.chunk`: uneven lengths need ``DataProtoConfig.auto_padding`` (the
        per-batch meta flag is not visible before fetching; pad with :meth:`pad_to_divisor`).
        """
        chunks = validate.positive_int(chunks, "chunks", DataProtoError)
        if self.segments is None:
            return [self._defer(DeferredChunk(i, chunks)) for i in range(chunks)]
        length = len(self)
        if length % chunks and not DataProtoConfig.auto_padding:
            raise PaddingError(f"cannot chunk a future of {length} rows into {chunks} equal parts; pad it first")
        return [self.slice_rows(s, e) for s, e in columns.chunk_bounds(length, chunks)]

    def part_futures(self) -> list[DataProtoFuture]:
        """This future's rows as one future per part, in row order; fetches nothing.

        The parts of a call's output are its collect ranks' outputs, one per dp replica, so
        ``rankmesh.wait(fut.part_futures(), num_returns=k)`` hands a controller the rows of the
        first ``k`` replicas to finish without waiting for the slowest.  ``DataProtoFuture.concat``
        of the list is this future again (a part that the selection visits twice, as after
        :meth:`pad_to_divisor`, gives one future per visit).  A future with unknown row counts
        splits only while nothing was narrowed yet (no :data:`Deferred` operation).
        """
        if self.segments is None:
            if self.deferred:
                raise DataProtoError(
                    f"cannot split {self!r} by part: its row counts are unknown and it was narrowed "
                    f"({list(self.deferred)}); get() it, or split it before narrowing"
                )
            return [dataclasses.replace(self, parts=(part,)) for part in self.parts]
        runs: list[tuple[int, list[Segment]]] = []
        for index, start, stop in _pieces(self.parts, self.segments):
            if runs and runs[-1][0] == index:
                runs[-1][1].append((start, stop))
            else:
                runs.append((index, [(start, stop)]))
        return [DataProtoFuture._select((self.parts[i],), segs, self.fetch, self.auto_padding) for i, segs in runs]

    def pad_to_divisor(self, size_divisor: int) -> tuple[DataProtoFuture, int]:
        """Pad with rows repeated from the start (as :meth:`DataProto.pad_to_divisor`); no fetch."""
        divisor = validate.positive_int(size_divisor, "size_divisor", DataProtoError)
        if self.segments is None:
            raise DataProtoError("cannot pad a DataProtoFuture whose row count is unknown; get() it first")
        length = len(self)
        pad_size = -length % divisor
        segments = list(self.segments)
        remaining = pad_size
        while remaining:
            take = min(remaining, length)
            segments += _sub_segments(self.segments, 0, take)
            remaining -= take
        kept, segs = _normalize(self.parts, segments, self.parts[0] if self.parts else None)
        return dataclasses.replace(self, parts=kept, segments=segs), pad_size

    def unpad(self, pad_size: int) -> DataProtoFuture:
        """Drop the last ``pad_size`` rows; fetches nothing."""
        if self.segments is None:
            pad_size = validate.non_negative_int(pad_size, "pad_size", DataProtoError)
            return self._defer(DeferredUnpad(pad_size)) if pad_size else self
        pad_size = validate.int_in_range(pad_size, "pad_size", 0, len(self), DataProtoError)
        return self.slice_rows(0, len(self) - pad_size)

    # --- fetching ----------------------------------------------------------------------------

    def _fetch(self, indices: list[int]) -> dict[int, DataProto]:
        got = self.fetch([self.parts[i].handle for i in indices])
        if len(got) != len(indices):
            raise DataProtoError(f"fetch returned {len(got)} results for {len(indices)} handles")
        out = {}
        for i, d in zip(indices, got):
            if not isinstance(d, DataProto):
                raise DataProtoError(f"part {i} resolved to a {type(d).__name__}, not a DataProto")
            if self.parts[i].rows is not None and len(d) != self.parts[i].rows:
                raise DataProtoError(f"part {i} has {len(d)} rows; {self.parts[i].rows} were announced")
            out[i] = d
        return out

    def get(self) -> DataProto:
        """Fetch the parts the selection overlaps and return the selected rows (no pad rows).

        meta_info is merged over the fetched parts (each counted once).  With an in-process
        ``fetch`` the result may share tensor storage with the producer's DataProtos.
        """
        if self.segments is None:
            fetched = self._fetch(list(range(len(self.parts))))
            got = [fetched[i] for i in range(len(self.parts))]
            if len(got) == 1:  # no copy: new containers over the fetched part, meta merged as usual
                data = got[0].slice()
                data.meta_info = columns.merge_meta_info([got[0].meta_info])
            else:
                data = type(got[0]).concat(got)
            for op in self.deferred:
                data = op.apply(data)
            return data
        pieces = _pieces(self.parts, self.segments)
        if not pieces:
            if not self.parts:
                return DataProto()
            return self._fetch([0])[0].slice(0, 0)
        needed = sorted({i for i, _, _ in pieces})
        fetched = self._fetch(needed)
        meta = columns.merge_meta_info([fetched[i].meta_info for i in needed])
        views = [fetched[i].slice(s, e) for i, s, e in pieces]
        if len(views) == 1:
            views[0].meta_info = meta
            return views[0]
        return DataProto.concat(views, meta_info=meta)

