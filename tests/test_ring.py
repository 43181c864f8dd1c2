"""The shared-memory command ring (rankmesh.ring) between real processes: order, back-pressure, dead peers, cleanup.

Readers are separate processes from a fork server (not forked from the writer), so they get their
ends of the ring the way a Ray actor would: fds over a Unix socket.  Expected values are arithmetic on the
messages sent (each message starts with its number as 8 little-endian bytes).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import struct
import time
import uuid

import psutil
import pytest

from rankmesh.errors import RingError, RingPeerDied, RingTimeout
from rankmesh.ring import Ring, RingSpec, send_ring
from tests import ring_workers

# Readers are forked from a fork server (started once, with the reader functions imported), not
# from this process: they share none of its fds, as a Ray actor would not, and start in milliseconds.
SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload(["tests.ring_workers"])


class Writer:
    """A ring, a listening Unix socket and the reader processes connected to it."""

    def __init__(self, spec: RingSpec, target, args_of) -> None:
        self.ring = Ring.create(spec)
        self.address = f"\0rankmesh-ring-test-{uuid.uuid4().hex}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.address)
        self.server.listen(spec.readers)
        self.procs = [SPAWN.Process(target=target, args=(self.address, r, *args_of(r)), daemon=True)
                      for r in range(spec.readers)]
        for p in self.procs:
            p.start()
        self.conns = []
        for _ in self.procs:
            conn, _ = self.server.accept()
            send_ring(conn, self.ring)
            self.conns.append(conn)
        # Which connection is which reader does not matter to the tests; each answers with its pid.
        self.ring.watch([p.pid for p in self.procs])
        self.files = [c.makefile("r") for c in self.conns]

    def answers(self) -> list[dict]:
        return [json.loads(f.readline()) for f in self.files]

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        self.ring.close()
        self.server.close()


def message(k: int, size: int) -> bytes:
    return struct.pack("<Q", k) + bytes(size - 8)


def test_every_reader_reads_every_message_in_order_through_a_full_ring():
    before = ring_workers.ring_fds()
    count = 60
    # 4 slots for 60 messages: the ring wraps 15 times; reader 2 reads slowly, so the writer waits for it.
    w = Writer(RingSpec(readers=3, slots=4, slot_bytes=1024), ring_workers.read_messages,
               lambda r: (count, 0.01 if r == 2 else 0.0))
    try:
        start = time.monotonic()
        for k in range(count):
            w.ring.write(message(k, 8 + (k % 5) * 100), timeout=30)
        answers = w.answers()
        took = time.monotonic() - start
        # Every reader got all 60, each once and in the order written (the number each carried), every size by hand.
        assert [a["numbers"] for a in answers] == [list(range(count))] * 3
        assert all(a["sizes"] == [8 + (k % 5) * 100 for k in range(count)] for a in answers)
        assert all("cannot write" in (a["write_refused"] or "") for a in answers)  # a reader is not the writer
        assert took >= 0.01 * (count - 4)  # the writer was held back by the slow reader, not ahead of it
    finally:
        w.close()
    assert ring_workers.ring_fds() == before  # the writer's memfd and doorbells are closed with it


def test_a_writer_waiting_on_a_killed_reader_raises_naming_it_within_2_s():
    # Both readers want 3 messages; reader 1 is stopped before it reads any, so the 2-slot ring fills.
    w = Writer(RingSpec(readers=2, slots=2, slot_bytes=64), ring_workers.read_messages, lambda r: (3,))
    try:
        victim = w.procs[1]
        os.kill(victim.pid, signal.SIGSTOP)  # it holds its slots unread
        w.ring.write(message(0, 8))
        w.ring.write(message(1, 8))
        os.kill(victim.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RingPeerDied, match=f"pid {victim.pid} exited") as info:
            w.ring.write(message(2, 8), timeout=30)  # the ring is full: waits for the dead reader
        assert info.value.pid == victim.pid and time.monotonic() - start < 2.0
    finally:
        w.close()


def test_a_reader_waiting_on_a_killed_writer_raises_within_2_s_and_nothing_is_left():
    before = ring_workers.ring_fds()
    parent, child = SPAWN.Pipe()
    address = f"\0rankmesh-ring-test-{uuid.uuid4().hex}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(1)
    # The writer is another process this time: it creates the ring, hands it over, then is killed.
    writer = SPAWN.Process(target=_writer_that_waits, args=(address,), daemon=True)
    writer.start()
    conn, _ = server.accept()
    reader = SPAWN.Process(target=_relay_reader, args=(address, child), daemon=True)
    try:
        ring_fds_conn = conn
        reader.start()
        relay, _ = server.accept()
        fds_msg, fds, _, _ = socket.recv_fds(ring_fds_conn, 4096, 8)
        socket.send_fds(relay, [fds_msg], fds)
        for fd in fds:
            os.close(fd)
        assert parent.recv() == "attached"
        os.kill(writer.pid, signal.SIGKILL)
        got = parent.recv()
        assert got["error"] == "RingPeerDied" and got["pid"] == writer.pid and got["after_s"] < 2.0, got
    finally:
        for p in (writer, reader):
            if p.is_alive():
                p.kill()
            p.join(10)
        server.close()
    assert ring_workers.ring_fds() == before  # the fds relayed through this process were closed here


def _writer_that_waits(address: str) -> None:
    ring = Ring.create(RingSpec(readers=1, slots=2, slot_bytes=64))
    sock = ring_workers.connect(address)
    send_ring(sock, ring)
    time.sleep(600)


def _relay_reader(address: str, pipe) -> None:
    from rankmesh.ring import receive_ring

    sock = ring_workers.connect(address)
    ring = receive_ring(sock, 0)
    pipe.send("attached")
    start = time.monotonic()
    try:
        ring.read(timeout=60)
        pipe.send({"error": None})
    except RingError as exc:
        pipe.send({"error": type(exc).__name__, "pid": getattr(exc, "pid", None), "after_s": time.monotonic() - start})


def test_timeouts_abort_and_bad_sizes_are_clear_errors():
    with pytest.raises(RingError, match="RingSpec.readers must be an integer from 1 to 64"):
        RingSpec(readers=0)
    w = Writer(RingSpec(readers=1, slots=2, slot_bytes=64), ring_workers.wait_then_report, lambda r: (0.3,))
    try:
        w.answers()
        got = w.answers()[0]  # no message comes: the reader's wait ends at its deadline
        assert got["error"] == "RingTimeout" and 0.3 <= got["after_s"] < 1.5, got
        with pytest.raises(RingError, match="100 bytes does not fit a slot of 64.*out of band"):
            w.ring.write(bytes(100))
        w.ring.abort()
        with pytest.raises(RingError, match="aborted"):
            w.ring.write(bytes(8), timeout=5)  # slot 0 was never read: the writer would wait, but the ring is dead
    finally:
        w.close()


def test_a_blocked_reader_uses_no_cpu():
    w = Writer(RingSpec(readers=1, slots=2, slot_bytes=64), ring_workers.wait_then_report, lambda r: (30.0,))
    try:
        w.answers()
        proc = psutil.Process(w.procs[0].pid)
        time.sleep(0.3)
        cpu = proc.cpu_times()
        time.sleep(1.0)
        later = proc.cpu_times()
        assert (later.user + later.system) - (cpu.user + cpu.system) < 0.05  # blocked in select, not spinning
        w.ring.write(message(7, 8))
        assert w.answers()[0]["error"] is None
    finally:
        w.close()


def test_a_ring_refuses_the_wrong_party():
    ring = Ring.create(RingSpec(readers=1, slots=2, slot_bytes=64))
    try:
        with pytest.raises(RingError, match="writer cannot read"):
            ring.read(timeout=0.1)
        with pytest.raises(RingTimeout):
            ring.write(bytes(8))
            ring.write(bytes(8))
            ring.write(bytes(8), timeout=0.1)  # 2 slots, no reader reading: full
    finally:
        ring.close()


def test_a_ring_refused_on_receipt_leaves_no_fd_open():
    """``attach`` owns the fds it is given: refusing them (too few for the ring's readers), it closes them."""
    ring = Ring.create(RingSpec(readers=2, slots=2, slot_bytes=64))
    try:
        before = ring_workers.ring_fds()
        fds = [os.dup(fd) for fd in ring.fds()[:3]]  # the memfd and two doorbells: one short
        assert len(ring_workers.ring_fds()) == len(before) + 3
        with pytest.raises(RingError, match="cannot attach as reader 0"):
            Ring.attach(fds, 0)
        assert ring_workers.ring_fds() == before
    finally:
        ring.close()
