"""Reader processes for tests/test_ring.py and scripts/bench_ring.py (started with multiprocessing's spawn).

Each connects to the writer's Unix socket, receives its end of the ring (:func:`rankmesh.ring.receive_ring`)
and then does what its function says; results go back over the same socket as one JSON line.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import time
from dataclasses import replace

from rankmesh.backends.ray.wire import decode_call
from rankmesh.dispatch import Dispatch, register
from rankmesh.errors import RingError
from rankmesh.mesh import RankMesh
from rankmesh.ring import Ring, RingSpec, receive_ring, send_ring
from rankmesh.worker import Worker, WorkerContext, construct, invoke


def ring_fds() -> list[str]:
    """This process's fds of rings: anonymous memfds (``memfd:rankmesh-ring``) and eventfds.

    A ring is never named in ``/dev/shm``, so a leak shows only here, as open fds."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "rankmesh-ring" in target or "eventfd" in target:
            found.append(target)
    return sorted(found)


def connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock


def answer(sock: socket.socket, value: dict) -> None:
    sock.sendall(json.dumps(value).encode() + b"\n")


def read_messages(address: str, reader: int, count: int, pause_s: float = 0.0) -> None:
    """Read ``count`` messages; answer the number each carried in its first 8 bytes (little-endian),
    in the order read, and their sizes; then try to write, which a reader may not."""
    sock = connect(address)
    ring = receive_ring(sock, reader)
    numbers, sizes = [], []
    for _ in range(count):
        msg = ring.read(timeout=30)
        numbers.append(struct.unpack_from("<Q", msg, 0)[0])
        sizes.append(len(msg))
        if pause_s:
            time.sleep(pause_s)
    try:
        ring.write(b"x")
        refused = None
    except RingError as exc:
        refused = str(exc)
    answer(sock, {"pid": os.getpid(), "count": count, "numbers": numbers, "sizes": sizes, "write_refused": refused})
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


class NoopWorker(Worker):
    """A rankmesh Worker whose method does nothing: what a call costs around the method."""

    @register(Dispatch.ONE_TO_ALL)
    def noop(self, value: int) -> int:
        return value


def echo(address: str, reader: int, calls: bool = False, world: int = 1) -> None:
    """Serve round trips until b"stop": write each message back on this reader's own reply ring.

    ``calls``: each message is a rankmesh call: the first one of a method installs its header
    (:mod:`rankmesh.backends.ray.wire`) under a slot number, later ones send the slot and their
    arguments; the reader runs it on a :class:`NoopWorker` through :func:`rankmesh.worker.invoke`, as a
    rank's host does, and answers the pickled output.
    """
    sock = connect(address)
    ring = receive_ring(sock, reader)
    reply = Ring.create(RingSpec(readers=1, slots=4, slot_bytes=4096))
    send_ring(sock, reply)
    slots: dict = {}
    worker = construct(NoopWorker, WorkerContext(rank=reader, world_size=world, mesh=RankMesh(dp=world))) if calls else None
    while True:
        msg = ring.read(timeout=None)
        if msg == b"stop":
            break
        if worker is not None:
            kind, slot, body = pickle.loads(msg)
            if kind == "install":  # the header once, kept by slot (as the Ray path's call slots do)
                slots[slot] = decode_call(body, ())
                call = slots[slot]
            else:  # the slot and this call's arguments
                call = replace(slots[slot], args=body)
            out = invoke(worker, call.method, call.args, call.kwargs, return_output=call.return_output)
            msg = pickle.dumps(out, protocol=5)
        reply.write(msg, timeout=30)
    ring.close()
    reply.close()
