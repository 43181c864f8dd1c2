"""Reader processes for tests/test_ring.py and scripts/bench_ring.py (started with multiprocessing's spawn).

Each connects to the writer's Unix socket, receives its end of the ring (:func:`rankmesh.ring.receive_ring`)
and then does what its function says; results go back over the same socket as one JSON line.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time

from rankmesh.errors import RingError
from rankmesh.ring import Ring, RingSpec, receive_ring, send_ring


def connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock


def answer(sock: socket.socket, value: dict) -> None:
    sock.sendall(json.dumps(value).encode() + b"\n")


def read_messages(address: str, reader: int, count: int, pause_s: float = 0.0) -> None:
    """Read ``count`` messages; answer how many, the sum of their first 8 bytes (little-endian) and their sizes."""
    sock = connect(address)
    ring = receive_ring(sock, reader)
    total, sizes = 0, []
    for _ in range(count):
        msg = ring.read(timeout=30)
        total += struct.unpack_from("<Q", msg, 0)[0]
        sizes.append(len(msg))
        if pause_s:
            time.sleep(pause_s)
    answer(sock, {"pid": os.getpid(), "count": count, "sum": total, "sizes": sizes})
    ring.close()


def wait_then_report(address: str, reader: int, timeout: float) -> None:
    """Wait for one message; answer which error ended the wait and after how long."""
    sock = connect(address)
    ring = receive_ring(sock, reader)
    answer(sock, {"pid": os.getpid(), "ready": True})
    start = time.monotonic()
    try:
        ring.read(timeout=timeout)
        got = {"error": None}
    except RingError as exc:
        got = {"error": type(exc).__name__, "message": str(exc), "pid": getattr(exc, "pid", None)}
    got["after_s"] = time.monotonic() - start
    answer(sock, got)


def echo(address: str, reader: int) -> None:
    """Serve round trips: read a message, write it back on this reader's own reply ring, until b"stop"."""
    sock = connect(address)
    ring = receive_ring(sock, reader)
    reply = Ring.create(RingSpec(readers=1, slots=4, slot_bytes=4096))
    send_ring(sock, reply)
    while True:
        msg = ring.read(timeout=None)
        if msg == b"stop":
            break
        reply.write(msg, timeout=30)
    ring.close()
    reply.close()
