"""The host's end of a call session: a thread that reads the command ring and answers on the host's reply ring.

The writer's end (the controller, or a node agent) is :mod:`.session`; the messages are
:mod:`.wire`'s.  This module is what every worker process runs of a session, and it imports
neither Ray's waiting nor the controller's modules: only the ring and the wire format.

The thread runs until :data:`~.wire.STOP`, until the writer exits or aborts the ring, or until
its reply cannot be written within :data:`REPLY_WAIT_S` (the writer stopped reading).  Whatever
else goes wrong in it (a bug, a resource limit) is logged, and the thread aborts its reply ring
so that the writer sees at once that this rank's session ended instead of waiting for an answer
that never comes.  It records the sequence number of every call it reads (:class:`SessionState`)
and refuses one that goes back.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from typing import Any, Callable, Sequence

from rankmesh.errors import RingError
from rankmesh.ring import Ring, RingSpec, receive_ring, send_ring

from .files import FilePool, take_released
from .wire import ERROR, OK, REPLY_BYTES, REPLY_SLOTS, STOP, CallHeader, decode_command, encode_answer, error_parts, reusable

logger = logging.getLogger(__name__)

#: The longest an answer waits for room on the reply ring (the writer reads every answer it is
#: owed before it sends the rank another call, so a full ring means the writer is gone or stuck).
REPLY_WAIT_S = 300.0
#: Decoded headers kept per session (a group binds a fixed set of methods); only those whose
#: arguments are immutable (:func:`.wire.reusable`).
DECODED_MAX = 1024

#: ``run(header, seq, enter_ns)``: run one call on the host (under its lock).
Run = Callable[[CallHeader, int, int], Any]


class SessionState:
    """What a host's session thread knows: outputs parked for ``take_parked`` (or the memory files
    of mapped ones, kept open until the writer read them), the last call it read,
    and the last call it finished (what a Ray task sent after session calls waits for: :meth:`wait_done`).

    Shared by the session thread, the host's control thread (``take_parked``) and Ray's thread
    (``execute_after``), hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._parked: dict[int, Any] = {}
        self.seq = 0  # the sequence number of the last call read
        self.call_id = 0
        self._done = 0  # the id of the last call this session finished (answered); every earlier one too
        self._ended = False

    def finished(self, call_id: int) -> None:
        with self._changed:
            self._done = max(self._done, call_id)
            self._changed.notify_all()

    def end(self) -> None:
        """The session is over: calls it had not read will never run, so nobody waits for them."""
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_done(self, call_id: int, timeout: float | None) -> bool:
        """Wait until call ``call_id`` (and every earlier one) finished or the session ended; False past ``timeout``."""
        with self._changed:
            return self._changed.wait_for(lambda: self._ended or self._done >= call_id, timeout)

    def park(self, call_id: int, output: Any) -> None:
        with self._lock:
            self._parked[call_id] = output

    def take(self, call_id: int) -> Any:
        with self._lock:
            try:
                return self._parked.pop(call_id)
            except KeyError:
                raise RingError(f"no parked output of session call {call_id} (dropped: the call was given up)") from None

    def drop_below(self, floor: int) -> None:
        with self._lock:
            for call_id in [c for c in self._parked if c < floor]:
                del self._parked[call_id]

    def clear(self) -> None:
        with self._lock:
            self._parked.clear()

    @property
    def parked(self) -> int:
        with self._lock:
            return len(self._parked)


def serve(ring: Ring, reply: Ring, run: Run, state: SessionState, rank: Callable[[], int | None],
          files: FilePool | None = None) -> None:
    """A host's session thread: run every call the ring brings for this reader, answer each on ``reply``.

    ``files``: where outputs too big for a reply slot go for the writer to map (``None``: they
    are parked for ``take_parked``).  Each answer reports the writer's files this process let
    go of; each command, the host's files the writer let go of.
    """
    decoded: dict[bytes, CallHeader] = {}
    try:
        while True:
            message = ring.read(timeout=None)  # idle: blocks in the kernel, ends when the writer exits
            if message == STOP:
                return
            command = decode_command(message)
            if files is not None and command.released:
                files.released("writer", command.released)
            state.drop_below(command.floor)
            piece = command.plan[ring.reader]
            if piece is None:
                state.finished(command.call_id)  # not this rank's: it is done with it as soon as it read it
                continue
            enter_ns = time.time_ns()
            at, seq = piece, command.call_id  # a call's id is its sequence number on every rank
            if seq <= state.seq:
                raise RingError(f"call {command.call_id} has sequence number {seq}, after {state.seq}: out of order")
            state.seq, state.call_id = seq, command.call_id
            header = command.headers[at]
            try:
                call = decoded.get(header)
                if call is None:
                    call = pickle.loads(header)
                    if len(decoded) < DECODED_MAX and reusable(call):
                        decoded[header] = call
                output = run(call, seq, enter_ns)
                call = None  # the arguments' views go now, so the answer can report them let go
                answer = encode_answer(command.call_id, OK, output, REPLY_BYTES, state.park, files, take_released())
            except Exception as exc:  # noqa: BLE001 - the writer raises it, naming the rank
                call = None
                answer = encode_answer(command.call_id, ERROR, error_parts(exc, rank()), REPLY_BYTES, state.park,
                                       released=take_released())
            output = None
            state.finished(command.call_id)
            reply.write(answer, timeout=REPLY_WAIT_S)
    except RingError as exc:  # the writer is gone, gave the session up, or stopped reading
        logger.debug("call session ends: %s", exc)
    except BaseException:  # anything else: say so, and make the writer see it at once
        logger.exception("rank %s: the call session thread failed; its session ends", rank())
        reply.abort()
    finally:
        state.end()
        ring.close()
        reply.close()
        if files is not None:
            files.close()


def writer_may_open(writers: Sequence[int]) -> bool:
    """Whether the writer (``writers``: its pid) may open this process's files through ``/proc``:
    the kernel lets a process of the same user read another's fds (ptrace's read mode, which
    Yama leaves alone).  Then large outputs are answered as memory files (:data:`.wire.MAPPED`)."""
    try:
        return bool(writers) and all(os.stat(f"/proc/{pid}").st_uid == os.getuid() for pid in writers)
    except OSError:
        return False


def start_serving(ring: Ring, reply: Ring, run: Run, state: SessionState, rank: Callable[[], int | None],
                  files: FilePool | None = None) -> threading.Thread:
    """:func:`serve` on a daemon thread of its own (the host's session thread)."""
    thread = threading.Thread(target=serve, args=(ring, reply, run, state, rank, files), name="rankmesh-session",
                              daemon=True)
    thread.start()
    return thread


def connect(address: str, reader: int, timeout_s: float = 30.0) -> tuple[Ring, Ring]:
    """A host's side of :meth:`.session.CallSession.open`: the command ring as ``reader``, and a new reply ring."""
    import socket
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.sendall(struct.pack("<I", reader))
        ring = receive_ring(sock, reader)
        try:
            reply = Ring.create(RingSpec(readers=1, slots=REPLY_SLOTS, slot_bytes=REPLY_BYTES))
            reply.watch(ring.peer_pids())  # the writer: an answer never waits on a reader that is gone
            send_ring(sock, reply)
        except BaseException:
            ring.close()
            raise
        return ring, reply
