"""Pickle-protocol-5 helpers that let tensors and numeric arrays travel out of band.

Why: Ray (and :func:`dumps` here) pickles with protocol 5 and a ``buffer_callback``; every
:class:`pickle.PickleBuffer` met on the way is then handed over as raw memory instead of being
copied into the pickle stream.  ``ray.put`` copies those bytes once into the object store and
``ray.get`` maps them back without a copy, read-only.  Torch's own tensor pickling (``torch.save``
into bytes, as verl's DataProto does) defeats that: every byte is copied into the stream and out
again.  So :func:`reduce_tensor` turns a CPU tensor into a ``PickleBuffer`` over a numpy view of
its memory (no copy for contiguous tensors) and :func:`rebuild_tensor` turns the buffer back.

Isolation rule, and where the single receive-side copy happens: a receiver must never hold
tensors that share writable memory with the sender or with another receiver.  The rebuild
functions get the buffer object exactly as the unpickler supplies it and decide:

* a ``bytearray`` was created by the unpickler for this load alone (in-band data, or the private
  buffers :func:`loads_private` is given, e.g. freshly read from a file): it is used directly;
* anything else (a read-only ``ray.get`` view, the sender's own ``PickleBuffer`` handed to
  :func:`loads`, a ``bytes`` object) may be shared, so it goes through
  :func:`rankmesh.sharedmem.private_bytes`: a copy-on-write mapping of the object store's pages
  where the platform allows it (no bytes copied until the receiver writes, then only the pages
  it writes), else one private copy.

How a receive treats those possibly-shared buffers is one choice, :data:`REBUILDS`, made by
whoever runs the receive and set around it with :func:`receiving`: ``"cow"`` (the default,
above), ``"copy"`` (one private copy now: the worker's call path for a method or group that
declares ``receive="copy"``) or ``"borrow"`` (read-only views, no copy: the controller's fetch
of outputs it concatenates into a fresh batch anyway).  It is a context variable, not an
argument, for one reason: the unpickler (``pickle.loads`` here, ``ray.get`` in the Ray
backend) calls the rebuild functions with the pickled state alone.  It is the only per-receive
state of this module and of :mod:`rankmesh.sharedmem`, which is handed the choice explicitly.

This module imports nothing from the package except :mod:`rankmesh.errors` and
:mod:`rankmesh.sharedmem`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import pickle
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Union

import numpy as np
import torch

from rankmesh.errors import DataProtoError
from rankmesh.sharedmem import private_bytes, unwritten_original

logger = logging.getLogger(__name__)

#: Buffers smaller than this travel in band (as a private ``bytearray``): for tiny tensors the
#: per-buffer bookkeeping of out-of-band transport costs more than the copy.
INBAND_MAX_BYTES = 16 * 1024

#: Pickle protocol used by :func:`dumps` (the first one with out-of-band buffers).
PROTOCOL = 5

_INT_OF_WIDTH = MappingProxyType({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})


def dumps(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj`` with protocol 5; return the in-band bytes and the out-of-band buffers.

    The buffers are views of the sender's memory (nothing is copied); :func:`loads` copies them
    on the receiving side, so the result never aliases the sender.
    """
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=PROTOCOL, buffer_callback=buffers.append)
    return data, buffers


def loads(data: bytes, buffers: Iterable[Any] = ()) -> Any:
    """Unpickle what :func:`dumps` produced; tensors are rebuilt as private, writable copies.

    Buffers are passed on read-only, so even ``bytearray`` buffers (which the rebuild would
    otherwise take as private) are copied: calling this twice never yields shared memory.
    """
    return pickle.loads(data, buffers=[memoryview(b).toreadonly() for b in buffers])


def loads_private(data: bytes, buffers: Iterable[bytearray]) -> Any:
    """Unpickle with buffers the caller owns exclusively (fresh ``bytearray`` objects).

    The rebuilt tensors and arrays use that memory directly: no receive-side copy.  Only use
    this when nobody else holds those bytearrays (e.g. they were just read from a file).
    """
    bufs = list(buffers)
    for b in bufs:
        if type(b) is not bytearray:
            raise TypeError(f"loads_private needs bytearray buffers, got {type(b).__name__}")
    return pickle.loads(data, buffers=bufs)


def _is_private(buf: Any) -> bool:
    """True when ``buf`` was made for this one load (see the module docstring)."""
    return type(buf) is bytearray


#: How a receive rebuilds a buffer that may be shared (see the module docstring): ``"cow"``
#: private, copy-on-write where possible; ``"copy"`` one private copy now; ``"borrow"`` a
#: read-only view, for a caller that copies every rebuilt tensor and array itself.
REBUILDS: tuple[str, ...] = ("cow", "copy", "borrow")

#: Why a ``"copy"`` receive copied (what :func:`rankmesh.sharedmem.receive_info` reports).
COPY_DECLARED = "the method or group declares receive='copy'"

#: The rebuild of the receive running in this context; set only by :func:`receiving`.
_RECEIVE: contextvars.ContextVar[str] = contextvars.ContextVar("rankmesh_receive", default="cow")


@contextlib.contextmanager
def receiving(how: str) -> Iterator[None]:
    """Within the block (this thread or task), receives rebuild shared buffers as ``how`` says.

    ``how`` is one of :data:`REBUILDS`.  ``"borrow"`` only for a caller that copies every rebuilt
    tensor and array itself before anyone sees it (the controller's concat of collected
    outputs, which writes them into a fresh batch anyway): without it the fetched outputs would
    be copied twice (rebuild, then concat).  Borrowed tensors are read-only views (of the object
    store, or of the sender's memory).
    """
    if how not in REBUILDS:
        raise ValueError(f"receiving(how) must be one of {REBUILDS}, got {how!r}")
    token = _RECEIVE.set(how)
    try:
        yield
    finally:
        _RECEIVE.reset(token)


def _copy_reason() -> str | None:
    """What to hand :func:`rankmesh.sharedmem.private_bytes` under the current receive."""
    return COPY_DECLARED if _RECEIVE.get() == "copy" else None


def _borrowed_tensor(arr: np.ndarray, dtype: torch.dtype | None) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    if dtype is not None and t.dtype != dtype:
        t = t.view(dtype)
    return t


def _carrier(arr: np.ndarray, protocol: int) -> Any:
    """What travels for a C-contiguous array: an out-of-band PickleBuffer when large, else bytes.

    The buffer is a flat uint8 view, so consumers never meet exotic buffer formats.
    """
    raw = arr.reshape(-1).view(np.uint8)
    if protocol >= 5 and raw.nbytes > INBAND_MAX_BYTES:
        # A received copy-on-write view nobody wrote: send the same bytes from the shared
        # original (no read fault per 64 KiB of a fresh private mapping).
        shared = unwritten_original(raw.ctypes.data, raw.nbytes)
        return pickle.PickleBuffer(raw if shared is None else shared)
    # bytearray(...) copies; unpickling gives a fresh bytearray, which the rebuild may keep.
    return bytearray(raw.data)


def tensor_from_buffer(
    arr: np.ndarray, writable_copy: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Wrap a numpy array as a tensor; this is where the receive-side copy happens.

    ``writable_copy=True`` (or a read-only ``arr``, as ``ray.get`` returns) makes the tensor's
    memory private and writable: copy-on-write over shared memory where possible, else a copy
    (:func:`rankmesh.sharedmem.private_bytes`; one private copy inside ``receiving("copy")``).
    ``dtype`` views the result back to a torch dtype numpy lacks (bf16, float8, ...), carried as
    a same-width integer array.
    """
    if writable_copy or not arr.flags.writeable:
        arr = _private(arr, _copy_reason())
    t = torch.from_numpy(arr)
    if dtype is not None and t.dtype != dtype:
        t = t.view(dtype)
    return t


def _private(arr: np.ndarray, copy_reason: str | None) -> np.ndarray:
    """``arr``'s bytes, writable and shared with no one (copy-on-write where possible, unless
    ``copy_reason`` asks for a copy)."""
    return private_bytes(arr.reshape(-1).view(np.uint8), copy_reason).view(arr.dtype).reshape(arr.shape)


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor, no copy.

    Dtypes numpy lacks (bf16, float8 ...) come back as a same-width integer array; ``TypeError``
    for a width no integer has.
    """
    try:
        return t.numpy()
    except TypeError:
        width = t.element_size()
        if width not in _INT_OF_WIDTH:
            raise
        return t.view(_INT_OF_WIDTH[width]).numpy()


def numpy_backed_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory numpy allocated.

    Why: numpy asks the kernel for transparent huge pages for large buffers, torch's CPU
    allocator does not; first-touch page faults then dominate the cost of filling a fresh
    buffer of hundreds of MiB (several times a memcpy).  Used for big concat outputs.
    """
    np_dtype = numpy_view(torch.empty(0, dtype=dtype)).dtype
    t = torch.from_numpy(np.empty(shape, dtype=np_dtype))
    return t if t.dtype == dtype else t.view(dtype)


# --- states: what travels in the pickle for one tensor or array ---------------------------------
# Small frozen dataclasses (slots, so a state pickles as its class reference and its field values,
# the names written once per pickle); ``rebuild`` is the unpickling side of each.


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """Move a rebuilt tensor back to the sender's device when this process has it."""
    if device == "cpu":
        return t
    try:
        return t.to(device)
    except (RuntimeError, AssertionError) as exc:  # e.g. CUDA tensor received on a CPU-only host
        logger.warning("tensor from %s kept on the CPU: %s", device, exc)
        return t


def _finish(t: torch.Tensor, requires_grad: bool, device: str) -> torch.Tensor:
    t = _to_device(t, device)
    if requires_grad:
        t.requires_grad_(True)
    return t


@dataclass(frozen=True, slots=True)
class TorchPickledTensor:
    """A tensor torch pickles itself (sparse, quantized, nested): travels in band, as torch does."""

    tensor: torch.Tensor

    def rebuild(self) -> torch.Tensor:
        return self.tensor


@dataclass(frozen=True, slots=True)
class EmptyTensor:
    """A tensor with no bytes: only its dtype and shape travel."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    device: str

    def rebuild(self) -> torch.Tensor:
        return _finish(torch.empty(self.shape, dtype=self.dtype), self.requires_grad, self.device)


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """A strided tensor as raw bytes (``carrier``: a PickleBuffer out of band, or a bytearray).

    ``np_dtype`` is the numpy dtype of the bytes; ``dtype`` the torch dtype they are viewed back
    to (they differ for dtypes numpy lacks, carried as a same-width integer).
    """

    carrier: Any
    np_dtype: np.dtype
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    device: str

    def rebuild(self) -> torch.Tensor:
        """Copies once unless the buffer is private (see the module docstring) or borrowed."""
        arr = np.frombuffer(self.carrier, dtype=self.np_dtype)
        if not _is_private(self.carrier) and _RECEIVE.get() == "borrow":
            t = _borrowed_tensor(arr, self.dtype)
        else:
            t = tensor_from_buffer(arr, writable_copy=not _is_private(self.carrier), dtype=self.dtype)
        return _finish(t.reshape(self.shape), self.requires_grad, self.device)


TensorState = Union[TorchPickledTensor, EmptyTensor, TensorBytes]


@dataclass(frozen=True, slots=True)
class PickledArray:
    """An array pickled normally, in band (object arrays, numpy subclasses)."""

    array: Any

    def rebuild(self) -> Any:
        return self.array


@dataclass(frozen=True, slots=True)
class EmptyArray:
    """An array with no bytes: only its dtype and shape travel."""

    dtype: np.dtype
    shape: tuple[int, ...]

    def rebuild(self) -> np.ndarray:
        return np.empty(self.shape, dtype=self.dtype)


@dataclass(frozen=True, slots=True)
class ArrayBytes:
    """A numeric array as raw bytes (``carrier``: a PickleBuffer out of band, or a bytearray)."""

    carrier: Any
    dtype: np.dtype
    shape: tuple[int, ...]

    def rebuild(self) -> np.ndarray:
        """Copies once unless the buffer is private (see the module docstring) or borrowed."""
        arr = np.frombuffer(self.carrier, dtype=self.dtype)
        if (not _is_private(self.carrier) or not arr.flags.writeable) and _RECEIVE.get() != "borrow":
            arr = _private(arr, _copy_reason())
        return arr.reshape(self.shape)


ArrayState = Union[PickledArray, EmptyArray, ArrayBytes]


def reduce_tensor(t: torch.Tensor, protocol: int = PROTOCOL) -> TensorState:
    """State of a tensor for :func:`rebuild_tensor`; contiguous CPU tensors are not copied.

    Non-contiguous tensors are made contiguous (one copy, unavoidable), GPU tensors are copied
    to the CPU.  Sparse, quantized and nested tensors fall back to torch's own pickling.
    """
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return TorchPickledTensor(t)
    device = str(t.device)
    src = t.detach()
    if src.device.type != "cpu":
        src = src.cpu()
    src = src.resolve_conj().resolve_neg().contiguous()
    if src.numel() * src.element_size() == 0:
        return EmptyTensor(t.dtype, tuple(t.shape), t.requires_grad, device)
    arr = numpy_view(src)
    return TensorBytes(_carrier(arr, protocol), arr.dtype, t.dtype, tuple(t.shape), t.requires_grad, device)


def rebuild_tensor(state: TensorState) -> torch.Tensor:
    """Inverse of :func:`reduce_tensor`; copies once unless the buffer is private."""
    return state.rebuild()


def reduce_ndarray(arr: np.ndarray, protocol: int = PROTOCOL) -> ArrayState:
    """State of a numpy array for :func:`rebuild_ndarray`.

    Numeric (object-free) arrays travel as raw buffers, out of band when large; object arrays
    pickle normally, in band.
    """
    if not isinstance(arr, np.ndarray) or arr.dtype.hasobject or type(arr) is not np.ndarray:
        return PickledArray(arr)
    src = np.ascontiguousarray(arr)
    if src.nbytes == 0:
        return EmptyArray(arr.dtype, arr.shape)
    return ArrayBytes(_carrier(src, protocol), arr.dtype, arr.shape)


def rebuild_ndarray(state: ArrayState) -> np.ndarray:
    """Inverse of :func:`reduce_ndarray`; copies once unless the buffer is private."""
    return state.rebuild()


# --- files -------------------------------------------------------------------------------------
# Layout: MAGIC, u64 length of the pickle stream, the stream, u64 buffer count, then per buffer a
# u64 length and its raw bytes.  Buffers are written straight from the sender's memory and read
# into fresh bytearrays, so saving copies nothing in memory and loading copies nothing twice.

FILE_MAGIC = b"RANKMESH-P5\n"
_U64 = 8


def _u64(n: int) -> bytes:
    return int(n).to_bytes(_U64, "little")


def dump_to_file(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to a plain file with protocol 5, tensors as raw out-of-band buffers."""
    data, buffers = dumps(obj)
    with open(path, "wb") as f:
        f.write(FILE_MAGIC)
        f.write(_u64(len(data)))
        f.write(data)
        f.write(_u64(len(buffers)))
        for buf in buffers:
            with buf.raw() as raw:
                f.write(_u64(raw.nbytes))
                f.write(raw)


def _read_exact(f: Any, n: int, path: Any) -> bytearray:
    out = bytearray(n)
    if n and f.readinto(out) != n:
        raise DataProtoError(f"{path}: file is truncated")
    return out


def load_from_file(path: str | os.PathLike[str]) -> Any:
    """Read what :func:`dump_to_file` wrote; tensors use the freshly read memory directly."""
    with open(path, "rb") as f:
        if f.read(len(FILE_MAGIC)) != FILE_MAGIC:
            raise DataProtoError(f"{path}: not a rankmesh data file (bad magic header)")
        data = bytes(_read_exact(f, int.from_bytes(_read_exact(f, _U64, path), "little"), path))
        count = int.from_bytes(_read_exact(f, _U64, path), "little")
        buffers = []
        for _ in range(count):
            size = int.from_bytes(_read_exact(f, _U64, path), "little")
            buffers.append(_read_exact(f, size, path))
    return loads_private(data, buffers)
