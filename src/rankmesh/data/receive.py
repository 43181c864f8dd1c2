"""Receive choices per call: private copies of copy-on-write inputs (``receive="copy"``), or page-locking them for a faster host→device copy.

A worker's received tensors start as copy-on-write views of the object store
(:mod:`rankmesh.sharedmem`): nothing is copied until the worker writes, then only the pages it
writes.  That is the cheapest receive for a worker that reads its input (or moves it to a GPU),
and the dearest for one that overwrites all of it: every written 4 KiB page costs a fault and a
page copy, ~3-4x one ``memcpy`` into fresh memory.  A method (``@register(..., receive="copy")``)
or a group (``wg.set_receive("copy")``) that declares ``"copy"`` gets :func:`own_copies` run on
its arguments before the method starts: every tensor and array that lies in a copy-on-write
view is re-pointed at one private copy, read from the object store's own mapping (what the
hand-written floor does when its workers copy before writing).  Other values are untouched.

Pinned receive (:func:`to_device`, :func:`pinned`): a host→device copy from pageable memory
goes through CUDA's bounce buffer at a fraction of the rate of a copy from page-locked memory
(one H200: 128 MiB in 27 ms pageable, 2.7 ms page-locked).  So the received bytes are
page-locked for the copy, read-only (``cudaHostRegister`` with ``cudaHostRegisterReadOnly``),
and unregistered right after.  *Which* pages matters: registering the copy-on-write view itself
breaks copy-on-write, because Linux unshares private file pages on a long-term pin even a
read-only one (measured: every page of the view became private, and registering 128 MiB took
78 ms).  The view's own bytes are the object store's, in the store's **shared** mapping
(:func:`rankmesh.sharedmem.original_bytes`), where a pin unshares nothing: for the copy, each
tensor is pointed at those shared bytes (``Tensor.set_``, as :func:`own_copies` does), the
pages are registered, the copy runs, and the tensors are pointed back (128 MiB: 5.3 ms to
register, 2.7 ms to copy, 1.0 ms to unregister: 9 ms against 27 ms, no page made private).
Only tensors in an unwritten copy-on-write view are pinned; the rest move as before.  Without
CUDA, for a CPU target, or when the driver refuses, nothing is registered and the copy is the
plain one; :class:`Pinning` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from rankmesh import sharedmem
from rankmesh.data.proto import DataProto
from rankmesh.serialization import COPY_DECLARED

logger = logging.getLogger(__name__)

#: ``cudaHostRegisterReadOnly``: the pages are pinned without write access, so a copy-on-write
#: mapping stays shared (the device may only read them).
CUDA_HOST_REGISTER_READ_ONLY = 8

#: cudaHostRegister's unit: a range is widened to whole pages.
PAGE_SIZE = mmap.PAGESIZE


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


# ----- pinned receive ------------------------------------------------------------------------------


def page_spans(spans: Iterable[tuple[int, int]], page: int = PAGE_SIZE) -> list[tuple[int, int]]:
    """``(start, nbytes)`` ranges of whole pages covering every ``(address, nbytes)`` span, sorted.

    cudaHostRegister pins whole pages, and registering a page twice fails
    (``cudaErrorHostMemoryAlreadyRegistered``), so spans sharing a page, or on adjacent pages,
    become one range.  Empty spans are dropped.  Pure.
    """
    if isinstance(page, bool) or not isinstance(page, int) or page <= 0 or page & (page - 1):
        raise ValueError(f"page_spans(page={page!r}): a page size is a positive power of two")
    out: list[list[int]] = []
    for addr, nbytes in sorted((int(a), int(n)) for a, n in spans if int(n) > 0):
        lo, hi = addr & ~(page - 1), (addr + nbytes + page - 1) & ~(page - 1)
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]


@dataclass(frozen=True)
class Pinning:
    """What :func:`pinned` did: ``ranges`` page-locked (``nbytes`` in all, ``register_s`` seconds to
    register) for ``tensors`` tensors, or ``why_not`` (nothing registered: a plain pageable copy)."""

    ranges: tuple[tuple[int, int], ...] = ()
    nbytes: int = 0
    register_s: float = 0.0
    tensors: int = 0
    why_not: str | None = None

    @property
    def pinned(self) -> bool:
        return bool(self.ranges)


def host_tensors(value: Any) -> list[torch.Tensor]:
    """The CPU tensors of a DataProto (its batch), a tensor, or a dict/list/tuple of them."""
    if isinstance(value, torch.Tensor):
        return [value] if value.device.type == "cpu" and not value.is_sparse else []
    if isinstance(value, DataProto):
        if value.batch is None:
            return []
        return host_tensors(list(value.batch.values(include_nested=True, leaves_only=True)))
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in host_tensors(item)]
    return []


def shared_originals(tensors: Iterable[torch.Tensor]) -> dict[int, np.ndarray]:
    """Storage address -> the object store's shared bytes behind it, for each storage of ``tensors``
    that lies in an unwritten copy-on-write view (a written page lives in the view alone)."""
    out: dict[int, np.ndarray] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in out:
            continue
        src = sharedmem.original_bytes(ptr, size)
        if src is not None and sharedmem.written_pages(ptr, size) == 0:
            out[ptr] = src
    return out


@contextlib.contextmanager
def reading_shared(tensors: Iterable[torch.Tensor], originals: dict[int, np.ndarray]) -> Iterator[int]:
    """While the block runs, each of ``tensors`` whose storage is a key of ``originals`` reads
    from those shared bytes instead (same offset, shape and strides; read-only: only copy from
    them); afterwards each points at its own storage again.  Yields how many were re-pointed."""
    moved = []
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", UserWarning)  # torch warns that the shared bytes are read-only
            shared = {ptr: torch.from_numpy(src).untyped_storage() for ptr, src in originals.items()}
            for t in tensors:
                own = t.untyped_storage()
                if own.data_ptr() in shared:
                    moved.append((t, own, t.storage_offset(), t.size(), t.stride()))
                    t.set_(shared[own.data_ptr()], t.storage_offset(), t.size(), t.stride())
        yield len(moved)
    finally:
        with torch.no_grad():
            for t, own, offset, size, stride in moved:
                t.set_(own, offset, size, stride)


@contextlib.contextmanager
def pinned(value: Any, device: str | torch.device) -> Iterator[Pinning]:
    """While the block runs, ``value``'s CPU tensors that lie in unwritten copy-on-write views read
    from the object store's shared pages, page-locked read-only, for fast copies to ``device``.

    Nothing is registered unless ``device`` is a CUDA device, CUDA works here, and some tensor
    lies in such a view; a refusal of the driver unregisters what was registered (and clears
    CUDA's error state).  The block must finish its copies (e.g. ``torch.cuda.synchronize``)
    before it ends: then the tensors are pointed back at their views and the pages unregistered.
    No byte is copied on the host and no page of a view is written.
    """
    device = torch.device(device)
    if device.type != "cuda":
        yield Pinning(why_not=f"the target is {device}, not a CUDA device")
        return
    if not torch.cuda.is_available():
        yield Pinning(why_not="CUDA is not available in this process")
        return
    tensors = host_tensors(value)
    originals = shared_originals(tensors)
    if not originals:
        yield Pinning(why_not="no tensor lies in an unwritten copy-on-write view of the object store")
        return
    cudart = torch.cuda.cudart()
    done: list[tuple[int, int]] = []
    why = None
    t0 = time.perf_counter()
    for start, nbytes in page_spans((src.ctypes.data, src.nbytes) for src in originals.values()):
        err = cudart.cudaHostRegister(start, nbytes, CUDA_HOST_REGISTER_READ_ONLY)
        if int(err) != 0:
            why = f"cudaHostRegister({nbytes} bytes, read-only) failed: {_cuda_error(cudart, err)}"
            _clear_cuda_error()
            break
        done.append((start, nbytes))
    elapsed = time.perf_counter() - t0
    try:
        if why is not None:
            logger.debug("pinned receive falls back to pageable memory: %s", why)
            yield Pinning(why_not=why)
            return
        with reading_shared(tensors, originals) as count:
            yield Pinning(tuple(done), sum(size for _, size in done), elapsed, count)
    finally:
        _unregister(cudart, done)


def _unregister(cudart: Any, ranges: list[tuple[int, int]]) -> None:
    for start, _ in ranges:
        err = cudart.cudaHostUnregister(start)
        if int(err) != 0:
            logger.warning("cudaHostUnregister(0x%x) failed: %s", start, _cuda_error(cudart, err))
            _clear_cuda_error()


def _cuda_error(cudart: Any, err: Any) -> str:
    try:
        return f"{int(err)} {cudart.cudaGetErrorString(err)}"
    except Exception:  # noqa: BLE001 - the number alone still says which error
        return str(int(err))


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a failed registration (``cudaGetLastError``).

    A failed ``cudaHostRegister`` leaves its error as the runtime's last error, and torch's
    next kernel launch check reports it as that kernel's failure.  ``torch.cuda.cudart()`` has
    no ``cudaGetLastError``; the runtime torch loaded is found in ``/proc/self/maps``.
    """
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "libcudart" in line.rsplit("/", 1)[-1]})
        if libs:
            ctypes.CDLL(libs[0]).cudaGetLastError()
            return
    except OSError:
        pass
    try:  # no runtime library found: a launch consumes the pending error (torch checks cudaGetLastError)
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


def to_device(data: DataProto, device: str | torch.device, pin: bool = True) -> DataProto:
    """``data.to(device)``, copying from page-locked pages where :func:`pinned` can (``pin=False``: never).

    The default is to pin: on an H200 a received 128 MiB batch reached the device in 9 ms
    (register, copy, unregister) against 27 ms pageable; without CUDA or a received view it is
    the plain copy.
    """
    if not pin:
        return data.to(device)
    with pinned(data, device) as p:
        moved = data.to(device)
        if p.pinned:
            torch.cuda.synchronize(torch.device(device))
    return moved
