"""Receive choices per call: turn copy-on-write inputs into private copies, for ``receive="copy"``.

A worker's received tensors start as copy-on-write views of the object store
(:mod:`rankmesh.sharedmem`): nothing is copied until the worker writes, then only the pages it
writes.  That is the cheapest receive for a worker that reads its input (or moves it to a GPU),
and the dearest for one that overwrites all of it: every written 4 KiB page costs a fault and a
page copy, ~3-4x one ``memcpy`` into fresh memory.  A method (``@register(..., receive="copy")``)
or a group (``wg.set_receive("copy")``) that declares ``"copy"`` gets :func:`own_copies` run on
its arguments before the method starts: every tensor and array that lies in a copy-on-write
view is re-pointed at one private copy, read from the object store's own mapping (what the
hand-written floor does when its workers copy before writing).  Other values are untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rankmesh import sharedmem
from rankmesh.data.proto import DataProto
from rankmesh.serialization import COPY_DECLARED


def own_copies(value: Any) -> Any:
    """``value`` with every tensor/array in a copy-on-write view replaced by a private copy.

    Tensors are changed in place (``Tensor.set_``: the same tensor objects, now on private
    storage), so TensorDicts, views and aliases stay consistent; numpy arrays inside dicts and
    lists are replaced in their containers.  Returns ``value`` (a new object only for a bare
    numpy array).
    """
    return _walk(value, {})


def _walk(value: Any, done: dict[int, torch.UntypedStorage]) -> Any:
    if isinstance(value, torch.Tensor):
        _own_tensor(value, done)
        return value
    if isinstance(value, np.ndarray):
        return _own_array(value)
    if isinstance(value, DataProto):
        if value.batch is not None:
            for t in value.batch.values(include_nested=True, leaves_only=True):
                _walk(t, done)
        for key, arr in list(value.non_tensor_batch.items()):
            value.non_tensor_batch[key] = _walk(arr, done)
        return value
    if isinstance(value, dict):
        for key, item in list(value.items()):
            value[key] = _walk(item, done)
        return value
    if isinstance(value, list):
        value[:] = [_walk(item, done) for item in value]
        return value
    if isinstance(value, tuple):
        for item in value:
            _walk(item, done)  # tensors inside change in place; arrays in tuples stay views
        return value
    return value


def _own_tensor(t: torch.Tensor, done: dict[int, torch.UntypedStorage]) -> None:
    if t.device.type != "cpu" or t.is_sparse:
        return
    storage = t.untyped_storage()
    ptr, size = storage.data_ptr(), storage.nbytes()
    if size == 0:
        return
    private = done.get(ptr)
    if private is None:
        src = sharedmem.original_bytes(ptr, size)
        if src is None:
            return
        copy = src.copy()
        sharedmem.note_copy(size, COPY_DECLARED)
        private = done[ptr] = torch.from_numpy(copy).untyped_storage()
    with torch.no_grad():
        t.set_(private, t.storage_offset(), t.size(), t.stride())


def _own_array(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.hasobject or arr.nbytes == 0:
        return arr
    src = sharedmem.original_bytes(arr.ctypes.data, arr.nbytes) if arr.flags.c_contiguous else None
    if src is None:
        return arr
    sharedmem.note_copy(arr.nbytes, COPY_DECLARED)
    return src.copy().view(arr.dtype).reshape(arr.shape)
