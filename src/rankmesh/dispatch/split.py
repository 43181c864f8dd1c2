"""Cutting a call's arguments into pieces, and joining the collected outputs back.

:func:`split_call` checks the arguments against a spec and returns one (args, kwargs) per piece;
it pads batches when allowed (on new objects: the caller's batch is never touched) and remembers
the pad so :func:`join_outputs` / :func:`output_future` hand the caller exactly its rows back.
Every failure is a :class:`DispatchError` naming the method, the argument and the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from rankmesh.data import DataProto, DataProtoConfig, DataProtoFuture, auto_padding_enabled
from rankmesh.data.columns import chunk_bounds
from rankmesh.data.tensordicts import is_tensordict
from rankmesh.dispatch.spec import MeshSpec
from rankmesh.errors import DispatchError, PaddingError

if TYPE_CHECKING:
    from tensordict import TensorDictBase

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


@dataclass(frozen=True)
class CallSite:
    """Names used in error messages: the method, its parameter names (after ``self``), the mode."""

    method: str
    params: tuple[str, ...]
    mode: str

    def arg(self, key: int | str) -> str:
        if isinstance(key, str):
            return f"argument {key!r}"
        name = self.params[key] if key < len(self.params) else None
        return f"argument {name!r} (position {key})" if name else f"positional argument {key}"

    def error(self, message: str) -> DispatchError:
        return DispatchError(f"{self.method} (mode {self.mode}): {message}")


@dataclass(frozen=True)
class SplitCall:
    """The per-piece arguments of one call.

    ``broadcast``: every rank receives ``pieces[0]`` (replicated arguments).  ``rows``: rows of
    the caller's batch (``None`` without batch arguments or when unknown); ``pad``: pad rows
    appended before splitting; ``piece_rows``: rows of each piece after padding;
    ``tensordicts``: the batches were TensorDicts (outputs join as a TensorDict, not a DataProto);
    ``auto_padding``: a batch asked for verl's auto-padding (its meta flag, or a future computed
    from such a batch), which the call's output future carries on.
    """

    pieces: tuple[tuple[Args, Kwargs], ...]
    broadcast: bool
    rows: int | None = None
    pad: int = 0
    piece_rows: int | None = None
    tensordicts: bool = False
    auto_padding: bool = False


def _items(args: Args, kwargs: Kwargs) -> list[tuple[int | str, Any]]:
    return [*enumerate(args), *kwargs.items()]


def _rebuild(values: Sequence[Any], n_args: int, keys: Sequence[str]) -> tuple[Args, Kwargs]:
    return tuple(values[:n_args]), dict(zip(keys, values[n_args:]))


def split_call(spec: MeshSpec, n_pieces: int, args: Args, kwargs: Kwargs, site: CallSite, padding: bool | None) -> SplitCall:
    """Check and cut ``args``/``kwargs`` into ``n_pieces`` pieces as ``spec`` says."""
    if not spec.split:
        return SplitCall(((args, kwargs),), broadcast=True)
    if spec.proto:
        return _split_proto(spec, n_pieces, args, kwargs, site, padding)
    return _split_lists(spec, n_pieces, args, kwargs, site)


def _split_lists(spec: MeshSpec, n: int, args: Args, kwargs: Kwargs, site: CallSite) -> SplitCall:
    items = _items(args, kwargs)
    if spec.broadcast_fallback:
        if not all(isinstance(v, list) and len(v) == n for _, v in items):
            return SplitCall(((args, kwargs),), broadcast=True)
    for key, value in items:
        if not isinstance(value, (list, tuple)):
            raise site.error(f"{site.arg(key)} is a {type(value).__name__}; this mode needs a list with one item per piece ({n} items)")
        if len(value) != n:
            raise site.error(f"{site.arg(key)} has {len(value)} items; this mode needs exactly {n} (one per piece)")
    keys = list(kwargs)
    pieces = tuple(_rebuild([v[i] for _, v in items], len(args), keys) for i in range(n))
    return SplitCall(pieces, broadcast=False)


def _split_proto(spec: MeshSpec, n: int, args: Args, kwargs: Kwargs, site: CallSite, padding: bool | None) -> SplitCall:
    func: tuple[Any, ...] = ()
    if spec.with_func:
        if not args or not callable(args[0]):
            got = type(args[0]).__name__ if args else "nothing"
            raise site.error(f"the first positional argument must be a function sent to every rank, got {got}")
        func, args = (args[0],), args[1:]
    items = _items(args, kwargs)

    def label(key: int | str) -> str:
        return site.arg(key + len(func) if isinstance(key, int) else key)

    for key, value in items:
        if not (isinstance(value, (DataProto, DataProtoFuture)) or is_tensordict(value)):
            raise site.error(
                f"{label(key)} is a {type(value).__name__}; this mode splits every argument by rows and "
                f"needs a DataProto, a DataProtoFuture or a TensorDict"
            )
        if is_tensordict(value) and len(value.batch_size) < 1:
            raise site.error(f"{label(key)} is a TensorDict without a batch dimension; give it batch_size=[rows]")
    known = {key: _rows(v) for key, v in items if not (isinstance(v, DataProtoFuture) and not v.rows_known)}
    if len(set(known.values())) > 1:
        listed = ", ".join(f"{label(k)}: {r}" for k, r in known.items())
        raise site.error(f"batches of one call must have the same number of rows, got {listed}")
    rows = next(iter(known.values()), None)
    pad = 0
    if rows is not None and rows % n:
        if not _padding_enabled(spec, padding, [v for _, v in items]):
            raise PaddingError(
                f"{site.method} (mode {site.mode}): a batch of {rows} rows does not divide into {n} pieces; "
                f"enable padding (@register(..., padding=True), meta_info['_verl_auto_padding'] = True or "
                f"DataProtoConfig.auto_padding = True) or pass a multiple of {n} rows"
            )
        pad = -rows % n
        unknown = [k for k, v in items if isinstance(v, DataProtoFuture) and not v.rows_known]
        if unknown:
            raise site.error(f"cannot pad {label(unknown[0])}: a DataProtoFuture of unknown row count")
    chunked = []
    for key, value in items:
        if is_tensordict(value):
            chunked.append(_chunk_tensordict(value, n, pad))
            continue
        if pad:
            value = value.pad_to_divisor(n)[0]  # DataProto and DataProtoFuture alike
        try:
            chunked.append(value.chunk(n))
        except Exception as exc:  # e.g. a future of unknown rows that later proves uneven
            raise site.error(f"cannot split {label(key)} into {n} pieces: {exc}") from exc
    keys = list(kwargs)
    pieces = tuple(_rebuild([*func, *(c[i] for c in chunked)], len(func) + len(args), keys) for i in range(n))
    piece_rows = None if rows is None else (rows + pad) // n
    tensordicts = any(is_tensordict(v) for _, v in items)
    return SplitCall(pieces, broadcast=False, rows=rows, pad=pad, piece_rows=piece_rows, tensordicts=tensordicts,
                     auto_padding=_asks_padding([v for _, v in items]))


def _rows(value: Any) -> int:
    return int(value.batch_size[0]) if is_tensordict(value) else len(value)


def _chunk_tensordict(td: TensorDictBase, n: int, pad: int) -> list[TensorDictBase]:
    """``n`` row pieces of a TensorDict (views), padded first with rows repeated from its start."""
    rows = int(td.batch_size[0])
    if pad:
        td = td[torch.from_numpy(np.concatenate([np.arange(rows), np.arange(pad) % rows]))]
    return [td[start:stop] for start, stop in chunk_bounds(rows + pad, n)]


def _padding_enabled(spec: MeshSpec, padding: bool | None, batches: Sequence[Any]) -> bool:
    """The one padding rule (verl 0.9.1's, with futures treated as the batches they will be).

    ``@register(padding=True/False)`` decides for its method; otherwise a mode that pads, verl's
    global ``DataProtoConfig.auto_padding``, or a batch that asks (``_asks_padding``) turns it on.
    """
    if padding is not None:
        return padding
    if spec.padding or DataProtoConfig.auto_padding:
        return True
    return _asks_padding(batches)


def _asks_padding(batches: Sequence[Any]) -> bool:
    """A batch with ``meta_info['_verl_auto_padding']``, or a future computed from one."""
    return any((isinstance(b, DataProto) and auto_padding_enabled(b)) or (isinstance(b, DataProtoFuture) and b.auto_padding)
               for b in batches)


def _drop_pad(data: DataProto, split: SplitCall, site: CallSite) -> DataProto:
    """Remove the pad rows' outputs: ``pad * k`` rows at the end, ``k`` outputs per input row."""
    if not split.pad:
        return data
    padded = split.rows + split.pad  # type: ignore[operator]
    if len(data) % padded:
        raise site.error(
            f"cannot drop the {split.pad} pad rows: the outputs have {len(data)} rows for {padded} padded "
            f"input rows (padding needs a whole number of output rows per input row)"
        )
    return data.unpad(split.pad * (len(data) // padded))


def join_outputs(spec: MeshSpec, split: SplitCall, outputs: Sequence[Any], ranks: Sequence[int], site: CallSite) -> Any:
    """Turn the collected ranks' outputs (in plan order) into what the caller gets."""
    if spec.output == "single":
        return outputs[0]
    if spec.output == "list":
        return list(outputs)
    if all(o is None for o in outputs):
        return None
    if all(is_tensordict(o) for o in outputs):  # TensorDict in, TensorDict out
        joined = torch.cat(list(outputs), dim=0)
        if split.pad:
            padded = split.rows + split.pad  # type: ignore[operator]
            joined = joined[: int(joined.batch_size[0]) - split.pad * (int(joined.batch_size[0]) // padded)]
        return joined
    for rank, out in zip(ranks, outputs):
        if not isinstance(out, DataProto):
            raise site.error(f"rank {rank} returned a {type(out).__name__}; this mode concatenates DataProto outputs")
    # type(...).concat: a DataProto subclass (e.g. rankmesh.compat.verl's) joins with its own rules.
    return _drop_pad(type(outputs[0]).concat(list(outputs)), split, site)


def output_future(split: SplitCall, handles: Sequence[Any], fetch: Any) -> DataProtoFuture:
    """The future a non-blocking concat call returns: collected parts, pad rows excluded.

    Each part is announced with its piece's row count (a non-blocking method must return as many
    rows as it received); the future checks that when it fetches.
    """
    if split.piece_rows is None:
        return DataProtoFuture.from_parts(list(handles), fetch, auto_padding=split.auto_padding)
    rows = [split.piece_rows] * len(handles)
    return DataProtoFuture.from_parts(list(handles), fetch, rows=rows, pad_size=split.pad, auto_padding=split.auto_padding)


__all__ = ["CallSite", "SplitCall", "join_outputs", "output_future", "split_call"]
