"""Call sessions: a group's calls to the ranks on one node through one shared-memory ring, not one Ray task per rank.

Why: a Ray task costs its sender about 0.2 ms of CPU per rank, so a call's fan-out grows with
ranks (``docs/control_plane.md``).  A session is opened once per group and node: its writer (the
controller for its own node, a node agent for another, :mod:`.agent`) puts one message per call
into a command ring (:mod:`rankmesh.ring`) that every local rank's host reads, and each host
answers on its own reply ring (the host's end is :mod:`.serve`).  Ray still places, starts,
watches and stops the processes, and still carries data: a session call has only inline
arguments (:mod:`.wire`, "a header holds no ObjectRef").

This module is the writer's end, one carrier of the transport (:class:`.calls.Carrier`):
:meth:`CallSession.prepare` takes a call record that has only inline arguments, is blocking,
names only this session's ranks and fits a slot, and declines the others (they take Ray's
tasks); :meth:`CallSession.send` writes it; :meth:`CallSession.poll` says which ranks answered.
Every wait is bounded: a write waits for a free slot no longer than the call's deadline
(:class:`~rankmesh.errors.RingTimeout` names the readers that did not read), opening no longer
than ``timeout_s``, and a parked output's fetch no longer than :data:`TAKE_PARKED_S`.  The
session may be used from several threads: writes are serialized (so the ring carries calls in
call-id order), and answers read by one thread for another's call are kept for it.

**Failures.**  A host whose process exits is seen at once through its pidfd and answered as a
:class:`~rankmesh.errors.WorkerDiedError` naming the rank; a host whose session thread ended
aborts its reply ring, answered as a :class:`~rankmesh.errors.RingError` (the group then opens a
new session).  The writer's exit ends every host's session thread (they watch its pid).  Rings
are anonymous memfds: nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import logging
import pickle
import select
import socket
import struct
import threading
import time
import uuid
from typing import Any, Iterable, Mapping, Sequence

from rankmesh.deadline import Deadline
from rankmesh.errors import RingError, RingPeerDied, RingTimeout, WorkerDiedError
from rankmesh.mesh import RankCoords
from rankmesh.ring import Ring, RingSpec, check_platform, receive_ring, send_ring

from .calls import CallRecord, Outcome, Pending
from .waiting import task_error
from .files import FilePool, let_go, probe, take_released
from .files import forget as forget_files
from .wire import (COMMAND_BYTES, COMMAND_SLOTS, ERROR, MAPPED, PARKED, STOP, Command, command_plan, decode_answer,
                   encode_command)

logger = logging.getLogger(__name__)

#: The longest a parked output's fetch (one ``take_parked`` Ray call) may take (seconds).
TAKE_PARKED_S = 120.0
#: Reusable selections whose command plans a session keeps (by key; others are planned per call).
PLANS_MAX = 4096
#: Bytes a node's command may grow by between the controller sizing it and its agent writing it
#: (the agent sets the command's floor from what its ranks still owe).
COMMAND_MARGIN = 64


class CallSession:
    """The writer's end of one group's session with its ranks on one node (a carrier: ``name = "session"``).

    ``ranks`` read the command ring in this order (reader ``i`` is ``ranks[i]``); ``actors``,
    ``pids``, ``nodes`` and ``coords`` are indexed by rank.
    """

    name = "session"

    def __init__(self, ranks: Sequence[int], actors: Sequence[Any] | Mapping[int, Any], pids: Mapping[int, int],
                 nodes: Sequence[str | None], coords: Sequence[RankCoords | None]) -> None:
        check_platform()
        self.ranks = tuple(ranks)
        self.served = frozenset(self.ranks)
        self.reader_of = {rank: i for i, rank in enumerate(self.ranks)}
        self.actors = {rank: actors[rank] for rank in self.ranks}
        self.pids = {rank: pids[rank] for rank in self.ranks}
        self.nodes, self.coords = list(nodes), list(coords)
        self.ring: Ring | None = None
        self.replies: dict[int, Ring] = {}
        self._write_lock = threading.Lock()  # one writer at a time: the ring carries calls in id order
        self._read_lock = threading.Lock()  # reply rings, the answers read ahead, the epoll set
        self._sleep_lock = threading.Lock()  # held by the one poller sleeping on the doorbells (poll)
        self._drained = threading.Condition()  # notified when that poller drained doorbells or stopped sleeping
        self._drains = 0  # how many times a poller drained doorbells (poll: look again after one)
        self._owed: dict[int, list[int]] = {rank: [] for rank in self.ranks}  # per rank: calls sent, answer not taken
        self._unwanted: set[int] = set()  # calls given up: their answers are dropped as they come
        self._answers: dict[tuple[int, int], tuple[int, Any]] = {}  # (rank, call id) -> answer read ahead
        self._broken: dict[int, BaseException] = {}  # rank -> why its reply ring cannot be read any more
        self._epoll: select.epoll | None = None  # every reply ring's doorbell and host pidfd, registered once
        self._rank_of_fd: dict[int, int] = {}
        self._exited: set[int] = set()  # ranks whose host process exited
        self._rung: set[int] = set()  # ranks whose doorbell was drained and whose reply ring was not read empty since
        self._plans: dict[int, tuple[int | None, ...]] = {}  # a reusable selection's key -> the command's plan
        #: The memory files large call arguments go to for the ranks to map (:mod:`.files`), and
        #: whether every host could open one when it joined (else large arguments take the store).
        self.files = FilePool()
        self.maps_arguments = False
        self._host_files: set[str] = set()  # the tokens of the hosts' output pools (their reports go back to them)

    # ----- opening and closing ----------------------------------------------------------------

    def open(self, timeout_s: float = 30.0) -> None:
        """Hand each host the ring and take its reply ring, within ``timeout_s``.

        On failure every host that joined is told to leave (the ring is aborted, which ends its
        session thread) and every fd is closed, so nothing of a failed open stays behind.  Each
        host also tries to open a small memory file of this process (:func:`.files.probe`):
        :attr:`maps_arguments` says whether all could.
        """
        import ray  # deferred: agents and the controller have Ray; the module itself needs only its handles

        address = f"\0rankmesh-session-{uuid.uuid4().hex}"
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = Deadline.after(timeout_s)
        try:
            server.bind(address)
            server.listen(len(self.ranks))
            server.settimeout(0.2)
            self.ring = Ring.create(RingSpec(readers=len(self.ranks), slots=COMMAND_SLOTS, slot_bytes=COMMAND_BYTES))
            probed = probe(self.files)
            sent_probe = pickle.dumps(probed)
            opened = [self.actors[rank].open_session.remote(address, i, sent_probe) for i, rank in enumerate(self.ranks)]
            for _ in self.ranks:
                while True:
                    try:
                        conn, _ = server.accept()
                        break
                    except socket.timeout:
                        done, _ = ray.wait(opened, num_returns=len(opened), timeout=0)
                        ray.get(done)  # a host that failed to join raises here, at once
                        if deadline.expired():
                            raise TimeoutError(f"ranks did not join the call session within {timeout_s:g} s") from None
                with conn:
                    conn.settimeout(max(0.1, deadline.left()))
                    (reader,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
                    send_ring(conn, self.ring)
                    self.replies[self.ranks[reader]] = receive_ring(conn, 0)
            joined = ray.get(opened, timeout=max(0.1, deadline.left()))
            refused = [why for why, _ in joined if why is not None]
            self._host_files = {token for _, token in joined if token is not None}
            self.maps_arguments = not refused
            if refused:
                logger.info("call session: large call arguments take the object store (a rank cannot open this "
                            "process's memory files: %s)", refused[0])
            del probed
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
        """End the hosts' session threads (``stop``: after the calls they were sent; else at once,
        dropping unread calls) and let go of the rings."""
        with self._write_lock:
            if self.ring is not None:
                try:
                    if stop:
                        self.ring.write(STOP, timeout=1.0)
                    else:
                        self.ring.abort()
                except RingError:  # a host is gone or the ring is full of unread calls: abort instead
                    self.ring.abort()
                self.ring.close()
                self.ring = None
        with self._read_lock:
            for reply in self.replies.values():
                reply.close()
            self.replies = {}
            if self._epoll is not None:
                self._epoll.close()
                self._epoll = None
        self.files.close()
        forget_files(self._host_files)

    # ----- sending ----------------------------------------------------------------------------

    def full(self) -> bool:
        """Whether the next write would wait: a reader has not read the oldest call in the ring (it runs
        an earlier call), so a call to the other ranks is better sent another way."""
        ring = self.ring
        return ring is not None and not ring.writable()

    def prepare(self, call: CallRecord) -> Command | None:
        """The command for ``call``, or ``None``: not inline, a rank this session does not serve, a
        message that does not fit a slot, or a full ring (a reader still runs an earlier call)."""
        if self.ring is None or not call.inline:
            return None
        selection = call.selection
        plan = self._plans.get(selection.key) if selection.key is not None else None
        if plan is None:
            if not self.served.issuperset(selection.ranks):
                return None
            plan = command_plan(self.ranks, selection)
            if selection.key is not None and len(self._plans) < PLANS_MAX:
                self._plans[selection.key] = plan
        if self.full():
            return None
        message = self.encode(Command(call.call_id, call.call_id, tuple(share.header for share in call.shares), plan))
        return None if len(message) > COMMAND_BYTES else message

    def send(self, call: CallRecord, message: bytes) -> list[Pending]:
        """Write ``message`` (``call`` as :meth:`prepare` encoded it) for every reader; one pending per part."""
        self.write(message, call.call_id, call.method, call.deadline, call.ranks)
        return call.pending(self.name, [call.call_id] * len(call.parts))

    def encode(self, command: Command) -> bytes:
        """``command`` as the ring carries it, its floor the oldest call whose answer is still wanted."""
        with self._read_lock:
            wanted = [owed[0] for owed in self._owed.values() if owed and owed[0] not in self._unwanted]
            if self._unwanted:
                wanted = [c for owed in self._owed.values() for c in owed if c not in self._unwanted]
            wanted += [c for (_, c), (status, _) in self._answers.items() if status in (PARKED, MAPPED)]
        floor = min([*wanted, command.call_id])
        released = tuple(take_released(self._host_files)) if self._host_files else ()
        message = encode_command(Command(command.call_id, floor, command.headers, command.plan, released))
        if released and len(message) > COMMAND_BYTES:  # no room: the reports wait for the next command
            for key in released:
                let_go(key)
            message = encode_command(Command(command.call_id, floor, command.headers, command.plan))
        return message

    def write(self, message: bytes, call_id: int, method: str, deadline: Deadline, ranks: Sequence[int]) -> None:
        """Put ``message`` (an encoded command, :meth:`encode`) in the ring; ``ranks``: the readers it calls.

        Waits for a free slot until ``deadline``; past it, :class:`RingTimeout` names the ranks
        that have not read the oldest slot (they still run an earlier call).
        """
        with self._write_lock:
            if self.ring is None:
                raise RingError(f"{method}: the call session is closed")
            try:
                self.ring.write(message, timeout=deadline.timeout())
            except RingTimeout as exc:
                slow = [self.ranks[r] for r in self.ring.unread_readers()]
                raise RingTimeout(f"{method}: the command ring stayed full until the call's deadline: ranks "
                                  f"{slow} have not read their earlier calls ({exc})") from None
            with self._read_lock:
                for rank in ranks:
                    self._owed[rank].append(call_id)

    def last_unanswered(self) -> dict[int, int]:
        """Rank -> the newest call sent to it whose answer is not read yet (what a Ray task waits for there)."""
        with self._read_lock:
            return {rank: owed[-1] for rank, owed in self._owed.items() if owed}

    def give_up(self, pending: Sequence[Pending]) -> None:
        """Nobody will take these calls' answers: drop them as they come (and let their parked outputs go)."""
        with self._read_lock:
            self._unwanted.update(p.handle for p in pending)
            for p in pending:  # answers read ahead for them: a file never opened may be written again
                status, value = self._answers.pop((p.rank, p.handle), (None, None))
                if status == MAPPED:
                    let_go(value[0])

    # ----- answers (the carrier's poll) -------------------------------------------------------

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        """Outcomes of the answered ones among ``pending`` (by index): it waits up to ``within`` for all
        of them, and returns early once one failed (the wait loop's fail-fast needs it at once).

        Several callers may poll at once (threads of one controller).  One of them at a time
        sleeps on the doorbells, outside the lock that guards the answers, so the others send
        calls and read answers meanwhile; the others wait until it drains a doorbell or stops
        sleeping.  The sleeper drains whichever doorbell rang, the answer that rang may be
        another caller's, and a drained doorbell does not ring again for it.  So a poll reads,
        first and after each drain by another, the ranks of its calls whose answer is kept for
        it (read ahead by another poll), whose doorbell was drained and whose reply ring was not
        read empty since (``_rung``), or whose host is gone; after its own drain, the ranks
        whose doorbell rang.  A slice in which none rang reads every rank."""
        end = time.monotonic() + within
        got: dict[int, Outcome] = {}
        waiting: dict[int, list[int]] = {}  # rank -> its pending calls here, oldest first
        for i, p in enumerate(pending):
            waiting.setdefault(p.rank, []).append(i)
        seen = self._drains  # the drains this poll has looked after (only a sleeper drains)
        look: Iterable[int] = list(waiting) if within <= 0 else self._maybe_in(pending, waiting)  # the ranks to read
        while True:
            with self._read_lock:
                failed = False
                for rank in look:
                    for i in waiting.get(rank, ()):
                        outcome = self._take(pending[i])
                        if outcome is None:
                            break  # a rank answers in order: the later ones are not in either
                        got[i] = outcome
                        failed = failed or outcome.error is not None
                    if rank in waiting:
                        left_here = [i for i in waiting[rank] if i not in got]
                        if left_here:
                            waiting[rank] = left_here
                        else:
                            del waiting[rank]
            left = end - time.monotonic()
            if not waiting or left <= 0 or failed:
                return got
            if self._sleep_lock.acquire(blocking=False):  # this poll sleeps on the doorbells
                try:
                    if self._drains != seen:  # another poller drained a doorbell since this one looked
                        seen = self._drains
                        look = self._maybe_in(pending, waiting)
                        continue
                    look = self._wait(left) or list(waiting)
                    seen = self._drains  # its own drain: nobody else sleeps, so nobody else drained
                finally:
                    self._sleep_lock.release()
                    with self._drained:
                        self._drained.notify_all()
            else:  # another poll sleeps on them: wait for its next drain (the doorbell may be this call's)
                with self._drained:
                    if self._drains == seen and self._sleep_lock.locked():
                        self._drained.wait(left)
                    seen = self._drains
                look = self._maybe_in(pending, waiting)

    def _maybe_in(self, pending: Sequence[Pending], waiting: Mapping[int, list[int]]) -> list[int]:
        """The ranks of ``waiting`` whose next answer may be in with no doorbell left to say so:
        kept for it, behind a drained doorbell (``_rung``), or never coming (a broken ring, a host gone)."""
        with self._read_lock:
            return [rank for rank, indices in waiting.items()
                    if rank in self._rung or rank in self._broken or rank in self._exited
                    or (rank, pending[indices[0]].handle) in self._answers]

    def _take(self, p: Pending) -> Outcome | None:
        """``p``'s outcome if its answer is in (reading what its rank answered before it), else ``None``."""
        if p.rank not in self._broken:
            self._read_ahead(p.rank, p.handle)
        answer = self._answers.pop((p.rank, p.handle), None)
        if answer is not None:
            return self._outcome(p, answer)
        if p.rank in self._broken:
            return Outcome(error=self._broken[p.rank])
        if p.rank in self._exited:
            return Outcome(error=self._died(p))
        if any(c <= p.handle for c in self._owed.get(p.rank, ())):
            return None  # not answered yet
        if p.handle in self._unwanted:
            return Outcome()  # a given-up call: answered, nothing to return
        return Outcome(error=RingError(f"rank {p.rank}: the answer to session call {p.handle} is not on this session "
                                       "(it was closed and opened again since)"))

    def _read_ahead(self, rank: int, upto: int) -> None:
        """Read ``rank``'s answers up to call ``upto``, keeping each for whoever takes it (dropped if unwanted)."""
        owed = self._owed[rank]
        reply = self.replies.get(rank)
        while owed and owed[0] <= upto:
            if reply is None:
                self._broken[rank] = RingError(f"rank {rank}: the call session was closed before its answers were read")
                return
            try:
                message = reply.poll()
            except RingError as exc:  # the host's session thread ended (it aborted its reply ring)
                self._broken[rank] = RingError(f"rank {rank}'s call session ended: {exc}")
                return
            if message is None:
                self._rung.discard(rank)  # read empty: its next answer rings the doorbell again
                return
            call_id, status, value, released = decode_answer(message)
            if released:
                self.files.released(rank, released)
            owed.pop(0)
            if call_id in self._unwanted:
                if status == MAPPED:  # never opened: the host may write that file again
                    let_go(value[0])
                if not any(call_id in o for o in self._owed.values()):
                    self._unwanted.discard(call_id)  # every rank answered it: nothing more to drop
                continue
            self._answers[(rank, call_id)] = (status, value)

    def _outcome(self, p: Pending, answer: tuple[int, Any]) -> Outcome:
        status, value = answer
        if status == ERROR:
            return Outcome(error=task_error(p, *value))
        if status == PARKED:  # too big for the reply ring: the host kept it for one Ray task
            import ray

            try:
                return Outcome(ray.get(self.actors[p.rank].take_parked.remote(p.handle), timeout=TAKE_PARKED_S))
            except Exception as exc:  # noqa: BLE001 - the host died meanwhile, or the store failed: the rank's error
                return Outcome(error=exc)
        if status == MAPPED:  # too big for the reply ring: the host wrote it into a memory file to map
            try:
                return Outcome(pickle.loads(value[1]))
            except Exception as exc:  # noqa: BLE001 - the file cannot be opened: the rank's error
                return Outcome(error=exc)
        return Outcome(value)

    def _wait(self, within: float) -> set[int]:
        """Sleep until an answer may be in or a host exits (at most ``within``); the ranks whose
        doorbell rang or host exited.  Called holding ``_sleep_lock``; takes ``_read_lock`` only
        to drain what woke it."""
        epoll = self._epoll
        if epoll is None:
            time.sleep(max(0.0, min(within, 0.05)))
            return set()
        try:
            events = epoll.poll(max(0.0, within))
        except (OSError, ValueError):  # closed meanwhile (the session ended): the next look says so
            return set()
        rang = set()
        with self._read_lock:
            for fd, _ in events:
                rank = self._rank_of_fd[fd]
                reply = self.replies.get(rank)
                if reply is None:
                    continue
                rang.add(rank)
                self._rung.add(rank)
                try:
                    reply.check_peers([fd])
                except RingPeerDied:
                    epoll.unregister(fd)  # a pidfd stays readable: it would wake every wait from now on
                    self._exited.add(rank)
        if events:
            with self._drained:
                self._drains += 1
        return rang

    def _died(self, p: Pending) -> WorkerDiedError:
        return WorkerDiedError(p.rank, p.method, f"its process (pid {self.pids[p.rank]}) exited", p.node,
                               coords={p.rank: p.coords} if p.coords is not None else None)
