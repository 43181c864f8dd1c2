"""Call sessions: a group's calls to the ranks on the controller's node through one shared-memory ring, not one Ray task per rank.

Why: a Ray task costs the controller about 0.2 ms of CPU per rank, so a call's fan-out grows with
ranks (``docs/control_plane.md``).  A session is opened once per group: the controller writes one
message per call into a command ring (:mod:`rankmesh.ring`) that every local rank's host reads,
and each host answers on its own reply ring.  Ray still places, starts, watches and stops the
processes, and still carries data: a session call has only inline arguments.

**Which calls take a session** (:meth:`CallSession.takes`): blocking calls on ranks that all
read the session, whose arguments travel inside the call (no :class:`~rankmesh.backend.Shared`
object: a batch in the object store goes with its Ray task, as before, since an ObjectRef
pickled outside Ray's own serialization stays pinned for good) and whose message fits a slot.
Non-blocking calls take Ray: their handles are ObjectRefs that other groups' workers fetch.

**Order.**  A rank runs its calls in the order the controller sent them, whichever path each took:

* a session call after Ray calls: each rank's piece carries how many Ray calls the controller had
  sent that rank (:class:`RayCallCount`); the host runs the piece once it has run that many;
* a Ray call after session calls: the controller first reads what the rank still owes on its
  reply ring (:meth:`CallSession.drain`; only a failed call leaves answers unread).

**Failures.**  A host whose process exits is seen at once through its pidfd and reported as
:class:`~rankmesh.errors.WorkerDiedError` naming the rank; a call past its timeout asks the ranks
where they are, as on the Ray path (:mod:`.hangs`).  The controller's exit ends every host's
session thread (they watch its pid).  Rings are anonymous memfds: nothing is left in ``/dev/shm``.

Messages (pickled): a call is ``(call_id, headers, plan)``, ``headers`` the distinct encoded
:class:`~.wire.CallHeader` of the call and ``plan[reader]`` either ``None`` (not called) or
``(header index, Ray calls to wait for)``; an answer is ``(call_id, status, value)``.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ray import cloudpickle

from rankmesh.backend import RankCall, Shared
from rankmesh.errors import RingError, RingPeerDied, WorkerDiedError, WorkerError
from rankmesh.mesh import RankCoords
from rankmesh.ring import Ring, RingSpec, check_platform, receive_ring, send_ring
from rankmesh.tracing.recorder import FETCH

from .waiting import FAIL_GRACE, POLL_INTERVAL, Inspect, combine_errors, task_error, timed_out, warn_stall
from .wire import HeaderCache, encode_rank_call

logger = logging.getLogger(__name__)

#: ``RANKMESH_CONTROL``: ``auto`` (the default) opens a session where it can; ``ray`` keeps every
#: call on Ray's task-per-rank path.
CONTROL_ENV = "RANKMESH_CONTROL"
CONTROL_MODES: tuple[str, ...] = ("auto", "ray")
#: Command ring: calls in flight, and the largest call message (bigger ones take Ray).
COMMAND_SLOTS = 8
COMMAND_BYTES = 1 << 20
#: Reply rings: answers in flight, and the largest answer (bigger ones are parked: :data:`PARKED`).
REPLY_SLOTS = 4
REPLY_BYTES = 1 << 20
STOP = b"stop"
OK, ERROR, PARKED = 0, 1, 2  # answer statuses; PARKED: fetch the output with WorkerHost.take_parked


def control_mode(environ: Mapping[str, str] | None = None) -> str:
    """The ``RANKMESH_CONTROL`` setting, checked."""
    value = (os.environ if environ is None else environ).get(CONTROL_ENV, "auto").strip().lower() or "auto"
    if value not in CONTROL_MODES:
        raise ValueError(f"{CONTROL_ENV}={value!r}: expected one of {', '.join(CONTROL_MODES)}")
    return value


@dataclass(frozen=True)
class SessionPending:
    """One rank's share of a session call (the Ray path's :class:`.waiting.Pending`, without a reference)."""

    call_id: int
    rank: int
    method: str
    node: str | None = None
    coords: RankCoords | None = None


@dataclass
class RayCallCount:
    """Ray-path calls the controller sent each rank's current process (what a session piece waits for).

    Kept with the actor handle it counts for, so a replaced rank's new process counts from zero.
    """

    counts: dict[int, tuple[Any, int]] = field(default_factory=dict)

    def sent(self, rank: int, actor: Any) -> None:
        held, n = self.counts.get(rank, (actor, 0))
        self.counts[rank] = (actor, (n if held is actor else 0) + 1)

    def of(self, rank: int, actor: Any) -> int:
        held, n = self.counts.get(rank, (None, 0))
        return n if held is actor else 0


#: Inline bytes (str and bytes arguments) a session call may carry in all, so that its message
#: always fits a command slot (headers add little; a broadcast argument is encoded once).
INLINE_LIMIT = COMMAND_BYTES // 4


def fits_a_session(calls: Sequence[RankCall]) -> bool:
    """Blocking, timed by nobody later (no ``keep``), no object-store argument, small inline arguments."""
    inline = 0
    for call in calls:
        if not call.blocking or call.keep:
            return False
        for value in (*call.args, *call.kwargs.values()):
            if isinstance(value, Shared):
                return False
            if isinstance(value, (str, bytes)):
                inline += len(value)
    return inline <= INLINE_LIMIT


class CallSession:
    """The controller's end of one group's session with its ranks on this node.

    ``ranks`` read the command ring in this order (reader ``i`` is ``ranks[i]``); ``actors``,
    ``pids``, ``nodes`` and ``coords`` are indexed by rank.  Opening hands each host the ring and
    takes its reply ring (:meth:`open`); ``timeout_s`` bounds that handshake.
    """

    def __init__(self, ranks: Sequence[int], actors: Sequence[Any], pids: Mapping[int, int],
                 nodes: Sequence[str | None], coords: Sequence[RankCoords | None]) -> None:
        check_platform()
        self.ranks = tuple(ranks)
        self.reader_of = {rank: i for i, rank in enumerate(self.ranks)}
        self.actors = {rank: actors[rank] for rank in self.ranks}
        self.pids = {rank: pids[rank] for rank in self.ranks}
        self.nodes, self.coords = list(nodes), list(coords)
        self.ring: Ring | None = None
        self.replies: dict[int, Ring] = {}
        self._next_id = 1
        self._owed: dict[int, list[int]] = {rank: [] for rank in self.ranks}  # sent, answers unread
        self._given_up = threading.Event()
        self._epoll: select.epoll | None = None  # every reply ring's doorbell and host pidfd, registered once
        self._rank_of_fd: dict[int, int] = {}
        self._exited: set[int] = set()  # ranks whose host process exited

    # ----- opening and closing ----------------------------------------------------------------

    def open(self, timeout_s: float = 30.0) -> None:
        import ray  # deferred: the module is imported by hosts too, which have Ray already

        address = f"\0rankmesh-session-{uuid.uuid4().hex}"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(address)
            server.listen(len(self.ranks))
            server.settimeout(0.2)
            self.ring = Ring.create(RingSpec(readers=len(self.ranks), slots=COMMAND_SLOTS, slot_bytes=COMMAND_BYTES))
            opened = [self.actors[rank].open_session.remote(address, i) for i, rank in enumerate(self.ranks)]
            deadline = time.monotonic() + timeout_s
            for _ in self.ranks:
                while True:
                    try:
                        conn, _ = server.accept()
                        break
                    except socket.timeout:
                        done, _ = ray.wait(opened, num_returns=len(opened), timeout=0)
                        ray.get(done)  # a host that failed to join raises here, at once
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"ranks did not join the call session within {timeout_s:g} s") from None
                with conn:
                    conn.settimeout(timeout_s)
                    (reader,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
                    send_ring(conn, self.ring)
                    self.replies[self.ranks[reader]] = receive_ring(conn, 0)
            ray.get(opened, timeout=timeout_s)
            self.ring.watch(list(self.pids.values()))
            self._epoll = select.epoll()
            for rank, reply in self.replies.items():
                for fd in reply.wait_fds():
                    self._epoll.register(fd, select.EPOLLIN)
                    self._rank_of_fd[fd] = rank
        except BaseException:
            self.close(stop=False)
            raise
        finally:
            server.close()

    def close(self, stop: bool = True) -> None:
        """Tell the hosts to end their session threads (``stop``), then let go of the rings."""
        if self.ring is not None:
            if stop:
                try:
                    self.ring.write(STOP, timeout=1.0)
                except RingError:  # a host is gone or the ring is full of unread calls: abort instead
                    self.ring.abort()
            self.ring.close()
            self.ring = None
        for reply in self.replies.values():
            reply.close()
        self.replies = {}
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    def give_up(self) -> None:
        """From another thread: make a :meth:`fetch` in progress raise within :data:`POLL_INTERVAL`."""
        self._given_up.set()

    # ----- calls -------------------------------------------------------------------------------

    def takes(self, calls: Sequence[RankCall]) -> bool:
        """Whether this call goes through the session (see the module docstring)."""
        return self.ring is not None and all(c.rank in self.reader_of for c in calls) and fits_a_session(calls)

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall], after: Mapping[int, int],
               cache: HeaderCache | None = None) -> list[SessionPending] | None:
        """Write the call for every rank at once; ``None`` (nothing sent) if it does not fit a slot.

        ``after[rank]``: the Ray-path calls the rank must have run first (:class:`RayCallCount`)."""
        assert self.ring is not None
        headers: list[bytes] = []
        index: dict[tuple[Any, ...], int] = {}
        plan: list[tuple[int, int] | None] = [None] * len(self.ranks)
        marked = False
        for call in calls:
            fetch_mark = call.trace and not marked  # the first rank of a traced call (rankmesh.tracing.recorder)
            marked = marked or fetch_mark
            key = (tuple(map(id, call.args)), tuple((k, id(v)) for k, v in call.kwargs.items()),
                   call.return_output, call.trace, call.receive, fetch_mark)
            at = index.get(key)
            if at is None:
                at = index[key] = len(headers)
                headers.append(encode_rank_call(role, method, call, cache, fetch_mark)[0])
            plan[self.reader_of[call.rank]] = (at, after.get(call.rank, 0))
        call_id = self._next_id
        message = pickle.dumps((call_id, headers, plan), protocol=5)
        if len(message) > self.ring.spec.slot_bytes:
            return None
        self.ring.write(message)
        self._next_id += 1
        pending = []
        for call in calls:
            self._owed[call.rank].append(call_id)
            pending.append(SessionPending(call_id, call.rank, method, self.nodes[call.rank], self.coords[call.rank]))
        return pending

    def owes(self, ranks: Sequence[int]) -> bool:
        """Whether any of ``ranks`` has session calls whose answers were not read."""
        return any(self._owed.get(rank) for rank in ranks)

    def drain(self, ranks: Sequence[int], timeout: float | None, on_died: Callable[[WorkerDiedError], None] | None = None,
              inspect: Inspect | None = None) -> None:
        """Read (and drop) every answer ``ranks`` still owe: their session calls are over after this."""
        pending = [SessionPending(owed[-1], rank, "(earlier session calls)", self.nodes[rank], self.coords[rank])
                   for rank in ranks if (owed := self._owed.get(rank))]
        if pending:
            self.fetch(pending, timeout, on_died, None, inspect, errors=False)

    def fetch(self, pending: Sequence[SessionPending], timeout: float | None, on_died: Callable[[WorkerDiedError], None] | None,
              stall_warn_s: float | None, inspect: Inspect | None, errors: bool = True) -> list[Any]:
        """The outputs of ``pending``, in order; fails fast as :func:`.waiting.fetch_outputs` does.

        ``errors=False`` (draining): the ranks' own errors are dropped, deaths and timeouts still raise.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        warn_at = None if stall_warn_s is None or inspect is None else start + stall_warn_s
        results: dict[int, Any] = {}
        failures: list[tuple[SessionPending, BaseException]] = []
        exited: set[int] = set()  # ranks whose host process exited: dead unless their answer is in
        waiting = list(pending)
        look: set[int] = set()  # the ranks to poll: those whose doorbell rang (a ready answer's has) or who exited
        grace_end = None
        while waiting:
            still = []
            for p in waiting:
                if p.rank not in look:
                    still.append(p)
                    continue
                answer = self._answer(p)
                if answer is not None:
                    if answer[0] != ERROR:
                        results[p.rank] = self._value(p, answer)
                    elif errors:
                        failures.append((p, task_error(p, *answer[1])))
                elif p.rank in exited:
                    failures.append((p, self._died(p)))
                else:
                    still.append(p)
            waiting = still
            if failures and grace_end is None:
                grace_end = time.monotonic() + FAIL_GRACE  # ranks failing together are reported together
            now = time.monotonic()
            if not waiting or (grace_end is not None and now >= grace_end):
                break
            if self._given_up.is_set():
                raise RingError(f"{pending[0].method}: the call session was closed while ranks "
                                f"{sorted(p.rank for p in waiting)} still ran it")
            if deadline is not None and now >= deadline:
                raise timed_out(pending, waiting, timeout or 0.0, now - start, on_died, inspect)
            if warn_at is not None and now >= warn_at:
                warn_at = None
                warn_stall(pending, waiting, stall_warn_s or 0.0, now - start, inspect)
            rang, gone = self._wait(waiting, [t for t in (deadline, warn_at, grace_end) if t is not None])
            exited |= gone
            # Nothing rang within the slice: look at every rank once (a doorbell drained by an
            # earlier fetch that did not wait on its rank must not leave an answer unseen).
            look = (rang | exited) or {p.rank for p in waiting}
        if not waiting:
            FETCH.ready_ns = time.time_ns()
        if failures:
            err = combine_errors(failures)
            if isinstance(err, WorkerDiedError) and on_died is not None:
                on_died(err)
            raise err
        return [results[p.rank] for p in pending]

    # ----- internals ---------------------------------------------------------------------------

    def _answer(self, p: SessionPending) -> tuple[int, Any] | None:
        """``p``'s answer if it is in, dropping the answers of older calls nobody reads any more."""
        owed = self._owed[p.rank]
        reply = self.replies[p.rank]
        while owed and owed[0] <= p.call_id:
            message = reply.poll()
            if message is None:
                return None
            call_id, status, value = pickle.loads(message)
            owed.pop(0)
            if call_id == p.call_id:
                return status, value
        raise RingError(f"rank {p.rank}: the answer to session call {p.call_id} was read already")

    def _value(self, p: SessionPending, answer: tuple[int, Any]) -> Any:
        status, value = answer
        if status == PARKED:  # too big for the reply ring: the host kept it for one Ray task
            import ray

            return ray.get(self.actors[p.rank].take_parked.remote(p.call_id))
        return value

    def _wait(self, waiting: Sequence[SessionPending], limits: Sequence[float]) -> tuple[set[int], set[int]]:
        """Sleep until an answer may be in or a host exits (at most :data:`POLL_INTERVAL`).

        Returns the ranks whose doorbell rang and those whose host exited (their pidfds leave the
        epoll set, which would otherwise wake at once from now on).
        """
        assert self._epoll is not None
        left = min([POLL_INTERVAL, *(t - time.monotonic() for t in limits)])
        rang = set()
        for fd, _ in self._epoll.poll(max(0.0, left)):
            rank = self._rank_of_fd[fd]
            try:
                self.replies[rank].check_peers([fd])
                rang.add(rank)
            except RingPeerDied:
                self._epoll.unregister(fd)
                self._exited.add(rank)
        return rang, self._exited & {p.rank for p in waiting}

    def _died(self, p: SessionPending) -> WorkerDiedError:
        return WorkerDiedError(p.rank, p.method, f"its process (pid {self.pids[p.rank]}) exited", p.node,
                               coords={p.rank: p.coords} if p.coords is not None else None)


# ----- the host's end -------------------------------------------------------------------------

#: ``run(header, ray_calls, enter_ns)``: run one call on the host once it has run ``ray_calls`` Ray calls.
Run = Callable[[Any, int, int], Any]


def serve(ring: Ring, reply: Ring, run: Run, park: Callable[[int, Any], None], rank: Callable[[], int]) -> None:
    """A host's session thread: run every call the ring brings for this reader, answer each on ``reply``.

    Ends on :data:`STOP`, when the controller exits or aborts the ring, or when ``reply`` cannot
    be written (the controller stopped reading).  ``park(call_id, output)`` keeps an output too
    big for ``reply`` for the controller to fetch through Ray.
    """
    decoded: dict[bytes, Any] = {}
    try:
        while True:
            message = ring.read(timeout=None)
            if message == STOP:
                return
            call_id, headers, plan = pickle.loads(message)
            piece = plan[ring.reader]
            if piece is None:
                continue
            enter_ns = time.time_ns()
            at, ray_calls = piece
            header = headers[at]
            try:
                call = decoded.get(header)
                if call is None:
                    call = pickle.loads(header)
                    if len(decoded) < 1024:
                        decoded[header] = call
                answer = (call_id, OK, run(call, ray_calls, enter_ns))
            except Exception as exc:  # noqa: BLE001 - the controller raises it, naming the rank
                answer = (call_id, ERROR, _error_parts(exc, rank()))
            reply.write(_encode_answer(answer, park), timeout=None)
    except RingError as exc:  # the controller is gone or gave the session up: nothing to answer
        logger.debug("call session ends: %s", exc)
    finally:
        ring.close()
        reply.close()


def _encode_answer(answer: tuple[int, int, Any], park: Callable[[int, Any], None]) -> bytes:
    call_id, status, value = answer
    try:
        encoded = pickle.dumps(answer, protocol=5)  # a few us, against cloudpickle's ~10 for a small answer
    except Exception:  # noqa: BLE001 - a class or function defined in __main__: by value
        try:
            encoded = cloudpickle.dumps(answer, protocol=5)
        except Exception as exc:  # noqa: BLE001 - an output that does not pickle is the call's error
            encoded = cloudpickle.dumps((call_id, ERROR, _error_parts(exc, -1)), protocol=5)
    if len(encoded) <= REPLY_BYTES:
        return encoded
    park(call_id, value)
    return cloudpickle.dumps((call_id, PARKED, None), protocol=5)


def _error_parts(exc: BaseException, rank: int) -> tuple[BaseException, str]:
    """What travels for a failed call: the error itself if it pickles, else a WorkerError of its text."""
    import traceback

    text = getattr(exc, "remote_traceback", None) or "".join(traceback.format_exception(exc))
    try:
        cloudpickle.dumps(exc)
        return exc, text
    except Exception:  # noqa: BLE001
        return WorkerError(rank, None, "", f"{type(exc).__name__}: {exc}", None, text), text


def start_serving(ring: Ring, reply: Ring, run: Run, park: Callable[[int, Any], None], rank: Callable[[], int]) -> threading.Thread:
    """:func:`serve` on a daemon thread of its own (the host's session thread)."""
    thread = threading.Thread(target=serve, args=(ring, reply, run, park, rank), name="rankmesh-session", daemon=True)
    thread.start()
    return thread


def connect(address: str, reader: int, timeout_s: float = 30.0) -> tuple[Ring, Ring]:
    """A host's side of :meth:`CallSession.open`: the command ring as ``reader``, and a new reply ring."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(address)
        sock.sendall(struct.pack("<I", reader))
        ring = receive_ring(sock, reader)
        reply = Ring.create(RingSpec(readers=1, slots=REPLY_SLOTS, slot_bytes=REPLY_BYTES))
        reply.watch(ring.peer_pids())  # the controller: an answer never waits on a reader that is gone
        send_ring(sock, reply)
        return ring, reply
