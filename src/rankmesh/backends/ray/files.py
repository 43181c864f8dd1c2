"""Memory files that carry a call's large arguments and outputs between the processes of one node, reused once every reader let go.

Why: through Ray's object store a large argument costs a put and then one Ray task per rank (a
reference pickled into a call's header would stay pinned for good), so a data call with large
pieces could not take the session's ring.  A memory file (``memfd``) costs the writer the same
one copy as a put, the call stays one ring message, and each reader maps the file copy-on-write
(:mod:`rankmesh.sharedmem`): a rank that writes its input changes nobody else's data.  The same
goes the other way for an output too big for a reply slot.

Files are reused, as the object store reuses its memory: writing into a fresh file allocates and
zeroes each page as it goes (32 MiB here: 15 ms, against 5 ms into pages a file already has),
which alone made a 64 MiB call 1.6x the store's.  A file is written again only once

* the writer's :class:`Mapped` of it is gone (so no retry can send it again), and
* every reader it was sent to reported, once per opening, that its last view of it is gone
  (:func:`take_released`; hosts send their reports on their answers, the controller on its
  commands).

A reader that keeps a view (a rank that stores its input) keeps the file out of use; one that
never opened it (a call given up before it started, a rank that died) keeps it out until its
session ends, when the pool writes nothing again and closes each file once its :class:`Mapped` is
gone.  Nothing is ever written under a live view.  Readers keep the files they read mapped from
one use to the next (:class:`_Reading`), as Ray's workers keep the store mapped.  A forked child of
a reader that keeps views of its parent's input is the one case this cannot see (as with the
object store's own memory).

State: what a process reads of others' files (:data:`_READING`: the files it keeps mapped, and
its openings let go of, not yet reported) is per process, because the unpickler opens a file
(:func:`open_mapped`) with nothing but the pickled arguments; everything else is an object: one
:class:`FilePool` per writer (a session's controller end, a host).
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import threading
import uuid
import weakref
from collections import OrderedDict, defaultdict
from typing import Any, Hashable, Iterable

import numpy as np
from ray import cloudpickle

from rankmesh.errors import BackendError
from rankmesh.sharedmem import SharedFile, file_layout, write_into

#: Most files one pool keeps (each is an fd of the writer), in use or free; past it a value is
#: not mapped (the caller then sends it another way).
MAX_FILES = 256
#: Bytes of free files a pool keeps for reuse; a file let go beyond it is closed.
KEEP_BYTES = 2 << 30
#: Files of other processes a process keeps mapped between uses (:class:`_Reading`).
READ_FILES = 64


class _File:
    """One memory file of a pool: its fd, identity, capacity, how often it was written, and who may still read it."""

    __slots__ = ("number", "fd", "identity", "capacity", "use", "readers", "writer_done", "mapping")

    def __init__(self, number: int) -> None:
        self.number = number
        self.fd = os.memfd_create("rankmesh-shared", os.MFD_CLOEXEC)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        self.capacity = 0
        self.use = 0
        self.readers: dict[Hashable, int] = defaultdict(int)  # reader -> openings not yet let go
        self.writer_done = True
        self.mapping: np.ndarray | None = None  # the writer's own view of the file, once written

    def write(self, raws: list[memoryview], spans: list[tuple[int, int]], size: int) -> None:
        """Write ``raws`` at ``spans``: into the writer's mapping when the file has the pages
        (a copy into memory already there: 128 MiB in 13 ms here), else with ``pwrite`` (which
        allocates them without a page fault each: 26 ms; through a fresh mapping, 54)."""
        if self.mapping is None or self.capacity < size:
            write_into(self.fd, raws, spans, size)
            self.capacity = max(self.capacity, size)
            self.mapping = np.frombuffer(mmap.mmap(self.fd, self.capacity), dtype=np.uint8)
            return
        for raw, (start, n) in zip(raws, spans):
            np.copyto(self.mapping[start:start + n], np.frombuffer(raw, dtype=np.uint8))

    def close(self) -> None:
        self.mapping = None
        os.close(self.fd)


class FilePool:
    """The memory files one writer puts large values in (:func:`mapped`), and when each may be written again.

    ``token`` names the pool in every file's pickled form, so a reader's report of a file
    (:func:`take_released`) reaches only this pool, whatever other pools a process hears of.
    Thread-safe: values are written by callers' threads, reports come in on the thread reading
    answers, and :class:`Mapped` objects die on any thread.
    """

    def __init__(self, max_files: int = MAX_FILES, keep_bytes: int = KEEP_BYTES) -> None:
        self.token = uuid.uuid4().hex
        self.max_files, self.keep_bytes = max_files, keep_bytes
        self._lock = threading.Lock()
        self._files: dict[int, _File] = {}
        self._free: list[_File] = []
        self._numbers = itertools.count()
        self._closed = False
        self.reused = 0  # writes into a file written before (for tests and benchmarks)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def write(self, raws: list[memoryview], payload: bytes) -> "Mapped | None":
        """``raws`` written into a free file (the smallest that fits), else a new one; ``None`` when
        the pool holds :attr:`max_files` files or is closed."""
        spans, size = file_layout([raw.nbytes for raw in raws])
        with self._lock:
            if self._closed:
                return None
            fits = [f for f in self._free if f.capacity >= size]
            file = min(fits, key=lambda f: f.capacity) if fits else (self._free[0] if self._free else None)
            if file is not None:
                self._free.remove(file)
                self.reused += 1
            elif len(self._files) < self.max_files:
                file = _File(next(self._numbers))
                self._files[file.number] = file
            else:
                return None
            file.use += 1
            file.writer_done = False
        try:
            file.write(raws, spans, size)
        except BaseException:
            self._retire(file)
            raise
        return Mapped(self, file, payload, spans, size)

    def expect(self, file: _File, readers: Iterable[Hashable]) -> None:
        """``readers`` are sent the file's current use (each will open it once, and report it)."""
        with self._lock:
            for reader in readers:
                file.readers[reader] += 1

    def released(self, reader: Hashable, reports: Iterable[tuple[str, int, int]]) -> None:
        """``reader`` let go of these openings (``(token, file number, use)``; other pools' are ignored)."""
        with self._lock:
            for token, number, use in reports:
                file = self._files.get(number) if token == self.token else None
                if file is None or file.use != use or file.readers.get(reader, 0) <= 0:
                    continue
                file.readers[reader] -= 1
                if file.readers[reader] == 0:
                    del file.readers[reader]
                self._maybe_free(file)

    def _writer_done(self, number: int, use: int) -> None:
        """The writer's :class:`Mapped` of ``use`` is gone (a finalizer: any thread)."""
        with self._lock:
            file = self._files.get(number)
            if file is not None and file.use == use:
                file.writer_done = True
                self._maybe_free(file)

    def _maybe_free(self, file: _File) -> None:
        """Put ``file`` back for reuse if nothing may read it any more, or close it.

        A closed pool writes nothing again, so its files are closed as soon as the writer is done
        with them, whoever still maps them (closing never changes a reader's bytes; only writing
        would): readers of a session that ended may never report.
        """
        if not file.writer_done or file in self._free:
            return
        if self._closed:
            del self._files[file.number]
            file.close()
            return
        if file.readers:
            return
        if sum(f.capacity for f in self._free) + file.capacity > self.keep_bytes:
            del self._files[file.number]
            file.close()
        else:
            self._free.append(file)

    def _retire(self, file: _File) -> None:
        with self._lock:
            self._files.pop(file.number, None)
        file.close()

    def close(self) -> None:
        """Write nothing more: close every file the writer is done with (a file still sent, one
        whose :class:`Mapped` lives, is closed when it dies)."""
        with self._lock:
            self._closed = True
            self._free.clear()
            for file in [f for f in self._files.values() if f.writer_done]:
                del self._files[file.number]
                file.close()


class Mapped:
    """A value written into a memory file of the writer's process (:func:`mapped`), for the
    readers on its node to map: its pickle without its buffers, and where the file is (the
    writer's pid, the fd, the file's identity, its pool, number and use).

    The writer keeps the file for this use while this object lives (a call's pendings hold its
    arguments' :class:`Mapped`: :attr:`.calls.CallRecord.holds`) and until every reader it was
    sent to (:meth:`expect`) let go.
    """

    __slots__ = ("pool", "file", "payload", "spans", "size", "pid", "__weakref__")

    def __init__(self, pool: FilePool, file: _File, payload: bytes, spans: list[tuple[int, int]], size: int) -> None:
        self.pool, self.file, self.payload, self.spans, self.size = pool, file, payload, spans, size
        self.pid = os.getpid()
        weakref.finalize(self, pool._writer_done, file.number, file.use)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.spans)

    @property
    def key(self) -> tuple[str, int, int]:
        """What a reader reports when it let go of this value (:func:`let_go`)."""
        return self.pool.token, self.file.number, self.file.use

    def expect(self, readers: Iterable[Hashable]) -> None:
        """``readers`` are sent this value: the file is not written again before each let it go."""
        self.pool.expect(self.file, readers)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        file = self.file
        where = (self.pid, file.fd, file.identity, self.pool.token, file.number, file.use)
        return open_mapped, (where, self.payload, self.spans, self.size)


def is_ray_handle(obj: Any) -> bool:
    """Whether ``obj`` is an ObjectRef or an actor handle: Ray must pickle it itself, since one
    pickled outside Ray's own serialization is pinned for good (its count never drops)."""
    import ray

    return isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle))


class _InlineProbe(cloudpickle.CloudPickler):
    """The header's own pickler, stopped at a Ray handle (:func:`is_ray_handle`)."""

    def reducer_override(self, obj: Any) -> Any:
        if is_ray_handle(obj):
            raise pickle.PicklingError(f"holds a {type(obj).__name__}")
        return super().reducer_override(obj)


class CappedSink:
    """A pickle file that keeps what it is written, and stops the pickler past its cap."""

    def __init__(self, cap: int) -> None:
        self.cap, self.size, self.parts = cap, 0, []

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self.size += size
        if self.size > self.cap:
            raise OverflowError(f"pickles to more than {self.cap} bytes")
        self.parts.append(bytes(data))
        return size


def pickle_probed(obj: Any, sink: Any, buffers: list[pickle.PickleBuffer] | None = None) -> None:
    """Pickle ``obj`` into ``sink`` with the header's own pickler, refusing Ray handles (``buffers``:
    collect the out-of-band buffers there).  The pickler's memo is cleared at once: cloudpickle's
    pickler sits in a reference cycle, so a memo left in it would keep every object it pickled
    alive until the next garbage collection (a rank's input, whose file could not be reused)."""
    pickler = _InlineProbe(sink, protocol=5, buffer_callback=None if buffers is None else buffers.append)
    try:
        pickler.dump(obj)
    finally:
        pickler.clear_memo()


def mapped(obj: Any, pool: FilePool, inband_cap: int) -> Mapped | None:
    """``obj`` written into a file of ``pool`` for readers on this node to map (:class:`Mapped`),
    or ``None``: it travels another way.

    It qualifies when it pickles with its large buffers out of band (tensors, arrays:
    :mod:`rankmesh.serialization`), the rest to at most ``inband_cap`` bytes, holds no ObjectRef
    or actor handle (one pickled outside Ray's serialization is pinned for good), and the pool
    has room.  One copy of the buffers, as ``ray.put`` makes.
    """
    buffers: list[pickle.PickleBuffer] = []
    sink = CappedSink(inband_cap)
    try:
        pickle_probed(obj, sink, buffers)
        raws = [b.raw() for b in buffers]
    except Exception:  # noqa: BLE001 - too big in band, a Ray handle, a buffer not contiguous: another way
        return None
    finally:
        buffers.clear()
    if not raws:
        return None
    return pool.write(raws, b"".join(sink.parts))


class _Reading:
    """What this process knows of other processes' files: the ones it keeps open and mapped, and
    its openings of them let go of, not yet reported.

    A file is kept mapped from one use to the next (up to :data:`READ_FILES`, the least recently
    used closed first) because reading through a fresh mapping costs a page fault per 64 KiB
    (128 MiB here: 28 ms against 12 ms through a mapping read before).  Each use still gets an
    anchor of its own (:meth:`rankmesh.sharedmem.SharedFile.use`), whose death is the opening's
    release.  A session's end forgets its writer's files (:func:`forget`): its pool closes them,
    and a mapping kept here would keep their memory.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # views die, and reports are taken, on any thread
        self._let_go: list[tuple[str, int, int]] = []
        self._files: OrderedDict[tuple[str, int], SharedFile] = OrderedDict()

    def file(self, pid: int, fd: int, identity: tuple[int, int], token: str, number: int, size: int) -> SharedFile:
        """The writer's file ``number`` of pool ``token``, mapped whole, of at least ``size`` bytes."""
        key = (token, number)
        with self._lock:
            found = self._files.get(key)
            if found is not None and found.identity == tuple(identity) and found.size >= size:
                self._files.move_to_end(key)
                return found
        found = SharedFile.open(f"/proc/{pid}/fd/{fd}", identity, size)
        with self._lock:
            self._files[key] = found
            self._files.move_to_end(key)
            while len(self._files) > READ_FILES:
                self._files.popitem(last=False)
        return found

    def forget(self, tokens: Iterable[str] | None) -> None:
        """Drop the files of pools ``tokens`` (``None``: all) and the reports nobody will take."""
        with self._lock:
            for key in [k for k in self._files if tokens is None or k[0] in tokens]:
                del self._files[key]
            self._let_go = [r for r in self._let_go if tokens is not None and r[0] not in tokens]

    def add(self, token: str, number: int, use: int) -> None:
        with self._lock:
            self._let_go.append((token, number, use))

    def take(self, tokens: Iterable[str] | None) -> list[tuple[str, int, int]]:
        with self._lock:
            if not self._let_go:
                return []
            if tokens is None:
                taken, self._let_go = self._let_go, []
                return taken
            wanted = set(tokens)
            taken = [r for r in self._let_go if r[0] in wanted]
            self._let_go = [r for r in self._let_go if r[0] not in wanted]
            return taken


#: This process's reading of other processes' files (see the module docstring, "State").
_READING = _Reading()


def forget(tokens: Iterable[str] | None = None) -> None:
    """Stop keeping the files of pools ``tokens`` (``None``: every pool) mapped, and drop their
    unsent reports: their sessions ended (their pools write nothing again)."""
    _READING.forget(None if tokens is None else set(tokens))


def let_go(key: tuple[str, int, int]) -> None:
    """Report a value sent to this process as let go without opening it (its answer was not wanted)."""
    _READING.add(*key)


def take_released(tokens: Iterable[str] | None = None) -> list[tuple[str, int, int]]:
    """The openings let go of since the last call (of the pools ``tokens`` only; ``None``: all), to report to their writers."""
    return _READING.take(tokens)


def open_mapped(where: tuple[Any, ...], payload: bytes, spans: list[tuple[int, int]], size: int) -> Any:
    """A reader's copy of a :class:`Mapped` value (what unpickling it calls).

    The file's buffers come as read-only views of one shared mapping, and the data layer's
    receive turns each into a private copy-on-write view (:mod:`rankmesh.sharedmem`), as it does
    for the object store's.  Once the last view is gone the opening is reported let go.
    """
    pid, fd, identity, token, number, use = where
    try:
        file = _READING.file(pid, fd, identity, token, number, size)
    except FileNotFoundError as exc:
        raise BackendError(f"a value sent by process {pid} is gone ({exc}): its sender gave the call up "
                           "before this process read it") from None
    except OSError as exc:
        raise BackendError(f"cannot open a value sent by process {pid} at /proc/{pid}/fd/{fd}: {exc}. Processes "
                           "of one node map each other's large call arguments and outputs through /proc; set "
                           "RANKMESH_CONTROL=ray to send them through Ray's object store") from None
    anchor, views = file.use(spans)
    weakref.finalize(anchor, _READING.add, token, number, use)
    return pickle.loads(payload, buffers=views)


def probe(pool: FilePool) -> Mapped:
    """A small :class:`Mapped` of ``pool`` whose opening a session's hosts try when they join (:func:`refused`)."""
    found = mapped(np.zeros(16, dtype=np.uint8), pool, 1 << 10)
    if found is None:
        raise BackendError("cannot write a memory file to probe the session's hosts with")
    return found


def refused(pickled: bytes) -> str | None:
    """Why this process cannot open the writer's files (``pickled``: a pickled :class:`Mapped`), or ``None``."""
    try:
        pickle.loads(pickled)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the writer then sends large values another way
        return f"{type(exc).__name__}: {exc}"
    return None
