"""A fixed-size shared-memory command ring: one writer, N readers on one machine, eventfd doorbells, no hang on a dead peer.

Why: a group call sent as one Ray task per rank costs the controller ~0.2 ms of CPU per rank
(docs/performance.md), so an 8-rank no-op takes 2.7-4.8 ms here and grows with ranks.  A
persistent channel per node lets one write reach every local rank: the writer (a node agent, or
the controller for its own node) puts one message, and each reader (a rank's host process)
takes it from the same pages.  This module is that channel alone, with no Ray and no rankmesh
call format in it (the call session built on it: ``rankmesh.backends.ray.session``).

**Layout.** One memfd, mapped by every party: a header (magic, sizes, the abort and waiting flags), then
``slots`` slots, each a sequence number, a length, one "read" flag per reader and
``slot_bytes`` of payload.  Message ``k`` (0-based) goes to slot ``k % slots``.

**Protocol** (vLLM's ``shm_broadcast``).  The writer waits until every reader has read what the
slot held (all its flags set), clears the flags, writes length and payload, and publishes the
slot's sequence number ``k + 1`` last.  Reader ``r`` waits for its next message's sequence number
to appear, copies the payload out, and sets its flag.  x86 keeps stores in order (TSO), so a
reader that sees the sequence number sees the payload; a weakly ordered CPU (ARM) would need a
fence between the two stores, which pure Python cannot issue: :func:`check_platform` refuses
such machines rather than risk a torn read.

**Waiting.**  Every wait spins for at most ``spin_s`` (0 by default when there are more readers
than cores: 8 ranks share 2 cores here, and a spinning reader starves the one that should run),
then blocks in ``poll`` on the party's eventfd doorbell and the peers' pidfds (``poll``, not
``select``: a process that opened a thousand files gets fds above ``select``'s limit of 1023).  The writer
rings each reader's doorbell after publishing; a reader rings the writer's only while the writer
says it waits for a free slot (a flag in the header), which saves a system call per message on
both sides.  Without a fence the writer's flag and a reader's may cross unseen, so a waiting
writer also looks again every :data:`WRITER_SLICE_S`.  Every wait has a deadline (:class:`~rankmesh.errors.RingTimeout`); a peer that
exits (its pidfd becomes readable) raises :class:`~rankmesh.errors.RingPeerDied` naming it at
once, and :meth:`Ring.abort` by any party makes every waiter raise.  Idle, a reader blocks in the
kernel: no CPU.

**Cleanup.**  The memfd and eventfds are anonymous: the kernel frees them when the last fd or
mapping closes, so nothing is left in ``/dev/shm``, even after a SIGKILL.

**Sharing.**  Processes not forked from the writer (Ray actors) receive the fds over a Unix
socket (:func:`send_ring` / :func:`receive_ring`, SCM_RIGHTS), with the ring's sizes and the
writer's pid.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import select
import socket
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Sequence

from rankmesh.errors import RingError, RingPeerDied, RingTimeout

MAGIC = 0x524D5247  # "RMRG"
HEADER = struct.Struct("<IIIII")  # magic, readers, slots, slot_bytes, aborted; then the writer's waiting flag (WAITING_AT)
SEQ_LEN = struct.Struct("<QQ")  # a slot's sequence number (k + 1 once message k is in) and payload length
U64 = struct.Struct("<Q")
HEADER_BYTES = 64
MAX_READERS = 64
#: Longest a blocked wait sleeps before it looks at the abort flag again (seconds); an abort also
#: rings every doorbell, so this only bounds how long a lost wake-up could go unnoticed.
POLL_SLICE_S = 1.0
#: How often a writer waiting for a free slot looks again: readers ring its doorbell only while it
#: says it waits (``WAITING_AT``), and without a fence the two parties' flags can cross unseen.
WRITER_SLICE_S = 0.005
ABORTED_AT = 16  # header offsets: the abort flag, and the writer's "I wait for a free slot" flag
WAITING_AT = 20
U32 = struct.Struct("<I")


def check_platform() -> None:
    """Refuse CPUs whose stores may be seen out of order without a fence (see the module docstring)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        raise RingError(f"the shared-memory ring needs 64-bit x86 (its store ordering, and atomic 64-bit sequence "
                        f"numbers); this is {machine}: use the Ray path (RANKMESH_CONTROL=ray)")


@dataclass(frozen=True)
class RingSpec:
    """A ring's sizes: ``readers`` parties read every message; ``slots`` messages may be in flight."""

    readers: int
    slots: int = 8
    slot_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name, value, top in (("readers", self.readers, MAX_READERS), ("slots", self.slots, 1 << 16),
                                 ("slot_bytes", self.slot_bytes, 1 << 30)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise RingError(f"RingSpec.{name} must be an integer from 1 to {top}, got {value!r}")

    @property
    def slot_stride(self) -> int:
        return SEQ_LEN.size + MAX_READERS + self.slot_bytes

    @property
    def size(self) -> int:
        return HEADER_BYTES + self.slots * self.slot_stride


class Ring:
    """One party's end of a ring: the writer (``reader is None``) or reader ``reader``.

    Made by :meth:`create` (the writer, which owns the fds) or :meth:`attach` (any party, from the
    fds).  ``peers`` are the pids whose exit ends every wait with :class:`RingPeerDied`: the
    writer's, for a reader; the readers', for the writer (:meth:`watch`).
    """

    def __init__(self, spec: RingSpec, memfd: int, doorbells: Sequence[int], reader: int | None, spin_s: float | None) -> None:
        check_platform()
        self.spec = spec
        self.reader = reader
        self._fds = [memfd, *doorbells]  # doorbells[0]: the writer's; doorbells[1 + r]: reader r's
        self._mm = mmap.mmap(memfd, spec.size)
        self._bell = doorbells[0] if reader is None else doorbells[1 + reader]
        self._reader_bells = list(doorbells[1:])
        self._writer_bell = doorbells[0]
        self._next = 0  # the next message this party writes or reads
        self._peers: dict[int, int] = {}  # pidfd -> pid
        cores = os.cpu_count() or 1
        self.spin_s = (20e-6 if spec.readers < cores else 0.0) if spin_s is None else spin_s
        self._all_read = b"\x01" * spec.readers
        self._bases = [HEADER_BYTES + slot * spec.slot_stride for slot in range(spec.slots)]
        self._release = weakref.finalize(self, Ring._free, self._mm, self._fds, self._peers)

    # ----- making and sharing ---------------------------------------------------------------

    @classmethod
    def create(cls, spec: RingSpec, spin_s: float | None = None) -> "Ring":
        """A new ring, this process its writer."""
        memfd = os.memfd_create("rankmesh-ring", os.MFD_CLOEXEC)
        os.ftruncate(memfd, spec.size)
        bells = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(spec.readers + 1)]
        ring = cls(spec, memfd, bells, None, spin_s)
        HEADER.pack_into(ring._mm, 0, MAGIC, spec.readers, spec.slots, spec.slot_bytes, 0)
        for slot in range(spec.slots):  # an empty slot counts as read by everyone
            ring._mm[ring._flags(slot)] = ring._all_read
        return ring

    @classmethod
    def attach(cls, fds: Sequence[int], reader: int, spin_s: float | None = None) -> "Ring":
        """Reader ``reader``'s end, from the fds :meth:`fds` lists (this process owns them from now on).

        On a refusal the fds are closed too: they are this process's either way."""
        try:
            if not fds:
                raise RingError("cannot attach to a ring from no fds")
            memfd = fds[0]
            head = mmap.mmap(memfd, HEADER_BYTES)
            magic, readers, slots, slot_bytes, _ = HEADER.unpack_from(head, 0)
            head.close()
            if magic != MAGIC:
                raise RingError(f"fd {memfd} is not a rankmesh ring (magic {magic:#x})")
            spec = RingSpec(readers, slots, slot_bytes)
            if not 0 <= reader < readers or len(fds) != readers + 2:
                raise RingError(f"cannot attach as reader {reader} of a ring with {readers} readers from {len(fds)} fds")
            return cls(spec, memfd, fds[1:], reader, spin_s)
        except BaseException:
            _close_fds(fds)
            raise

    def fds(self) -> list[int]:
        """The memfd, then the writer's doorbell, then every reader's: what a reader attaches with."""
        return list(self._fds)

    def watch(self, pids: Sequence[int]) -> None:
        """End every wait of this party with :class:`RingPeerDied` when one of ``pids`` exits."""
        for pid in pids:
            try:
                self._peers[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                raise RingPeerDied(f"ring peer pid {pid} is gone already", pid) from None

    def writable(self) -> bool:
        """Whether a write would not wait: every reader has read what the next slot holds (a writer's check)."""
        return self._mm[self._flags(self._next % self.spec.slots)] == self._all_read

    def unread_readers(self) -> list[int]:
        """The writer's view of a full ring: the readers that have not read the slot it would write next."""
        flags = self._mm[self._flags(self._next % self.spec.slots)]
        return [r for r in range(self.spec.readers) if not flags[r]]

    def peer_pids(self) -> list[int]:
        """The pids this party watches (:meth:`watch`)."""
        return list(self._peers.values())

    # ----- writing and reading --------------------------------------------------------------

    def write(self, payload: bytes | memoryview, timeout: float | None = None) -> int:
        """Put one message every reader will read; returns its number.  Waits while the ring is full."""
        if self.reader is not None:
            raise RingError(f"reader {self.reader} cannot write to the ring")
        self._check_alive()
        size = len(payload)
        if size > self.spec.slot_bytes:
            raise RingError(f"a message of {size} bytes does not fit a slot of {self.spec.slot_bytes}: send it out of "
                            "band (the object store) and put a reference in the ring")
        slot = self._next % self.spec.slots
        flags = self._flags(slot)
        mm, all_read = self._mm, self._all_read
        if mm[flags] != all_read:
            U32.pack_into(mm, WAITING_AT, 1)
            try:
                self._wait(lambda: mm[flags] == all_read, timeout, "a free slot (every reader done with it)", WRITER_SLICE_S)
            finally:
                U32.pack_into(mm, WAITING_AT, 0)
        base = self._bases[slot]
        mm[flags] = bytes(self.spec.readers)
        body = base + SEQ_LEN.size + MAX_READERS
        mm[body:body + size] = payload
        U64.pack_into(mm, base + 8, size)
        U64.pack_into(mm, base, self._next + 1)  # published last
        for bell in self._reader_bells:
            os.eventfd_write(bell, 1)
        self._next += 1
        return self._next - 1

    def read(self, timeout: float | None = None) -> bytes:
        """The next message (a copy), waiting for it."""
        if self.reader is None:
            raise RingError("the writer cannot read its own ring")
        self._check_alive()
        base = self._bases[self._next % self.spec.slots]
        want, mm = self._next + 1, self._mm
        if U64.unpack_from(mm, base)[0] != want:
            self._wait(lambda: U64.unpack_from(mm, base)[0] == want, timeout, f"message {self._next}")
        return self._take(base)

    def poll(self) -> bytes | None:
        """The next message if it is in (a copy), else ``None`` at once: for a party that waits on
        several rings together (:meth:`wait_fds`, then ``poll`` or ``epoll``) instead of blocking on one."""
        if self.reader is None:
            raise RingError("the writer cannot read its own ring")
        base = self._bases[self._next % self.spec.slots]
        if U64.unpack_from(self._mm, base)[0] != self._next + 1:
            self._check_alive()
            return None
        return self._take(base)

    def _take(self, base: int) -> bytes:
        """Copy out the message published at ``base`` and mark it read by this reader."""
        mm = self._mm
        size = U64.unpack_from(mm, base + 8)[0]
        body = base + SEQ_LEN.size + MAX_READERS
        out = mm[body:body + size]
        mm[base + SEQ_LEN.size + self.reader] = 1
        if U32.unpack_from(mm, WAITING_AT)[0]:  # the writer waits for a free slot: maybe this one
            os.eventfd_write(self._writer_bell, 1)
        self._next += 1
        return out

    def wait_fds(self) -> list[int]:
        """What to ``poll`` on to wake when this party may go on: its doorbell, then its peers' pidfds."""
        return [self._bell, *self._peers]

    def check_peers(self, readable: Sequence[int]) -> None:
        """Raise :class:`RingPeerDied` if one of ``readable`` (from ``poll`` on :meth:`wait_fds`) is
        a peer's pidfd; drain the doorbell if it is among them."""
        for fd in readable:
            if fd in self._peers:
                raise RingPeerDied(f"ring peer pid {self._peers[fd]} exited", self._peers[fd])
            if fd == self._bell:
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    pass

    def abort(self) -> None:
        """Make every party's waits raise :class:`RingError` (a party gives up; the ring is dead).

        A no-op once this party has closed its end."""
        try:
            U32.pack_into(self._mm, ABORTED_AT, 1)
        except (TypeError, ValueError):  # closed (by another thread of this party, too)
            return
        for bell in [self._writer_bell, *self._reader_bells]:
            os.eventfd_write(bell, 1)

    @property
    def aborted(self) -> bool:
        return U32.unpack_from(self._mm, ABORTED_AT)[0] != 0

    def close(self) -> None:
        """Unmap and close this party's fds (the kernel frees the ring with the last one).

        A ring dropped without closing is closed when it is collected."""
        self._release()

    @staticmethod
    def _free(mm: mmap.mmap, fds: list[int], peers: dict[int, int]) -> None:
        mm.close()
        for fd in [*fds, *peers]:
            try:
                os.close(fd)
            except OSError:
                pass
        fds.clear()
        peers.clear()

    # ----- internals ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.aborted:
            raise RingError("the ring was aborted by one of its parties; open a new one")

    def _flags(self, slot: int) -> slice:
        start = self._bases[slot] + SEQ_LEN.size
        return slice(start, start + self.spec.readers)

    def _wait(self, ready, timeout: float | None, what: str, slice_s: float = POLL_SLICE_S) -> None:
        """Until ``ready()``: spin up to ``spin_s``, then block on the doorbell and the peers' pidfds."""
        if ready():
            return
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_end = time.perf_counter() + self.spin_s
        while time.perf_counter() < spin_end:
            os.sched_yield()
            if ready():
                return
        poller = select.poll()
        for fd in (self._bell, *self._peers):
            poller.register(fd, select.POLLIN)
        while True:
            if self.aborted:
                raise RingError(f"the ring was aborted while this party waited for {what}")
            left = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
            if left <= 0:
                party = "writer" if self.reader is None else f"reader {self.reader}"
                raise RingTimeout(f"ring {party}: no {what} within {timeout:g} s")
            readable = [fd for fd, _ in poller.poll(left * 1000.0)]
            for fd in readable:
                if fd in self._peers:
                    pid = self._peers[fd]
                    raise RingPeerDied(f"ring peer pid {pid} exited while this party waited for {what}", pid)
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    pass
            if ready():
                return


def send_ring(conn: socket.socket, ring: Ring) -> None:
    """Hand ``ring``'s fds and the writer's pid to the process at the other end of Unix socket ``conn``."""
    meta = json.dumps({"pid": os.getpid()}).encode()
    socket.send_fds(conn, [struct.pack("<I", len(meta)) + meta], ring.fds())


def receive_ring(conn: socket.socket, reader: int, spin_s: float | None = None) -> Ring:
    """Reader ``reader``'s end of the ring :func:`send_ring` sent; it watches the writer's pid.

    The received fds are closed if anything fails (they would otherwise stay open in this process)."""
    data, fds, _, _ = socket.recv_fds(conn, 4096, MAX_READERS + 2)
    try:
        if len(data) < 4:
            raise RingError("the ring's sender closed the socket before sending it")
        (size,) = struct.unpack_from("<I", data, 0)
        pid = int(json.loads(data[4:4 + size])["pid"])
    except BaseException:
        _close_fds(fds)
        raise
    ring = Ring.attach(fds, reader, spin_s)  # closes them itself on a refusal
    try:
        ring.watch([pid])
    except BaseException:
        ring.close()
        raise
    return ring


def _close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
