"""RayExecutor: the backend contract (:class:`rankmesh.backend.Backend`) over one group's host processes.

One call, one path, whichever carrier takes it (``docs/architecture.md``, "One call's path"):

1. **the record**: :meth:`RayExecutor.submit` gives the call an id, the group's generation, each
   rank a sequence number, and encodes each rank's share once (:mod:`.wire`; equal shares once
   for all, slot-only headers once per host set);
2. **the carrier**: the group's call session when it is open and the call is blocking, has only
   inline arguments and fits a command slot (:mod:`.session`); the node agents of a group across
   nodes take data calls too (:mod:`.agent`); else one Ray task per rank (:mod:`.tasks`).  The
   size rule is the same on every path: a call too big for a slot takes Ray's tasks;
3. **the order**: before sending, the call waits for what its ranks still run on other carriers,
   and for their abandoned calls, within its deadline (:mod:`.order`; waiting for an abandoned call
   is logged at once and bounded by ``abandoned_wait_s`` when the call has no deadline);
4. **the wait**: :meth:`RayExecutor.fetch` waits in the one loop (:func:`.waiting.gather`), with the
   call's deadline, the fail-fast grace, the stall warning and the hang report
   (:meth:`RayExecutor.inspect`, :mod:`.hangs`).  Ranks still running when the caller gives up are
   remembered as running an abandoned call.

A dead process fails the whole group: :meth:`RayExecutor.fail` kills the other ranks (so their
blocked collectives end) and later calls raise at once; with ``on_rank_death="keep"`` or
``"replace"`` the survivors are kept instead, for :mod:`.recovery` to replace the dead ranks.
Recovery and lifecycle steps are calls too (:meth:`RayExecutor.step`): one record, the Ray-task
carrier, the host's lock, a deadline and a hang report.

**Threads.**  A group may be called from several threads at once.  Sending is serialized (one
lock: the call's record, its order and its writes), so every rank receives the calls in one
order; waiting is not, so each thread waits for and gets its own call's outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray

from rankmesh.backend import Change, GroupCall, RankCall, Selection, Shared
from rankmesh.deadline import Deadline
from rankmesh.errors import (AgentLostError, BackendError, ControllerCutOffError, FetchTimeoutError, HangError, RankMeshError,
                             RingError, StaleViewError, WorkerDiedError)
from rankmesh.mesh import RankCoords
from rankmesh.serialization import receiving
from rankmesh.tracing.marks import FETCH
from rankmesh.sharedmem import register_store_processes
from rankmesh.validate import optional_seconds, positive_int, positive_seconds

from .forked import kill_host
from .agent import AGENT_FANOUT, AgentCall, AgentSends, AgentSession, NoOutput, Unreached, owners_lost, ping_ranks
from .hangs import gather_hangs
from .hosts import HostSet
from .order import Abandoned, Ledger
from .runtime import alive_nodes, health_window_s, node_ip_address, raylet_pids
from .session import CallSession
from .tasks import RayTasks, ready_refs, step_part
from .calls import CallRecord, Carrier, Pending, RankPart
from .waiting import POLL_INTERVAL, Gathered, combine_errors, fetch_outputs, gather, timed_out
from .files import Mapped, mapped
from .warm import seal
from .wire import INLINE_BYTES, encode_rank_call, inline

logger = logging.getLogger(__name__)

#: ``RANKMESH_CONTROL``: ``auto`` (the default) opens a session where it can; ``ray`` keeps every
#: call on Ray's task-per-rank path.
CONTROL_ENV = "RANKMESH_CONTROL"
CONTROL_MODES: tuple[str, ...] = ("auto", "ray")
#: How long a call without a deadline waits for a rank's abandoned call to end before it gives up
#: (seconds; ``RayWorkerGroup(abandoned_wait_s=...)``).
ABANDONED_WAIT_S = 60.0
#: Calls sent behind abandoned ones whose bound is kept until their fetch (the oldest go first).
BOUNDS_MAX = 1024
#: How much longer than the controller a host waits for a rank's earlier session call before a
#: Ray task that must follow it gives up (seconds): the controller's HangError comes first.
AFTER_GRACE_S = 5.0


def control_mode(environ: Mapping[str, str] | None = None) -> str:
    """The ``RANKMESH_CONTROL`` setting, checked (``RayWorkerGroup`` checks it before Ray starts)."""
    import os

    given = (os.environ if environ is None else environ).get(CONTROL_ENV, "auto")
    value = given.strip().lower() or "auto"
    if value not in CONTROL_MODES:
        raise BackendError(
            f"{CONTROL_ENV}={given!r} is not a control mode: set it to 'auto' (the default: a call session where "
            f"one can be opened) or 'ray' (one Ray task per rank), or unset it"
        )
    return value


@dataclass
class CallStats:
    """Counters for tests and benchmarks: puts made, arguments mapped (:func:`.wire.mapped`), calls
    submitted (rank calls), and each carrier's calls."""

    puts: int = 0
    maps: int = 0
    calls: int = 0
    by_carrier: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, puts: int = 0, calls: int = 0, carrier: str | None = None, maps: int = 0) -> None:
        with self.lock:
            self.puts += puts
            self.maps += maps
            self.calls += calls
            if carrier is not None:
                self.by_carrier[carrier] = self.by_carrier.get(carrier, 0) + 1


#: What a group does when a rank's process dies: ``fail`` (stop the others, refuse later calls),
#: ``keep`` (keep the survivors for ``replace_dead_ranks()``), ``replace`` (replace and retry once),
#: ``shrink`` (drop the dead ranks' dp replicas and retry once), ``replace_or_shrink`` (replace;
#: shrink when no process can be had for a dead rank).
ON_RANK_DEATH: tuple[str, ...] = ("fail", "keep", "replace", "shrink", "replace_or_shrink")
#: The ``on_rank_death`` policies that may drop dp replicas (:mod:`.remesh`).
SHRINKING: tuple[str, ...] = ("shrink", "replace_or_shrink")
#: The policies under which the group recovers by itself and retries the failed call once.
RETRYING: tuple[str, ...] = ("replace", *SHRINKING)

#: What a group does with ranks still running a call past its timeout: ``raise`` (the
#: ``HangError``; they keep running it) or ``kill`` (the ``HangError``, and their processes are
#: killed, so the ``on_rank_death`` policy recovers them as dead ranks: a stopped or wedged
#: process is a dead one that has not noticed).
ON_HANG: tuple[str, ...] = ("raise", "kill")


def check_policies(on_rank_death: str, on_hang: str) -> None:
    """Refuse an unknown ``on_rank_death`` or ``on_hang``, or a pair that cannot work together."""
    if on_rank_death not in ON_RANK_DEATH:
        raise BackendError(f"on_rank_death must be one of {', '.join(map(repr, ON_RANK_DEATH))}, got {on_rank_death!r}")
    if on_hang not in ON_HANG:
        raise BackendError(f"on_hang must be one of {', '.join(map(repr, ON_HANG))}, got {on_hang!r}")
    if on_hang == "kill" and on_rank_death == "fail":
        raise BackendError("on_hang='kill' treats ranks stuck past a call's timeout as dead, and on_rank_death='fail' "
                           "would then stop the whole group; choose on_rank_death='replace' (or 'keep', 'shrink', "
                           "'replace_or_shrink'), or keep on_hang='raise'")


@dataclass(frozen=True)
class GroupFetcher:
    """The picklable fetch function of one group's futures (:meth:`RayExecutor.fetcher`).

    Equal for one group (futures of one call merge flat); ``timeout_s`` bounds each fetch.
    Where its group's executor lives (the controller that made it) it fetches through it, as a
    blocking call does (a dead rank fails the group, a hang is reported, ranks left running are
    remembered): it holds the executor by weak reference (a future must not keep a shut-down
    group alive).  The reference does not travel: unpickled in another process (a worker
    fetching a future's parts) it waits with the Ray-task carrier alone.
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
        limit = self.timeout_s if timeout is None else timeout
        executor = self._executor()
        if executor is not None:
            return executor.fetch(handles, deadline=Deadline.after(limit), stall_warn_s=self.stall_warn_s)
        return fetch_outputs(handles, limit, None, False, self.stall_warn_s)

    def ready(self, handles: Sequence[Any], timeout: float | None = 0.0) -> list[int]:
        """:class:`rankmesh.backend.ReadyCheck`: which of ``handles`` are done (nothing fetched)."""
        refs = [h.handle if isinstance(h, Pending) else h for h in handles]
        done = ready_refs(refs, timeout)
        return [i for i, ref in enumerate(refs) if ref in done]


class RayExecutor:
    """:class:`rankmesh.backend.Backend` over the processes of ``hosts`` (one per rank).

    ``coords[r]`` (optional) is rank ``r``'s :class:`~rankmesh.mesh.RankCoords`, for error messages.
    ``call_timeout_s`` bounds every call that gives no timeout of its own (``None``: wait as long
    as the ranks run); ``stall_warn_s`` logs where the unfinished ranks are, once per call, when
    a call runs that long (``None``: never); ``abandoned_wait_s`` bounds how long a call without a
    deadline waits for ranks still running an abandoned call.  Role groups spawned from one group
    share its executor: one closed flag, one failure, one set of stats.  ``on_rank_death`` is one
    of :data:`ON_RANK_DEATH`, ``on_hang`` of :data:`ON_HANG`.
    """

    def __init__(
        self,
        hosts: HostSet,
        coords: Sequence[RankCoords] | None = None,
        call_timeout_s: float | None = None,
        stall_warn_s: float | None = None,
        on_rank_death: str = "fail",
        abandoned_wait_s: float = ABANDONED_WAIT_S,
        on_hang: str = "raise",
    ) -> None:
        check_policies(on_rank_death, on_hang)
        self.hosts = hosts
        self.world_size = len(hosts.actors)
        self.coords: list[RankCoords | None] = list(coords) if coords is not None else [None] * self.world_size
        self.call_timeout_s = optional_seconds(call_timeout_s, "call_timeout_s", BackendError)
        self.stall_warn_s = optional_seconds(stall_warn_s, "stall_warn_s", BackendError)
        self.abandoned_wait_s = positive_seconds(abandoned_wait_s, "abandoned_wait_s", BackendError)
        self.on_rank_death = on_rank_death
        self.on_hang = on_hang
        self.stats = CallStats()
        self.headers = hosts.headers  # shared by every executor over these processes (wire.HeaderCache)
        self.nodes = hosts.nodes
        self.dead: set[int] = set()
        self._failed: RankMeshError | None = None
        self.token = uuid.uuid4().hex
        self._send_lock = threading.RLock()  # a call's id, sequence numbers, order and writes: one sender at a time
        self._ids = itertools.count(1)  # call ids, also every rank's sequence numbers (they only grow)
        self._checked: set[int] = set()  # keys of the selections whose ranks were checked against the world size
        self._ledger = Ledger(self.world_size)
        self._failed_outputs: list[Pending] = []  # Ray outputs of failed calls that no caller will read (settle)
        self._bounds: dict[int, Deadline] = {}  # call id -> the deadline of a call sent behind an abandoned one
        self.generation = 0
        self._changes: list[Change] = []
        self._tasks = RayTasks(hosts, hosts.headers)
        #: Whether this group may open a call session (``RANKMESH_CONTROL``; detached groups never do:
        #: other drivers may call their processes), the session once open, and why there is none.
        self.control = "ray" if hosts.detached else control_mode()
        self.agent_fanout = AGENT_FANOUT
        self.session: CallSession | AgentSession | None = None
        self._retired: list[AgentSession] = []  # agents replaced while owning outputs somebody references
        #: The agents of a session that ended because the group's processes changed (a rank's death,
        #: a replacement, a shrink or grow): retired, alive, for the next session to take over on
        #: the nodes it shares (:meth:`AgentSession.open`).
        self._idle: AgentSession | None = None
        self.session_note = "detached group" if hosts.detached else ""
        # Outputs fetched here map copy-on-write through the raylet's fd of the object store.
        register_store_processes(raylet_pids())

    # ----- state ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.hosts.closed

    @property
    def failed(self) -> RankMeshError | None:
        return self._failed

    def changes_since(self, generation: int) -> list[Change]:
        return [c for c in self._changes if c.generation > generation]

    def _new_generation(self, what: str, renumbered: bool) -> None:
        self.generation += 1
        self._changes.append(Change(self.generation, what, renumbered))

    @property
    def unread_outputs(self) -> list[Pending]:
        """Ray outputs of failed calls not read yet (the group reads them as they arrive: :meth:`settle`)."""
        return list(self._failed_outputs)

    def abandoned_calls(self) -> dict[int, Abandoned]:
        """Rank -> the abandoned call it may still run (what a later call to it waits for first)."""
        return self._ledger.abandoned()

    def close(self) -> None:
        """Kill the processes and release their placement groups (idempotent)."""
        self._end_session(keep_owners=False)
        self.hosts.shutdown()

    def release(self) -> None:
        """End the call session but keep the processes (another group will drive them)."""
        self._end_session(keep_owners=False)

    def retire_session(self) -> None:
        """End the call session before the group's processes change (a grow): calls the ranks were
        sent and had not started go with it, and its node agents wait for the next session to
        take them over, owning what they owned (:meth:`AgentSession.open`)."""
        self._end_session(reuse=True)

    # ----- call sessions (.session, .agent) -------------------------------------------------------

    def set_control(self, mode: str, agent_fanout: int | None = None) -> None:
        """``"auto"`` or ``"ray"`` (see ``RayWorkerGroup.set_control``); a session stays open while on Ray.

        A new ``agent_fanout`` closes open node agents; the next call opens them in the new tree."""
        if mode not in CONTROL_MODES:
            raise BackendError(f"set_control(mode): expected one of {', '.join(map(repr, CONTROL_MODES))}, got {mode!r}")
        if mode == "auto" and self.hosts.detached:
            raise BackendError("set_control('auto'): a detached group stays on the Ray path (other drivers may call its processes)")
        with self._send_lock:
            if agent_fanout is not None:
                agent_fanout = positive_int(agent_fanout, "set_control(agent_fanout)", BackendError)
                if agent_fanout != self.agent_fanout and isinstance(self.session, AgentSession):
                    self._end_session()  # the agents go; calls they had sent on and the hosts had not read go with them
                self.agent_fanout = agent_fanout
            self.control = mode

    def _open_session(self) -> CallSession | AgentSession | None:
        """The group's session, opened on first use; ``None``: Ray's tasks only.

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
                session.open()
            else:
                session = AgentSession(self.hosts.actors, pids, node_ids, self.nodes, self.coords, self.agent_fanout)
                standby = [s.slot.node_id for s in self.hosts.spares if s.slot.node_id and s.slot.node_id not in node_ids]
                try:
                    session.open(reuse=self._idle, standby=standby)
                except Exception:  # noqa: BLE001 - a taken agent failed to open: new agents everywhere, once
                    if self._idle is None:
                        raise
                    logger.warning("worker group %s: the earlier node agents did not open a session; starting new ones",
                                   self.hosts.name_prefix, exc_info=True)
                    session = AgentSession(self.hosts.actors, pids, node_ids, self.nodes, self.coords, self.agent_fanout)
                    session.open()
        except Exception as exc:  # noqa: BLE001 - Ray's tasks always work: say why once, and use them
            self.session_note = f"{type(exc).__name__}: {exc}"
            logger.warning("worker group %s: no call session (%s); its calls take Ray's tasks", self.hosts.name_prefix,
                           self.session_note)
            return None
        finally:
            idle, self._idle = self._idle, None
            if idle is not None:  # the agents no node of the new session took
                self._let_go(idle)
        self.session = session
        return session

    def _end_session(self, keep_owners: bool = True, reuse: bool = False) -> None:
        """Close the session (its processes changed or stopped); the next call may open a new one.

        Calls the hosts were sent and had not started are dropped with it (a closed ring); a call
        a rank still runs goes on, and the rank's next call queues behind it (the host's lock).
        With ``reuse`` (the processes changed, the nodes mostly did not) its node agents stop
        serving and wait for the next session to take them over.  Otherwise node agents that
        sent non-blocking calls own those calls' outputs, which unread futures may still name:
        with ``keep_owners`` they stop serving but live on, and at each later change every kept
        agent that no longer owns a referenced object ends (:meth:`AgentSession.let_go_unowned`);
        ``keep_owners=False`` (the group ends) ends them all."""
        with self._send_lock:
            session, self.session = self.session, None
            spent = None  # retired agents no later session will take over
            if isinstance(session, AgentSession) and keep_owners:
                session.retire()
                spent = session
                if reuse:
                    spent, self._idle = self._idle, session
            elif session is not None:
                session.close(stop=False) if isinstance(session, CallSession) else session.close()
            if spent is not None:
                self._let_go(spent)
            retired = list(self._retired)  # a snapshot: another thread may retire agents meanwhile
            if not keep_owners:
                retired += [self._idle] if self._idle is not None else []
                self._retired, self._idle = [], None
            if not self.hosts.detached:
                self.session_note = ""
        if not keep_owners:
            for kept in retired:
                kept.close()
            return
        # Outside the send lock: asking the kept agents is a Ray round trip each (bounded).
        still = [kept for kept in retired if kept.let_go_unowned()]
        with self._send_lock:
            self._retired = [kept for kept in self._retired if kept not in retired] + still

    def _let_go(self, session: AgentSession) -> None:
        """A retired session's agents that serve nothing now: kept while they own outputs, else ended."""
        if session.owns_outputs:
            session.drop_standby()
            with self._send_lock:
                self._retired.append(session)
        else:
            session.close()

    def ready_agents(self, node_ids: Sequence[str]) -> list[str]:
        """Start node agents now on those of ``node_ids`` where the group keeps none, for its next
        session to take over; the nodes started on.

        For a replacement: its new processes' nodes, while the processes start, import and
        restore (:meth:`AgentSession.start_standby` says why).  Only where the group's calls took
        node agents (a retired session waiting to be taken over, or the open one): a group on the
        controller's node, or on Ray's tasks, has no agents to add to."""
        with self._send_lock:
            agents = self._idle or (self.session if isinstance(self.session, AgentSession) else None)
            return agents.start_standby(node_ids) if agents is not None else []

    @property
    def kept_agents(self) -> int:
        """How many node agents replaced earlier are kept alive because they own outputs (of
        non-blocking calls they sent) that a future somewhere still references."""
        return sum(len(kept.agents) for kept in self._retired)

    def control_paths(self) -> list[str]:
        """Per rank, how blocking calls reach it: ``"session"`` (the controller's ring; inline
        arguments only), ``"agent"`` (its node agent: its ring, or its Ray task for a data call) or
        ``"ray"`` (a task per rank)."""
        session = self.session
        if session is None or self.control == "ray":
            return ["ray"] * self.world_size
        ranks = set(session.ranks)
        return [session.name if r in ranks else "ray" for r in range(self.world_size)]

    def _carriers(self) -> dict[str, Carrier]:
        carriers: dict[str, Carrier] = {"ray": self._tasks, NoOutput.name: NoOutput(), Unreached.name: Unreached()}
        if self.session is not None:
            carriers[self.session.name] = self.session
        return carriers

    # ----- failure --------------------------------------------------------------------------------

    def fail(self, err: WorkerDiedError) -> RankMeshError:
        """Mark the group failed after ``err`` and kill its other processes; the error to raise.

        Killing is what ends peers blocked in a collective the dead rank will never join; a
        group with a dead rank cannot run another collective call anyway.  Deaths that are a
        partition of the controller's own node come back as :class:`ControllerCutOffError`
        (:meth:`_cut_off`), which no policy recovers from.
        """
        cut = self._cut_off(err) if self._failed is None else None
        self.dead.update(err.ranks)
        self._end_session(reuse=True)  # the nodes stay: their agents serve the replacement's ranks
        if cut is not None:
            self._failed = cut
            logger.error("worker group failed: %s", cut)
            return cut
        if self.on_rank_death != "fail":  # the survivors stay up, for replace_dead_ranks()
            if self._failed is None:
                self._failed = err
            if self.on_rank_death == "keep":  # the caller must act: say so
                logger.warning("worker group: %s; survivors kept for replace_dead_ranks()", err)
            else:  # "replace": the group replaces the rank and logs one line when done
                logger.info("worker group: %s; replacing it", err)
            return err
        if self._failed is not None:
            return err
        self._failed = err
        logger.error("worker group failed: %s; stopping its %d processes", err, self.world_size)
        self.hosts.kill()
        return err

    def _cut_off(self, err: WorkerDiedError) -> ControllerCutOffError | None:
        """``err`` told as a partition of the controller's own node, or ``None``: deaths as they are.

        Why: with the GCS on the controller's node (a driver on the head node, the usual setup),
        a cut link makes the GCS declare every other node dead, one health check apart, and
        every rank there "dies" while its process may live on.  Replacing them is hopeless (no
        node is left) and reporting N deaths sends the user to the wrong place.  It is told as a
        partition only when the dead ranks' nodes are all declared dead, the group has ranks on
        two or more other nodes, none of their ranks answers a ping from here
        (:func:`.agent.ping_ranks`' bound), and within one health check window
        (:func:`.runtime.health_window_s`) the GCS declares every other node of the cluster dead.
        A dead process on a live node, a node that answers, or a controller on a node without
        the GCS (it cannot ask it then) return at once or within the ping's bound."""
        try:
            own = ray.get_runtime_context().get_node_id()
            node_of = [info.get("node_id") for info in self.hosts.info]
            others: dict[str, list[int]] = {}
            for rank, node in enumerate(node_of):
                if node and node != own:
                    others.setdefault(node, []).append(rank)
            dead_nodes = {node_of[r] for r in err.ranks if r < len(node_of)}
            if len(others) < 2 or own in dead_nodes or not dead_nodes:
                return None
            alive = set(alive_nodes())
            if dead_nodes & alive or own not in alive:
                return None  # a process died on a node that lives (or the GCS is not reachable from here)
            probe = [ranks[0] for node, ranks in others.items() if node in alive]
            if probe and ping_ranks(self.hosts.actors, probe)[0]:
                return None  # another node's rank answers: only some nodes went
            end = time.monotonic() + health_window_s()
            while alive - {own}:
                if time.monotonic() > end:
                    return None
                time.sleep(0.2)
                alive = set(alive_nodes())
        except Exception:  # noqa: BLE001 - a judgment on the way to an error: never hide the error itself
            logger.debug("worker group %s: could not tell whether this node was cut off", self.hosts.name_prefix,
                         exc_info=True)
            return None
        lost = sorted({self.nodes[r] or "?" for ranks in others.values() for r in ranks})
        return ControllerCutOffError(err.method, node_ip_address(), lost, sorted(r for ranks in others.values() for r in ranks))

    def kill_ranks(self, ranks: Sequence[int], why: str) -> None:
        """Kill ``ranks``' processes on purpose; the group then treats them as dead (its ``on_rank_death``)."""
        for rank in ranks:
            kill_host(self.hosts.actors[rank])
        first = min(ranks)
        self.fail(WorkerDiedError(first, "kill_ranks", why, self.nodes[first], ranks=list(ranks),
                                  coords={r: self.coords[r] for r in ranks if self.coords[r] is not None}))

    def reshape(self, coords: Sequence[RankCoords], what: str) -> None:
        """The group shrank or grew (:mod:`.remesh`): ``hosts`` holds the new ranks' processes, in
        rank order, and ``coords`` their coordinates; accept calls again."""
        with self._send_lock:
            self.world_size = len(self.hosts.actors)
            self.coords = list(coords)
            self._checked.clear()
            self._ledger.resize(self.world_size)
            self._new_generation(what, renumbered=True)
        self._recovered()

    def abandon(self, err: RankMeshError) -> None:
        """Fail the group for good (dead ranks could not be replaced): stop every process."""
        self._failed = err
        logger.error("worker group failed: %s; stopping its %d processes", err, self.world_size)
        self.hosts.kill()

    def recovered(self, ranks: Sequence[int]) -> None:
        """``ranks`` were replaced by new processes: accept calls again."""
        with self._send_lock:
            self._ledger.resize(self.world_size)  # the survivors drained: nothing of theirs runs any more
            self._new_generation(f"ranks {sorted(ranks)} replaced", renumbered=False)
        self._recovered()

    def _recovered(self) -> None:
        self.nodes = self.hosts.nodes
        self._end_session(reuse=True)  # new processes: the next call opens a session with them
        self.dead.clear()
        self._failed = None
        self.settle()  # the survivors were drained: their failed attempts' outputs are in

    def settle(self) -> None:
        """Read and drop the Ray outputs of failed calls that have arrived; keep the others for later.

        When a call fails, the caller gets the first error and the other ranks' outputs are left
        unread.  Ray logs an "Unhandled error" with a full traceback for every failed output it
        frees without anyone having read it, so a handled failure (a rank replaced, the call
        retried) would end in one such block per survivor.  The group reads them itself instead,
        as they arrive (here after a failure, before the next submit, after a replacement).
        """
        if not self._failed_outputs:
            return
        refs = [p.handle for p in self._failed_outputs]
        done = ready_refs(refs, 0.0)
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - already reported through the call's own error
                pass
        self._failed_outputs = [p for p in self._failed_outputs if p.handle not in done]

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

    # ----- calls ----------------------------------------------------------------------------------

    def share(self, obj: Any) -> Any:
        """``obj`` as a call argument: pickled once to ride inside the call (:func:`.wire.inline`:
        small, no Ray handle inside); else, for a group on the caller's node, written once into a
        memory file its ranks map (:func:`.wire.mapped`); else one ``ray.put`` of it.

        Either of the first two keeps the call one message on the session's ring; what holds a
        Ray handle (a future passed along) goes through the store under Ray's own serialization.
        For forked ranks it is stored sealed (:func:`.warm.seal`): their holders pass it on unread.
        """
        if isinstance(obj, Shared):
            return obj
        small = inline(obj)
        if small is not None:
            return small
        with self._send_lock:
            session = self._open_session()
        if isinstance(session, CallSession) and session.maps_arguments:  # every rank on this node, and they can map
            big = mapped(obj, session.files, INLINE_BYTES)
            if big is not None:
                self.stats.add(maps=1)
                return big
        self.stats.add(puts=1)
        return Shared(ray.put(seal(obj) if self.hosts.forking is not None else obj))

    def submit(
        self, role: str | None, method: str, calls: Sequence[RankCall] | GroupCall, deadline: Deadline | None = None
    ) -> Sequence[Pending]:
        deadline = deadline if deadline is not None else Deadline.after(self.call_timeout_s)
        if isinstance(calls, GroupCall) and any(share.trace for share in calls.shares):
            calls = calls.rank_calls()  # a traced call's first rank sends the fetch mark: rank by rank
        with self._send_lock:
            self._check_usable(method)
            self._check_ranks(method, calls)
            if self._failed_outputs:
                self.settle()
            record = self._record(role, method, calls, deadline)
            session = self._open_session()
            prepared = None if session is None else session.prepare(record)
            carrier = self._tasks if prepared is None else session
            bound, after = self._order(carrier.name, record.ranks, method, deadline)
            if after:  # Ray tasks to ranks with session calls unanswered: each host runs them after those
                # A blocking call's host waits a little past the call's deadline (the controller's HangError,
                # with its report, comes first); a future's deadline starts at get(), so its hosts wait as
                # long as the earlier calls run, or abandoned_wait_s behind an abandoned one.
                if record.blocking and bound.finite:
                    after_s = bound.left() + AFTER_GRACE_S
                else:
                    after_s = self.abandoned_wait_s + AFTER_GRACE_S if set(after) & set(self._ledger.abandoned()) else None
                parts = tuple(dataclasses.replace(p, after=after[p.rank], after_s=after_s) if p.rank in after else p
                              for p in record.parts)
                record = CallRecord.of_parts(record.call_id, record.generation, record.method, parts, record.deadline,
                                             record.blocking, record.holds)
            if bound is not deadline:  # it queues behind an abandoned call: its wait ends at the bound
                record = dataclasses.replace(record, deadline=bound)
                self._bounds[record.call_id] = bound
                while len(self._bounds) > BOUNDS_MAX:
                    self._bounds.pop(next(iter(self._bounds)))
            pending = carrier.send(record, prepared)
            self._ledger.sent(carrier.name, record.call_id, record.ranks)
        self.stats.add(calls=len(pending), carrier=carrier.name)
        if isinstance(pending, AgentSends):  # a non-blocking call on the agents: their sends, waited for unlocked
            try:
                return pending.resolve()
            except AgentLostError:
                self._end_session()  # the next call starts new agents
                raise
        return pending

    def _check_ranks(self, method: str, calls: Sequence[RankCall] | GroupCall) -> None:
        """Refuse ranks outside the group (a reusable selection is checked once per group size)."""
        if isinstance(calls, GroupCall):
            key = calls.selection.key
            if key is not None and key in self._checked:
                return
            ranks: Sequence[int] = calls.selection.ranks
        else:
            key, ranks = None, [call.rank for call in calls]
        world = self.world_size
        bad = [rank for rank in ranks if not 0 <= rank < world]
        if bad:
            raise BackendError(f"{method}: ranks {bad} are outside the group's ranks (0..{world - 1})")
        if key is not None:
            self._checked.add(key)

    def _record(self, role: str | None, method: str, calls: Sequence[RankCall] | GroupCall, deadline: Deadline) -> CallRecord:
        """The call's one record: its id, the generation, its shares (each encoded once) and who runs which.

        A :class:`GroupCall` brings its shares and selection; a list of rank calls is made one:
        calls with the same arguments share one encoding (a broadcast is pickled once).  A header
        of shared values only is encoded once per host set (:class:`.wire.HeaderCache`).  The
        call id is every rank's sequence number: a call never sent leaves a gap, which hosts accept.
        """
        cache = self.headers
        if isinstance(calls, GroupCall):
            shares = tuple(_share(role, method, share, cache, False) for share in calls.shares)
            selection = calls.selection
            blocking = all(share.blocking for share in calls.shares)
            outputs_only = calls.outputs_only
        else:
            memo: dict[tuple[Any, ...], int] = {}
            encoded: list[RankPart] = []
            index = []
            marked = False  # a traced blocking call's first rank sends the fetch mark (rankmesh.tracing.marks)
            for call in calls:
                fetch_mark = call.trace and not call.keep and not marked
                marked = marked or fetch_mark
                # The group hands every rank of a broadcast the same argument objects: one encoding for all.
                key = (id(call.args), id(call.kwargs), call.return_output, call.trace, call.receive, call.keep, fetch_mark)
                at = memo.get(key)
                if at is None:
                    at = memo[key] = len(encoded)
                    encoded.append(_share(role, method, call, cache, fetch_mark))
                index.append(at)
            shares, selection = tuple(encoded), Selection(tuple(call.rank for call in calls), tuple(index))
            blocking = all(call.blocking for call in calls)
            outputs_only = False
        return CallRecord(next(self._ids), self.generation, method, shares, selection, deadline, blocking,
                          self.nodes, self.coords, _mapped_in(calls, selection), outputs_only)

    # ----- order (.order) -------------------------------------------------------------------------

    def _owing(self) -> dict[int, int]:
        """Rank -> the last session (or agent) call sent to it that it has not answered yet."""
        session = self.session
        return {} if session is None else session.last_unanswered()

    def _order(self, carrier: str, ranks: Sequence[int], method: str, deadline: Deadline) -> tuple[Deadline, dict[int, int]]:
        """Make ``ranks`` ready for this call (:mod:`.order`): fence their Ray tasks before a session
        call (within ``deadline``), and say which session call a Ray task must run after, per rank.

        Returns the call's deadline from now on (bounded by ``abandoned_wait_s`` when it queues behind
        an abandoned call and has none of its own) and the ``after`` of each rank's Ray task."""
        owing = self._owing() if carrier == "ray" else {}
        if not owing and not self._ledger.tracking:
            return deadline, {}  # the common case: nothing in flight to order against
        waits = self._ledger.before(carrier, ranks, owing)
        bound = deadline
        if waits.abandoned:
            if not deadline.finite:
                bound = Deadline.after(self.abandoned_wait_s)
            calls = sorted({(a.call_id, a.describe()) for a in waits.abandoned.values()})
            limit = f"its timeout, {bound.seconds:g} s" if deadline.finite else f"abandoned_wait_s, {bound.seconds:g} s"
            logger.warning("worker group %s: ranks %s still run %s; %s waits behind it on them, at most %s",
                           self.hosts.name_prefix, sorted(waits.abandoned), "; ".join(d for _, d in calls), method, limit)
        if not waits.fence:
            return bound, waits.after
        pending = [Pending(self.hosts.actors[r].fence.remote(), r, "fence", self.nodes[r], self.coords[r], "ray", -1)
                   for r in waits.fence]
        got = gather(pending, bound, self._carriers(), stop_on_failure=False)
        self._ledger.fenced([pending[i].rank for i in got.outcomes])
        failures = got.failures(pending)
        err = combine_errors(failures) if failures else None
        if isinstance(err, WorkerDiedError):
            raise self.fail(err)
        if got.unfinished:
            slow = [pending[i] for i in got.unfinished]
            ranks_left = sorted({p.rank for p in slow})
            running = "; ".join(sorted({waits.abandoned[r].describe() for r in ranks_left if r in waits.abandoned})) or \
                "the Ray tasks sent to them before"
            note = (f"{method} was not sent: ranks {ranks_left} still run {running}, which a call session's call waits "
                    "for first. " + self.advice(ranks_left))
            raise timed_out(slow, slow, bound.seconds or 0.0, got.waited_s, self.fail, self.inspect, note, method)
        return bound, waits.after

    def advice(self, ranks: Sequence[int]) -> str:
        """What happens to ``ranks`` left running a call, and how to get them back (a HangError's note)."""
        ranks = sorted(ranks)
        later = (f"the group's next calls to them say so at once and wait behind it, up to their timeout "
                 f"(or abandoned_wait_s={self.abandoned_wait_s:g} s without one)")
        if self.on_rank_death == "fail":
            back = (f"to get them back, shut the group down (wg.shutdown()) and start a new one; a group created with "
                    f"on_rank_death='keep' can instead replace them: wg.kill_ranks({ranks}), then wg.replace_dead_ranks()")
        elif self.on_rank_death == "keep":
            back = f"to get them back: wg.kill_ranks({ranks}), then wg.replace_dead_ranks(); or wg.shutdown()"
        else:
            back = (f"to get them back: wg.kill_ranks({ranks}) (the next call then recovers them, "
                    f"on_rank_death={self.on_rank_death!r}); or wg.shutdown()")
        return f"Ranks {ranks} keep running it: {later}; {back}"

    # ----- waiting --------------------------------------------------------------------------------

    def fetch(
        self, pending: Sequence[Pending], timeout: float | None = None, borrow: bool = False, stall_warn_s: float | None = None,
        deadline: Deadline | None = None,
    ) -> list[Any]:
        """Outputs of ``pending``; without ``deadline``, ``timeout`` from now (``None``: the group's)."""
        if not pending:
            return []
        deadline = deadline if deadline is not None else Deadline.after(self.call_timeout_s if timeout is None else timeout)
        if isinstance(pending, AgentCall):
            outputs = self._agent_outputs(pending, deadline, borrow, self.stall_warn_s if stall_warn_s is None else stall_warn_s)
            if outputs is not None:
                return outputs
            pending = pending.each()  # something failed or ran late: rank by rank, as every carrier's calls
        if self._bounds:
            for bound in {id(b): b for p in pending if (b := self._bounds.pop(p.call_id, None)) is not None}.values():
                if bound.end is not None and (deadline.end is None or bound.end < deadline.end):
                    deadline = bound  # sent behind an abandoned call: bounded even without a timeout of its own
        stall = self.stall_warn_s if stall_warn_s is None else stall_warn_s
        self._check_current(pending)
        carriers = self._carriers()
        if any(p.carrier not in carriers for p in pending):  # the session closed since: the group failed or was shut down
            self._check_usable(pending[0].method)
            raise BackendError(f"{pending[0].method}: the call session closed before its answers were read")
        with receiving("borrow") if borrow else contextlib.nullcontext():
            got = gather(pending, deadline, carriers, stall, self.inspect)
        if self._ledger.tracking:
            for call_id, ranks in _by_call(pending, got.outcomes):
                self._ledger.finished("ray", call_id, ranks)
        if got.stopped == "done":
            return [got.outcomes[i].value for i in range(len(pending))]
        self._given_up(pending, got)
        failures = owners_lost(self.hosts.actors, got.failures(pending))
        if failures:
            err = combine_errors(failures)
            if isinstance(err, WorkerDiedError):
                err = self.fail(err)
            elif isinstance(err, (RingError, AgentLostError)):  # a session thread or an agent ended: the next call opens new ones
                self._end_session()
            raise err
        slow = [pending[i] for i in got.unfinished]
        ranks = sorted({p.rank for p in slow})
        if self.on_hang != "kill" or self._failed is not None:
            raise timed_out(pending, slow, deadline.seconds or 0.0, got.waited_s, self.fail, self.inspect, self.advice(ranks))
        err = timed_out(pending, slow, deadline.seconds or 0.0, got.waited_s, self.fail, self.inspect)
        if isinstance(err, FetchTimeoutError):
            raise self._kill_stuck(err)
        raise err

    def _kill_stuck(self, err: FetchTimeoutError) -> FetchTimeoutError:
        """``on_hang='kill'``: kill the ranks the others of a timed-out call wait for; the error to raise, saying so.

        With a hang report those are its :attr:`~rankmesh.hangs.HangReport.roots` (the ranks that
        gave no answer or run the call outside a collective): their peers blocked in a collective
        with them are freed by the death and drained by the recovery.  Without one, every
        unfinished rank.  When the report names no such rank (all wait in collectives, or for
        their turn), nothing is killed and the error is the usual one: killing them all could
        lose every copy of a shard.
        """
        report = getattr(err, "report", None)
        roots = list(report.roots) if report is not None else list(err.ranks)
        spared = self._last_copies(roots)
        roots = [r for r in roots if r not in spared]
        if not roots:
            why = (f"ranks {spared} hold the last live copy of their shard" if spared else
                   "found no rank the others wait for")
            note = f"on_hang='kill' {why}, so nothing was killed. {self.advice(err.ranks)}"
            return HangError(err.method, err.ranks, err.timeout, report, note) if isinstance(err, HangError) else err
        self.kill_ranks(roots, f"still running {err.method} past its {err.timeout:g} s timeout (on_hang='kill')")
        retry = " (a blocking call is retried once)" if self.on_rank_death in RETRYING else ""
        note = (f"Ranks {roots} were killed (on_hang='kill'): the group recovers them as dead ranks by "
                f"on_rank_death={self.on_rank_death!r}{retry}")
        if isinstance(err, HangError):
            return HangError(err.method, err.ranks, err.timeout, err.report, note)
        killed = FetchTimeoutError(err.method, err.ranks, err.timeout)
        killed.args = (f"{killed.args[0]}. {note}",)
        return killed

    def _last_copies(self, ranks: Sequence[int]) -> list[int]:
        """Those of ``ranks`` whose shard (coordinates but dp) no other live rank holds: killing one
        loses the shard for good, so ``on_hang='kill'`` leaves it running.  The other ranks are
        pinged first (a rank stuck waiting on another group's rank whose node was just cut off must
        not take its own replica's last copy with it)."""
        if any(c is None for c in self.coords):
            return []
        others = [r for r in range(self.world_size) if r not in ranks and r not in self.dead]
        answered, _ = ping_ranks(self.hosts.actors, others) if others else (set(), {})
        live = {self.coords[r].shard() for r in answered}
        return sorted(r for r in ranks if self.coords[r].shard() not in live)

    def _agent_outputs(self, call: AgentCall, deadline: Deadline, borrow: bool, stall_warn_s: float | None) -> list[Any] | None:
        """A call on the node agents, read whole: every rank's output once all top agents answered
        and nothing failed; ``None`` as soon as something failed, the call runs past its deadline or
        ``stall_warn_s``, or the group's agents changed (the caller then waits rank by rank, with
        the loop's grace, hang report and stall warning)."""
        session = self.session
        if not isinstance(session, AgentSession) or call.generation != self.generation or call.call_id in self._bounds:
            return None
        start = time.monotonic()
        warn_at = None if stall_warn_s is None else start + stall_warn_s
        with receiving("borrow") if borrow else contextlib.nullcontext():
            while True:
                limit = POLL_INTERVAL if warn_at is None else max(0.0, min(POLL_INTERVAL, warn_at - time.monotonic()))
                state, outputs = session.outputs(call, deadline.within(limit))
                if state == "done":
                    FETCH.ready_ns = time.time_ns()
                    if self._ledger.tracking:
                        self._ledger.finished("ray", call.call_id, call.record.ranks)
                    return outputs
                if state == "failed" or deadline.expired() or (warn_at is not None and time.monotonic() >= warn_at):
                    return None

    def _given_up(self, pending: Sequence[Pending], got: Gathered) -> None:
        """The caller gives up ``pending``'s unfinished ranks: remember them, and let their answers go."""
        unfinished = [pending[i] for i in got.unfinished]
        why = "past its deadline" if got.stopped == "deadline" else "another rank failed"
        for call_id, ranks in _by_call(unfinished, {i: None for i in range(len(unfinished))}):
            first = next(p for p in unfinished if p.call_id == call_id)
            self._ledger.abandon(call_id, first.method, first.carrier, ranks, why)
        session = self.session
        if session is not None:
            session.give_up([p for p in unfinished if p.carrier == session.name])
        self._failed_outputs.extend(p for p in pending if p.carrier == "ray")
        self.settle()

    def _check_current(self, pending: Sequence[Pending]) -> None:
        """Refuse unfinished calls made before the ranks were renumbered: their ranks are others' now."""
        if not self.generation:
            return
        older = [p for p in pending if p.generation < self.generation]
        if not older:
            return
        changes = [c.what for c in self.changes_since(min(p.generation for p in older)) if c.renumbered]
        if not changes:
            return
        refs = [p.handle for p in older if p.carrier == "ray"]
        if len(refs) == len(older) and len(ready_refs(refs, 0.0)) == len(set(refs)):
            return  # done before the change: the outputs are what the ranks of that time made
        raise StaleViewError(
            f"{pending[0].method}: this call was made before the group changed ({'; '.join(changes)}) and had not "
            "finished; its ranks are numbered otherwise now. Call it again on the group (or on a new view)")

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

    # ----- host steps (recovery and lifecycle, as calls) ------------------------------------------

    def step(self, step: str, ranks: Sequence[int], args: Sequence[tuple[Any, ...]] | None = None,
             timeout: float | None = None, what: str | None = None) -> list[Any]:
        """Run host step ``step`` on ``ranks`` (``args[i]`` for ``ranks[i]``) and wait for every answer.

        A step is a call like any other: one record, the Ray-task carrier, the host's lock (it
        queues behind what the rank still runs), ``timeout`` and a hang report.  It is sent at
        once, without waiting for the ranks' earlier calls: the host's lock orders it after them.
        """
        pending = self.start_step(step, ranks, args, what)
        return fetch_outputs(pending, timeout, None, False, None, self.inspect, advice=self.advice)

    def watch(self, pending: Sequence[Pending], deadline: Deadline) -> Gathered:
        """The outcomes of ``pending`` within ``deadline``, failures included (for a caller that follows
        a step's progress rank by rank, as recovery's drain does)."""
        return gather(pending, deadline, self._carriers(), stop_on_failure=False)

    def start_step(self, step: str, ranks: Sequence[int], args: Sequence[tuple[Any, ...]] | None = None,
                   what: str | None = None) -> list[Pending]:
        """:meth:`step` without waiting: the pending calls (for a caller that watches their progress)."""
        with self._send_lock:  # steps are awaited before the group takes calls again: the ledger need not know them
            parts = tuple(step_part(rank, step, () if args is None else args[i], self.nodes[rank], self.coords[rank])
                          for i, rank in enumerate(ranks))
            record = CallRecord.of_parts(next(self._ids), self.generation, what or step, parts)
            return self._tasks.send(record)


def _mapped_in(calls: Sequence[RankCall] | GroupCall, selection: Selection) -> tuple[Mapped, ...]:
    """The call's :class:`.files.Mapped` arguments, each once (what its pendings keep), each told
    which ranks it is sent to (each will open it once, and say when it let go)."""
    shares = calls.shares if isinstance(calls, GroupCall) else calls
    found: dict[int, tuple[Mapped, list[int]]] = {}
    for index, call in enumerate(shares):
        for value in (*call.args, *call.kwargs.values()):
            if isinstance(value, Mapped):
                found.setdefault(id(value), (value, []))[1].append(index)
    if not found:
        return ()
    if isinstance(calls, GroupCall):
        ranks_of: dict[int, list[int]] = {}
        for rank, share in zip(selection.ranks, selection.share):
            ranks_of.setdefault(share, []).append(rank)
    else:
        ranks_of = {index: [call.rank] for index, call in enumerate(calls)}
    for value, indices in found.values():
        value.expect([rank for index in indices for rank in ranks_of.get(index, ())])
    return tuple(value for value, _ in found.values())


def _share(role: str | None, method: str, call: RankCall, cache: Any, fetch_mark: bool) -> RankPart:
    """One share of a call, encoded (:func:`.wire.encode_rank_call`); its ``rank`` is set per rank later."""
    header, refs, slot = encode_rank_call(role, method, call, cache, fetch_mark)
    return RankPart(-1, header, tuple(refs), slot, call.trace, call.keep, returns=call.return_output)


def _by_call(pending: Sequence[Pending], outcomes: Mapping[int, Any]) -> list[tuple[int, list[int]]]:
    """``(call id, ranks)`` of the pending calls whose index is in ``outcomes``, one entry per call."""
    calls: dict[int, list[int]] = {}
    for i in outcomes:
        calls.setdefault(pending[i].call_id, []).append(pending[i].rank)
    return list(calls.items())
