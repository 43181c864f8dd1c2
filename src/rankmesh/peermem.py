"""Reading another process's memory on the same machine: one copy per byte, no shared store in between.

Why: a reshard between two groups on one node used to copy every byte twice (source -> object
store -> destination), and the object store's first-touch page faults cost more than the copies.
Linux's ``process_vm_readv(2)`` copies straight from another process's address space into this
one's, so a destination rank can read a region of a source rank's tensor into its own parameter
in place: one copy, no intermediate buffer.

The three pieces:

* :func:`segments`: a strided CPU view (torch tensor, numpy array, or an explicit address, shape
  and element strides) as ``(address, nbytes)`` runs in row-major element order, adjacent runs
  merged; vectorized with numpy, so a view of thousands of rows costs microseconds.
* :func:`read_process`: fill local runs from a process's remote runs (scatter/gather on both
  sides, at most ``IOV_MAX`` = 1024 iovecs per side per call, partial reads resumed), or raise
  :class:`PeerReadError` with the errno and what to do.
* :func:`coalesce`: fewer, longer remote runs for a view with small gaps between its rows (the
  kernel's cost is per remote run, not per byte, below a few KiB).
* :func:`allow_peer_reads`: ``prctl(PR_SET_PTRACER, tracer_pid)``, so that under Yama's
  ``ptrace_scope=1`` (Ubuntu's default) the process ``tracer_pid`` and its descendants may read
  this one, and no other process: Yama admits a declared tracer *and every descendant of it*.
  The caller names the tracer; the Ray backend passes the node's raylet, the parent of every
  worker process on that node, so exactly Ray's workers on the node may read.  (``PR_SET_PTRACER_ANY`` would admit every process of the user
  on the machine.)

When the kernel refuses a read (``process_vm_readv`` needs the rights of ``ptrace`` attach,
``PTRACE_MODE_ATTACH_REALCREDS``, on the process read):

* **another user** (uid/gid differ) -> ``EPERM``, unless the reader has ``CAP_SYS_PTRACE``;
* **Yama** (``/proc/sys/kernel/yama/ptrace_scope``): 0 classic; 1 only a descendant, or a process
  of the tracer the target declared with ``PR_SET_PTRACER`` (what :func:`allow_peer_reads` does); 2 only with
  ``CAP_SYS_PTRACE``; 3 never -> ``EPERM``;
* **not dumpable** (setuid programs, ``prctl(PR_SET_DUMPABLE, 0)``) -> ``EPERM`` without ``CAP_SYS_PTRACE``;
* **seccomp** (container runtimes' default profiles on old kernels, gVisor, a filter the process
  installed) -> ``EPERM`` or ``ENOSYS``; an LSM (AppArmor, SELinux) denying ``ptrace read`` -> ``EACCES``/``EPERM``;
* **another pid namespace** (the two processes in different containers of one node) -> ``ESRCH``
  or, worse, another process of that pid: :func:`namespace_id` lets both sides compare first.

Root, as on this project's test machines, passes all of these but seccomp and Yama 3.  Callers
fall back to a copy through a store when :attr:`PeerReadError.refused` is true.

This module imports nothing from the package but its errors (:class:`~rankmesh.errors.PeerReadError`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import sys
from typing import Any, Sequence

import numpy as np

from rankmesh.errors import PeerReadError

logger = logging.getLogger(__name__)

#: Most iovecs one ``process_vm_readv`` call takes on either side (Linux's ``UIO_MAXIOV``).
IOV_MAX = 1024

#: errnos that mean "this process may not read that one" (a fallback helps), as opposed to a bug.
REFUSED_ERRNOS = frozenset({errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ESRCH})  # as PeerReadError.refused

_PR_SET_PTRACER = 0x59616D61  # "Yama"

_libc: Any = None


def _c() -> Any:
    global _libc
    if _libc is None:
        if not sys.platform.startswith("linux"):
            raise PeerReadError(errno.ENOSYS, "process_vm_readv exists on Linux only")
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if not hasattr(lib, "process_vm_readv"):
            raise PeerReadError(errno.ENOSYS, "this C library has no process_vm_readv")
        lib.process_vm_readv.restype = ctypes.c_ssize_t
        lib.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                                         ctypes.c_ulong, ctypes.c_ulong]
        lib.prctl.restype = ctypes.c_int
        lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _libc = lib
    return _libc


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (says nothing of permission)."""
    try:
        _c()
    except OSError:
        return False
    return True


def allow_peer_reads(tracer_pid: int) -> bool:
    """Let process ``tracer_pid`` and its descendants read this one under Yama ``ptrace_scope=1``.

    Yama keeps one declared tracer per process; this replaces any earlier one.  Pass the common
    ancestor of the processes that should read (on Ray: the node's raylet), or this process's own
    pid to admit its descendants.  Returns True when set, False where Yama is absent or
    ``tracer_pid`` does not exist (both ``EINVAL``) or the call is refused; raises only for a
    ``tracer_pid`` that is not a positive int.  Idempotent and cheap (one ``prctl``).
    """
    if isinstance(tracer_pid, bool) or not isinstance(tracer_pid, int) or tracer_pid <= 0:
        raise ValueError(f"allow_peer_reads(tracer_pid) needs the pid of the reading processes' ancestor, got {tracer_pid!r}")
    try:
        lib = _c()
    except OSError:
        return False
    if lib.prctl(_PR_SET_PTRACER, tracer_pid, 0, 0, 0) == 0:
        return True
    err = ctypes.get_errno()
    if err != errno.EINVAL:
        logger.debug("prctl(PR_SET_PTRACER, %d) failed: %s", tracer_pid, os.strerror(err))
    return False


def namespace_id() -> tuple[int, int] | None:
    """This process's pid namespace as ``(st_dev, st_ino)`` of ``/proc/self/ns/pid`` (None if unknown).

    Two processes may name each other by pid only when these are equal.
    """
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


# ----- strided views as runs of bytes -------------------------------------------------------------


def strided_segments(addr: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> np.ndarray:
    """Runs of the view at ``addr`` with ``shape`` and element ``strides``, in row-major element order.

    Returns an ``(n, 2)`` uint64 array of (address, nbytes), adjacent runs merged (the layout of
    an ``iovec`` array on 64-bit Linux).  Negative strides are not supported (torch has none).
    """
    shape, strides = [int(s) for s in shape], [int(s) for s in strides]
    if len(shape) != len(strides):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    if any(s < 0 for s in strides):
        raise ValueError(f"negative strides {strides} are not supported")
    if any(n == 0 for n in shape):
        return np.empty((0, 2), dtype=np.uint64)
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]  # a dimension of size 1 moves nowhere
    # Fold the innermost dimensions into one contiguous run while they are laid out densely.
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = np.zeros(1, dtype=np.int64)
    for n, s in dims:  # outer dimensions: the start of every run, row-major (last dimension fastest)
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    starts = offsets * itemsize + addr
    length = run * itemsize
    if len(starts) > 1:  # runs that happen to touch (e.g. a dimension of stride 0 is not one) merge
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + length) + 1
        if len(breaks) < len(starts) - 1:
            first = np.concatenate(([0], breaks))
            ends = np.concatenate((breaks, [len(starts)]))
            out = np.empty((len(first), 2), dtype=np.uint64)
            out[:, 0] = starts[first]
            out[:, 1] = (ends - first) * length
            return out
    out = np.empty((len(starts), 2), dtype=np.uint64)
    out[:, 0] = starts
    out[:, 1] = length
    return out


def segments(view: Any) -> np.ndarray:
    """Runs of a CPU torch tensor or numpy array (see :func:`strided_segments`)."""
    if isinstance(view, np.ndarray):
        addr = view.__array_interface__["data"][0]
        if any(s % view.itemsize for s in view.strides):
            raise ValueError("a numpy view whose strides are not whole elements")
        return strided_segments(addr, view.shape, [s // view.itemsize for s in view.strides], view.itemsize)
    device = getattr(view, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"a tensor on {device} has no address another process can read; copy it to the CPU first")
    return strided_segments(view.data_ptr(), tuple(view.shape), tuple(view.stride()), view.element_size())


def _as_runs(runs: Any) -> np.ndarray:
    arr = np.asarray(runs, dtype=np.uint64)
    return arr.reshape(-1, 2) if arr.size else np.empty((0, 2), dtype=np.uint64)


#: Remote gaps up to this many bytes between the runs of one view are read too (into a scratch
#: buffer): the kernel pins the source pages once per remote run, which costs as much as copying
#: a few KiB (measured: 1 KiB runs at a 2 KiB stride 0.68 ns/B, one run 0.12 ns/B).
COALESCE_GAP = 4096

_scratch = np.empty(COALESCE_GAP, dtype=np.uint8)  # where skipped bytes land (contents never read)


def coalesce(remote: Any, local: Any, max_gap: int = COALESCE_GAP) -> tuple[np.ndarray, np.ndarray]:
    """The same read as ``(remote, local)`` with fewer remote runs: runs closer than ``max_gap``
    bytes become one span, and the bytes between them land in a scratch buffer on the local side.

    Only for the runs of **one** view (a tensor's storage is mapped between its runs; two separate
    allocations may have an unmapped page between them).  ``max_gap`` is at most :data:`COALESCE_GAP`.
    """
    rem, loc = _as_runs(remote), _as_runs(local)
    max_gap = min(int(max_gap), COALESCE_GAP)
    if len(rem) < 2 or max_gap <= 0:
        return rem, loc
    a, n = rem[:, 0].astype(np.int64), rem[:, 1].astype(np.int64)
    gaps = a[1:] - (a[:-1] + n[:-1])
    merge = (gaps >= 0) & (gaps <= max_gap)
    if not merge.any():
        return rem, loc
    first = np.flatnonzero(np.concatenate(([True], ~merge)))  # the first run of each span
    last = np.concatenate((first[1:], [len(a)])) - 1
    spans = np.empty((len(first), 2), dtype=np.uint64)
    spans[:, 0] = a[first]
    spans[:, 1] = a[last] + n[last] - a[first]
    # Local side: after the byte where each skipped gap begins, a run into the scratch buffer.
    if len(loc) == 1:  # a contiguous destination (the common case): no local run to cut
        after = np.concatenate((merge & (gaps > 0), [False]))  # a gap follows run i
        pos = np.arange(len(n)) + np.concatenate(([0], np.cumsum(after)[:-1]))
        out = np.empty((len(n) + int(after.sum()), 2), dtype=np.uint64)
        out[pos, 0] = int(loc[0, 0]) + np.concatenate(([0], np.cumsum(n)[:-1]))
        out[pos, 1] = n
        out[pos[after] + 1, 0] = _scratch.ctypes.data
        out[pos[after] + 1, 1] = gaps[after[:-1]]
        return spans, out
    skip = np.flatnonzero(merge & (gaps > 0))
    at, glen = np.cumsum(n)[skip], gaps[skip]
    lo, ln = loc[:, 0].astype(np.int64), loc[:, 1].astype(np.int64)
    lend = np.cumsum(ln)
    cuts = np.union1d(lend, at)  # every local run boundary and every gap, as stream offsets
    prev = np.concatenate(([0], cuts[:-1]))
    k = np.searchsorted(lend, prev, side="right")  # the local run holding each piece
    where = np.searchsorted(cuts, at)  # the piece each gap follows
    out = np.empty((len(cuts) + len(at), 2), dtype=np.uint64)
    pieces = np.arange(len(cuts))
    out[pieces + np.searchsorted(where, pieces, side="left"), 0] = lo[k] + prev - (lend[k] - ln[k])
    out[pieces + np.searchsorted(where, pieces, side="left"), 1] = cuts - prev
    out[where + np.arange(len(at)) + 1, 0] = _scratch.ctypes.data
    out[where + np.arange(len(at)) + 1, 1] = glen
    return spans, out


def read_process(pid: int, remote: Any, local: Any) -> int:
    """Copy process ``pid``'s bytes at ``remote`` runs into this process's ``local`` runs.

    Both are ``(address, nbytes)`` runs (arrays from :func:`segments`, or lists of pairs) of the
    same total size; bytes flow in order, whatever the run boundaries on either side.  Returns
    the bytes read (after :func:`coalesce`, the skipped gaps included).  Raises :class:`PeerReadError` (errno, pid, and how to fix it) when the kernel
    refuses or the addresses are bad; a read the kernel cuts short is resumed where it stopped.
    """
    lib = _c()
    rem, loc = _as_runs(remote), _as_runs(local)
    rem, loc = rem[rem[:, 1] > 0], loc[loc[:, 1] > 0]
    total = int(loc[:, 1].sum()) if len(loc) else 0
    if total != (int(rem[:, 1].sum()) if len(rem) else 0):
        raise ValueError(f"local runs hold {total} bytes but remote runs {int(rem[:, 1].sum())}")
    if total == 0:
        return 0
    rem_end, loc_end = np.cumsum(rem[:, 1].astype(np.int64)), np.cumsum(loc[:, 1].astype(np.int64))
    pos = 0
    while pos < total:
        batches = []
        limit = total
        for runs, ends in ((loc, loc_end), (rem, rem_end)):
            i = int(np.searchsorted(ends, pos, side="right"))  # the run that holds byte ``pos``
            j = min(i + IOV_MAX, len(runs))
            batch = runs[i:j].copy()
            skip = pos - (int(ends[i - 1]) if i else 0)
            batch[0, 0] += np.uint64(skip)
            batch[0, 1] -= np.uint64(skip)
            limit = min(limit, int(ends[j - 1]))
            batches.append((batch, ends[i:j]))
        iovs = []
        for batch, ends in batches:  # cut both sides at the same byte: ``limit``
            k = int(np.searchsorted(ends, limit, side="left"))
            batch = batch[: k + 1]
            batch[k, 1] -= np.uint64(int(ends[k]) - limit)
            iovs.append(np.ascontiguousarray(batch))
        want = limit - pos
        got = lib.process_vm_readv(int(pid), iovs[0].ctypes.data, len(iovs[0]), iovs[1].ctypes.data, len(iovs[1]), 0)
        if got < 0:
            raise _error(ctypes.get_errno(), pid)
        if got == 0:
            raise PeerReadError(errno.EFAULT, f"process_vm_readv from pid {pid} read 0 of {want} bytes at byte {pos}")
        pos += int(got)
    return total


def _error(err: int, pid: int) -> PeerReadError:
    why = {
        errno.EPERM: "the kernel refused: another user, Yama ptrace_scope 2/3 (or 1, and this process is not a "
                     "descendant of the tracer the source declared with PR_SET_PTRACER), "
                     "a non-dumpable process, or a seccomp filter (containers) - see rankmesh.peermem",
        errno.EACCES: "a security module (AppArmor/SELinux) denies ptrace read access",
        errno.ENOSYS: "process_vm_readv is not allowed here (seccomp, gVisor, or an old kernel)",
        errno.ESRCH: "no such process: it exited, or runs in another pid namespace (another container)",
        errno.EFAULT: "an address is not mapped in one of the processes (the tensor was freed or resized)",
        errno.ENOMEM: "the kernel could not allocate the iovec copies",
    }.get(err, "")
    name = errno.errorcode.get(err, str(err))
    return PeerReadError(err, f"process_vm_readv from pid {pid} failed: {name} {os.strerror(err)}" + (f" ({why})" if why else ""))
