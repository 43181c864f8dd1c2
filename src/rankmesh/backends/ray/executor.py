"""RayExecutor: the backend contract (:class:`rankmesh.backend.Backend`) over one group's host processes.

* ``share`` is one ``ray.put`` per distinct object.  Tensors inside a DataProto pickle out of band
  as numpy views, so the put is one memcpy into plasma, and every reader maps it without a copy;
  the data layer's rebuild then gives each rank copy-on-write views (only the pages a rank
  writes are copied; a private copy up front with ``receive="copy"``).
* ``submit`` encodes each rank's call (:mod:`.wire`) and runs it on the rank's host.  Ranks
  outside the collect set run with ``return_output=False`` and send back ``None``.
* ``fetch`` waits fail-fast (:func:`.waiting.fetch_outputs`).  A dead process fails the whole
  group: :meth:`RayExecutor.fail` kills the other ranks (so their blocked collectives end) and
  later calls raise at once.  With ``on_rank_death="keep"`` or ``"replace"`` the survivors are
  kept instead, for :mod:`.recovery` to replace the dead ranks.  A call past its timeout asks
  its unfinished ranks where they are (:meth:`RayExecutor.inspect`, :mod:`.hangs`) and raises
  :class:`~rankmesh.errors.HangError`; past ``stall_warn_s`` it logs the same report once and
  goes on.
* Blocking calls with inline arguments to ranks on the controller's node take the group's call
  session instead (:mod:`.session`: one message for all of them through a shared-memory ring) once
  it is open; ``RANKMESH_CONTROL=ray`` keeps every call on Ray, and a session that cannot be opened
  is logged once and leaves the group on Ray.  :meth:`RayExecutor.control_paths` says which.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray

from rankmesh.backend import RankCall, Shared
from rankmesh.errors import BackendError, RankMeshError, WorkerDiedError
from rankmesh.mesh import RankCoords
from rankmesh.validate import optional_seconds

from rankmesh.sharedmem import register_store_processes

from .hangs import gather_hangs
from .hosts import HostSet
from .runtime import raylet_pids
from .agent import AGENT_FANOUT, AgentPending, AgentSession
from .session import CONTROL_MODES, CallSession, SessionPending, control_mode
from .waiting import Pending, fetch_outputs, ready_indices
from .wire import encode_rank_call, slot_method

logger = logging.getLogger(__name__)


@dataclass
class CallStats:
    """Counters for tests and benchmarks: puts made, calls submitted."""

    puts: int = 0
    calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, puts: int = 0, calls: int = 0) -> None:
        with self.lock:
            self.puts += puts
            self.calls += calls


#: What a group does when a rank's process dies: ``fail`` (stop the others, refuse later calls),
#: ``keep`` (keep the survivors for ``replace_dead_ranks()``), ``replace`` (replace and retry once),
#: ``shrink`` (drop the dead ranks' dp replicas and retry once), ``replace_or_shrink`` (replace;
#: shrink when no process can be had for a dead rank).
ON_RANK_DEATH: tuple[str, ...] = ("fail", "keep", "replace", "shrink", "replace_or_shrink")


@dataclass(frozen=True)
class GroupFetcher:
    """The picklable fetch function of one group's futures (:meth:`RayExecutor.fetcher`).

    Equal for one group (futures of one call merge flat); ``timeout_s`` bounds each fetch.
    Where its group's executor lives (the controller that made it) it fails the group on a dead
    rank and reports hangs, as a blocking call does: it holds the executor by weak reference
    (a future must not keep a shut-down group alive).  The reference does not travel: a fetcher
    unpickled in another process (a worker fetching a future's parts) just raises.
    """

    token: str
    timeout_s: float | None = None
    stall_warn_s: float | None = None
    executor: "weakref.ref[RayExecutor] | None" = field(default=None, compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return GroupFetcher, (self.token, self.timeout_s, self.stall_warn_s)

    def _executor(self) -> "RayExecutor | None":
        return None if self.executor is None else self.executor()

    def __call__(self, handles: Sequence[Any], timeout: float | None = None) -> list[Any]:
        executor = self._executor()
        inspect = None if executor is None else executor.inspect
        return fetch_outputs(handles, self.timeout_s if timeout is None else timeout, self.died, False, self.stall_warn_s, inspect)

    def ready(self, handles: Sequence[Any], timeout: float | None = 0.0) -> list[int]:
        """:class:`rankmesh.backend.ReadyCheck`: which of ``handles`` are done (nothing fetched)."""
        return ready_indices(handles, timeout)

    def died(self, err: WorkerDiedError) -> None:
        """Fail the group this fetcher belongs to, when it lives in this process."""
        executor = self._executor()
        if executor is not None:
            executor.fail(err)


class RayExecutor:
    """:class:`rankmesh.backend.Backend` over the processes of ``hosts`` (one per rank).

    ``coords[r]`` (optional) is rank ``r``'s :class:`~rankmesh.mesh.RankCoords`, for error messages.
    ``call_timeout_s`` bounds every fetch that gives no timeout of its own (``None``: wait as long
    as the ranks run); ``stall_warn_s`` logs where the unfinished ranks are, once per call, when
    a call runs that long (``None``: never).  Role groups spawned from one group share its
    executor: one closed flag, one failure, one set of stats.  ``on_rank_death`` is one of
    :data:`ON_RANK_DEATH`.
    """

    def __init__(
        self,
        hosts: HostSet,
        coords: Sequence[RankCoords] | None = None,
        call_timeout_s: float | None = None,
        stall_warn_s: float | None = None,
        on_rank_death: str = "fail",
    ) -> None:
        if on_rank_death not in ON_RANK_DEATH:
            raise BackendError(f"on_rank_death must be one of {list(ON_RANK_DEATH)}, got {on_rank_death!r}")
        self.hosts = hosts
        self.world_size = len(hosts.actors)
        self.nodes = hosts.nodes
        self.coords = list(coords) if coords is not None else [None] * self.world_size
        self.call_timeout_s = optional_seconds(call_timeout_s, "call_timeout_s", BackendError)
        self.on_rank_death = on_rank_death
        self.stall_warn_s = optional_seconds(stall_warn_s, "stall_warn_s", BackendError)
        self.stats = CallStats()
        #: Encoded slot-only call headers and call slots, one table per host set (:class:`.wire.HeaderCache`).
        self.headers = hosts.headers
        self._failed: RankMeshError | None = None
        self.dead: set[int] = set()  # ranks seen dead since the last replacement
        # Rank calls of failed calls whose outputs no caller will read (see settle()).
        self.abandoned: list[Pending] = []
        self.token = uuid.uuid4().hex
        #: Whether this group may open a call session (``RANKMESH_CONTROL``; detached groups never do:
        #: other drivers may call their processes), the session once open, and why there is none.
        self.control = "ray" if hosts.detached else control_mode()
        self.agent_fanout = AGENT_FANOUT
        self.session: CallSession | AgentSession | None = None
        self.session_note = "detached group" if hosts.detached else ""
        # Outputs fetched here map copy-on-write through the raylet's fd of the object store.
        register_store_processes(raylet_pids())

    @property
    def closed(self) -> bool:
        return self.hosts.closed

    @property
    def failed(self) -> RankMeshError | None:
        return self._failed

    def close(self) -> None:
        """Kill the processes and release their placement groups (idempotent)."""
        self._end_session()
        self.hosts.shutdown()

    def release(self) -> None:
        """End the call session but keep the processes (another group will drive them)."""
        self._end_session()

    # ----- call sessions (.session) -----------------------------------------------------------

    def set_control(self, mode: str, agent_fanout: int | None = None) -> None:
        """``"auto"`` or ``"ray"`` (see ``RayWorkerGroup.set_control``); a session stays open while on Ray.

        A new ``agent_fanout`` closes open node agents; the next call opens them in the new tree."""
        if mode not in CONTROL_MODES:
            raise BackendError(f"set_control(mode): expected one of {', '.join(map(repr, CONTROL_MODES))}, got {mode!r}")
        if mode == "auto" and self.hosts.detached:
            raise BackendError("set_control('auto'): a detached group stays on the Ray path (other drivers may call its processes)")
        if agent_fanout is not None:
            if isinstance(agent_fanout, bool) or not isinstance(agent_fanout, int) or agent_fanout < 1:
                raise BackendError(f"set_control(agent_fanout): expected a positive integer, got {agent_fanout!r}")
            if agent_fanout != self.agent_fanout and isinstance(self.session, AgentSession):
                ranks = list(self.session.ranks)
                if self.session.owes(ranks):  # a failed call's answers: read before the agents go
                    self.session.drain(ranks, self.call_timeout_s, self._session_died, self.inspect)
                self._end_session()
            self.agent_fanout = agent_fanout
        self.control = mode

    def _open_session(self) -> CallSession | AgentSession | None:
        """The group's session, opened on first use; ``None``: Ray only.

        All ranks on the controller's node: the controller writes their ring itself
        (:class:`.session.CallSession`).  Ranks on other nodes: one agent per node serves its
        node's ring, and a call is one Ray task per node (:class:`.agent.AgentSession`).
        """
        if self.control == "ray":
            return None
        if self.session is not None or self.session_note:
            return self.session
        info = self.hosts.info
        if len(info) != self.world_size or not all(i.get("pid") and i.get("node_id") for i in info):
            self.session_note = "the ranks' processes are not all known"
            return None
        here = ray.get_runtime_context().get_node_id()
        node_ids = [i["node_id"] for i in info]
        pids = [i["pid"] for i in info]
        try:
            if set(node_ids) == {here}:
                session: CallSession | AgentSession = CallSession(
                    range(self.world_size), self.hosts.actors, dict(enumerate(pids)), self.nodes, self.coords
                )
            else:
                session = AgentSession(self.hosts.actors, pids, node_ids, self.nodes, self.coords, self.agent_fanout)
            session.open()
        except Exception as exc:  # noqa: BLE001 - the Ray path always works: say why once, and use it
            self.session_note = f"{type(exc).__name__}: {exc}"
            logger.warning("worker group %s: no call session (%s); its calls take the Ray path", self.hosts.name_prefix,
                           self.session_note)
            return None
        self.session = session
        return session

    def _end_session(self) -> None:
        """Close the session (its processes changed or stopped); the next call may open a new one."""
        if self.session is not None:
            self.session.close()
            self.session = None
        if not self.hosts.detached:
            self.session_note = ""

    def _session_died(self, err: WorkerDiedError) -> None:
        self._end_session()
        self.fail(err)

    def control_paths(self) -> list[str]:
        """Per rank, how blocking calls with inline arguments reach it: ``"session"`` (the
        controller's ring), ``"agent"`` (its node agent's ring) or ``"ray"`` (a task per rank)."""
        if self.session is None or self.control == "ray":
            return ["ray"] * self.world_size
        path = "session" if isinstance(self.session, CallSession) else "agent"
        ranks = set(self.session.ranks)
        return [path if r in ranks else "ray" for r in range(self.world_size)]

    def fail(self, err: WorkerDiedError) -> None:
        """Mark the group failed after ``err`` and kill its other processes.

        Killing is what ends peers blocked in a collective the dead rank will never join; a
        group with a dead rank cannot run another collective call anyway.
        """
        self.dead.update(err.ranks)
        self._end_session()
        if self.on_rank_death != "fail":  # the survivors stay up, for replace_dead_ranks()
            if self._failed is None:
                self._failed = err
            if self.on_rank_death == "keep":  # the caller must act: say so
                logger.warning("worker group: %s; survivors kept for replace_dead_ranks()", err)
            else:  # "replace": the group replaces the rank and logs one line when done
                logger.info("worker group: %s; replacing it", err)
            return
        if self._failed is not None:
            return
        self._failed = err
        logger.error("worker group failed: %s; stopping its %d processes", err, self.world_size)
        self.hosts.kill()

    def reshape(self, coords: Sequence[RankCoords]) -> None:
        """The group shrank or grew (:mod:`.remesh`): ``hosts`` holds the new ranks' processes, in
        rank order, and ``coords`` their coordinates; accept calls again."""
        self.world_size = len(self.hosts.actors)
        self.coords = list(coords)
        self.recovered()

    def abandon(self, err: RankMeshError) -> None:
        """Fail the group for good (dead ranks could not be replaced): stop every process."""
        self._failed = err
        logger.error("worker group failed: %s; stopping its %d processes", err, self.world_size)
        self.hosts.kill()

    def recovered(self) -> None:
        """The dead ranks were replaced: accept calls again, with the new processes' nodes."""
        self.nodes = self.hosts.nodes
        self._end_session()  # new processes: the next call opens a session with them
        self.dead.clear()
        self._failed = None
        self.settle()  # the survivors were drained: their failed attempts' outputs are in

    def settle(self) -> None:
        """Read and drop the outputs of failed calls that have arrived; keep the others for later.

        When a call fails, the caller gets the first error and the other ranks' outputs are left
        unread.  Ray logs an "Unhandled error" with a full traceback for every failed output it
        frees without anyone having read it, so a handled failure (a rank replaced, the call
        retried) would end in one such block per survivor.  The group reads them itself instead,
        as they arrive (here after a failure, before the next submit, after a replacement).
        """
        if not self.abandoned:
            return
        refs = [p.ref for p in self.abandoned]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - already reported through the call's own error
                pass
        self.abandoned = [p for p in self.abandoned if p.ref not in ready]

    def _check_usable(self, method: str) -> None:
        if self.closed:
            raise BackendError(f"cannot call {method}: the worker group has been shut down")
        if self._failed is not None:
            f = self._failed
            if not isinstance(f, WorkerDiedError):
                raise BackendError(f"cannot run {method}: the group failed earlier ({f}); shut it down and start a new group")
            if self.on_rank_death == "fail":
                advice = "and its processes were stopped; shut it down and start a new group"
            else:
                advice = "and the survivors are kept: call replace_dead_ranks() (or shrink_dead_replicas()) first"
            raise WorkerDiedError(
                f.rank,
                f.method,
                f"cannot run {method}: the group failed earlier ({f.detail}) {advice}",
                f.node,
                ranks=sorted(self.dead | set(f.ranks)),
                coords=f.coords,
            )

    def share(self, obj: Any) -> Shared:
        if isinstance(obj, Shared):
            return obj
        self.stats.add(puts=1)
        return Shared(ray.put(obj))

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall]) -> list[Pending]:
        self._check_usable(method)
        if self.abandoned:
            self.settle()
        session = self._open_session()
        if session is not None and session.takes(calls):
            counts, actors = self.hosts.ray_calls, self.hosts.actors
            after = {c.rank: counts.of(c.rank, actors[c.rank]) for c in calls}
            pending = session.submit(role, method, calls, after, self.headers)
            if pending is not None:  # else too big for a slot: Ray carries it
                self.stats.add(calls=len(pending))
                return pending
        if self.session is not None:  # open, whether this call may use it or not
            ranks = [c.rank for c in calls]
            if self.session.owes(ranks):  # a rank runs calls in the order they were sent, whichever path
                self.session.drain(ranks, self.call_timeout_s, self._session_died, self.inspect)
        counts = self.hosts.ray_calls
        pending = []
        marked = False  # a traced call's first rank sends the fetch mark (rankmesh.tracing.recorder)
        cache, actors, nodes, coords = self.headers, self.hosts.actors, self.nodes, self.coords
        for call in calls:
            rank = call.rank
            if not 0 <= rank < self.world_size:
                raise BackendError(f"{method}: rank {rank} is out of range for world size {self.world_size}")
            fetch_mark = call.trace and not call.keep and not marked  # the first rank of a traced blocking call
            marked = marked or fetch_mark
            header, refs, slot = encode_rank_call(role, method, call, cache, fetch_mark)
            actor = actors[rank]
            if call.keep:  # traced non-blocking: the host keeps the timing (drain_timings)
                ref = actor.execute_kept.remote(call.keep, header, *refs)
            elif slot is None:
                ref = (actor.execute_traced if call.trace else actor.execute).remote(header, *refs)
            elif cache.installed(slot, rank, actor):  # no header argument (see wire.HeaderCache)
                ref = getattr(actor, slot_method(slot, len(refs))).remote(*refs)
            else:
                ref = actor.execute_install.remote(slot, header, *refs)
                cache.mark_installed(slot, rank, actor)
            pending.append(Pending(ref, rank, method, nodes[rank], coords[rank]))
            counts.sent(rank, actor)
        self.stats.add(calls=len(pending))
        return pending

    def fetch(
        self, pending: Sequence[Pending], timeout: float | None = None, borrow: bool = False, stall_warn_s: float | None = None
    ) -> list[Any]:
        """Outputs of ``pending``; ``timeout=None`` / ``stall_warn_s=None`` mean the group's settings."""
        if pending and isinstance(pending[0], (SessionPending, AgentPending)):
            if self.session is None:  # closed since: the group failed or was shut down
                self._check_usable(pending[0].method)
                raise BackendError(f"{pending[0].method}: the call session closed before its answers were read")
            return self.session.fetch(
                pending,
                self.call_timeout_s if timeout is None else timeout,
                self._session_died,
                self.stall_warn_s if stall_warn_s is None else stall_warn_s,
                self.inspect,
            )
        try:
            return fetch_outputs(
                pending,
                self.call_timeout_s if timeout is None else timeout,
                self.fail,
                borrow,
                self.stall_warn_s if stall_warn_s is None else stall_warn_s,
                self.inspect,
            )
        except RankMeshError:
            self.abandoned.extend(pending)  # nobody reads this call's other outputs (settle)
            self.settle()
            raise

    def fetcher(self, timeout: float | None = None, stall_warn_s: float | None = None) -> GroupFetcher:
        return GroupFetcher(
            self.token,
            self.call_timeout_s if timeout is None else timeout,
            self.stall_warn_s if stall_warn_s is None else stall_warn_s,
            weakref.ref(self),
        )

    def drain_timings(self, timeout_s: float = 10.0) -> list[tuple[int, list[Any], int, int, int]]:
        """Per rank ``(rank, kept timings, sent_ns, host_ns, received_ns)``: what each host keeps of
        traced non-blocking calls, with its clock read between sending and receiving (one round)."""
        if self.closed or self._failed is not None:
            return []
        sent = time.time_ns()
        answers = ray.get([actor.drain_timings.remote() for actor in self.hosts.actors], timeout=timeout_s)
        received = time.time_ns()
        return [(rank, entries, sent, host_ns, received) for rank, (host_ns, entries) in enumerate(answers)]

    def inspect(self, unfinished: Sequence[Pending], finished: Sequence[Pending], after_s: float) -> tuple[Any, dict]:
        """Where each unfinished rank is (:func:`.hangs.gather_hangs` over this group's hosts)."""
        return gather_hangs(self.hosts.actors, unfinished, finished, after_s)
