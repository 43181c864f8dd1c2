"""Node agents: one Ray actor per node of a group that takes one message per call and serves its node's ranks through a call session.

Why: with a call session the controller's cost per call stops growing with ranks on its own
node, but a group spanning nodes cannot share one ring (shared memory is per machine).  An agent
on each node writes that node's ring (:class:`.session.CallSession`).  A call travels down the
tree as its description: the call's shares (encoded headers) and the key of its rank selection
(:class:`rankmesh.backend.Selection`).  The first call with a selection also carries each node's
plan for it (which reader runs which share); every agent keeps the plans of its subtree under
the key, so later calls of the same pattern carry no per-rank data at all, and the controller's
work per call does not grow with ranks (``docs/control_plane.md``).  The controller sizes each
command, so every carrier falls back to Ray's tasks at the same size.

**The tree.**  One Ray task costs its sender about as much as a task per rank did (~0.9 ms of
CPU here, ``docs/control_plane.md``), so a flat send would still cost the controller a second
per call at 1,024 nodes.  The agents therefore form a tree of ``fanout`` children per agent:
the controller sends to at most ``fanout`` agents, each forwards their share to its children
before serving its own node, and answers once for its whole subtree.

**One thread per agent.**  An agent runs each call on its default thread from start to answer:
it forwards, writes its ring, and waits for its ranks and its children in the one wait loop
(:func:`.waiting.gather`), so its session is only ever used by that thread.  :meth:`NodeAgent.give_up`
and :meth:`NodeAgent.close` run on its control thread: the controller gives a call up when it
abandons it, and the agent then answers with what it has.

**Answers.**  A :class:`NodeAnswer` is a subtree's answer: the outputs that are not ``None`` (a
rank outside the collect set sends none), the failed ranks' errors, and the ranks still running
(after a failure's grace, or the call's deadline); every other rank the call named finished with
``None``.  The controller fills its outputs from the answers (:meth:`AgentSession.outputs`) and
reads them rank by rank only when something failed or ran late (:class:`AgentAnswers`).  A child agent that died
is answered for its ranks as :class:`~rankmesh.errors.AgentLostError`; the controller then asks
those ranks' processes themselves (:meth:`AgentSession.poll`), so a rank is reported dead only if
its own process is gone, and the ranks of a dead agent are never confused with another node's.

**Non-blocking calls** (:meth:`NodeAgent.submit`) travel down the same tree, but every called
rank gets a Ray task from its agent, and each agent answers as soon as its subtree's tasks are
sent (:class:`AgentSends`); the controller never holds the data.  A future that reads only the
collect ranks (a ``DataProtoFuture``) gets their outputs' ObjectRefs, one per dp piece.  A future
that reads every rank's output (a ``GroupFuture``) gets two references per top agent
(:class:`Joined`): its subtree's answer, which the agent's :meth:`NodeAgent.join` makes once every
rank finished, read whole as a blocking call's answers are (:class:`JoinedCall`), and where each
rank's output is, read only when something failed or somebody asks for each rank's reference.
The agents own all of these (Ray makes the submitter the owner): agents replaced while they own
outputs somebody references are kept, idle, until nothing does
(:meth:`AgentSession.let_go_unowned`), and an output lost with a dead owner on a live rank is
told as such (:func:`owners_lost`).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray

from rankmesh.backend import Selection
from rankmesh.deadline import Deadline
from rankmesh.errors import AgentLostError, WorkerDiedError
from rankmesh.mesh import RankCoords

from .calls import CallRecord, Outcome, Pending
from .runtime import referenced_objects
from .session import COMMAND_MARGIN, PLANS_MAX, TAKE_PARKED_S, CallSession
from .tasks import RayTasks, ready_refs
from .waiting import PROCESS_DIED, Gathered, gather, translate_error
from .wire import COMMAND_BYTES, INLINE_BYTES, Command, encode_command

CONTROL_GROUP = "control"
#: The agent's own calls that join a non-blocking call's outputs (:meth:`NodeAgent.join`): they
#: run once the ranks finished, beside whatever call the agent's default thread runs.
JOIN_GROUP = "join"
#: Children per agent, and agents the controller sends to: up to 8 nodes take one level, 72 two,
#: 584 three (``AgentSession(fanout=...)``, ``RayWorkerGroup.set_control(agent_fanout=...)``).
AGENT_FANOUT = 8
#: How long the controller waits for the processes of a dead agent's ranks to say they live (seconds).
PROBE_S = 2.0
#: The longest an agent waits for a free slot in its node's ring when the call has no deadline
#: (seconds): a full ring means a rank there still runs an earlier call, and the controller is told.
WRITE_WAIT_S = 30.0

#: How long a session's opening waits for an agent started during a replacement
#: (:meth:`AgentSession.start_standby`) to answer, past :data:`PROBE_S` (seconds): its process
#: is new, and a node's first Ray worker may take seconds to start on a loaded machine.
AGENT_START_S = 15.0

#: The longest a non-blocking call waits for an agent to have sent its subtree's ranks their tasks,
#: when the call has no deadline (seconds): the agent first finishes the call it runs.
SUBMIT_WAIT_S = 300.0
#: The longest an agent's join of a non-blocking call (:meth:`NodeAgent.join`) waits for its
#: subtree (seconds); past it, it answers the ranks still running as such, and the controller
#: reads the call rank by rank.  Each join waits on a thread of its own, :data:`JOINS` at a time.
JOIN_WAIT_S = 300.0
#: Joins an agent waits for at once; a further one starts when one of them answered.
JOINS = 32
#: How long the controller waits for the agents of a joined non-blocking call to say where each
#: rank's output is (seconds; :meth:`JoinedCall.each`).  They put that before answering the
#: call, so a live agent says it in milliseconds; past the bound its ranks are unreached.
OUTPUTS_WAIT_S = 5.0
#: How long the controller waits for the retired agents (all asked at once) to say whether they
#: still own a referenced output, at a group change (seconds): one that does not answer is kept
#: and asked again at the next change.
OWNER_CHECK_S = 5.0

#: Rank sets whose last non-blocking call the controller keeps as a set (:meth:`AgentSession.last_unanswered`);
#: beyond that many, the oldest is folded rank by rank.
SUBMITTED_SETS = 64

#: Each node's plan for one selection (node id -> per reader, the share it runs or ``None``).
NodePlans = dict[str, tuple[int | None, ...]]


@dataclass(frozen=True)
class Stored:
    """A rank's output left in its node's object store (a data call's): the controller fetches it,
    and nobody on the way (the agents) ever holds its bytes."""

    ref: Any


def _fetch_stored(value: Any) -> Any:
    """``value``, or the output a :class:`Stored` refers to (fetched from its node's store)."""
    return ray.get(value.ref, timeout=TAKE_PARKED_S) if isinstance(value, Stored) else value


@dataclass(frozen=True)
class NodeAnswer:
    """A subtree's answer to a call: the outputs that are not ``None``, the failed ranks' errors, and
    the ranks still running; every other rank the call named finished with ``None``."""

    values: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    unfinished: tuple[int, ...] = ()

    @property
    def clean(self) -> bool:
        """Every rank finished without an error."""
        return not self.errors and not self.unfinished


@dataclass(frozen=True)
class SubtreeOutputs:
    """Where a subtree's output references are, for a caller that asks rank by rank
    (:meth:`JoinedCall.each`): this node's ranks' own, and per child the ranks it was sent and the
    reference of its own :class:`SubtreeOutputs`."""

    own: dict[int, Any]
    children: tuple[tuple[tuple[int, ...], Any], ...] = ()


@dataclass(frozen=True)
class Joined:
    """A subtree's answer to a non-blocking call whose future reads every rank's output
    (:meth:`NodeAgent.submit` with ``joined``): two ObjectRefs this agent owns, whatever its ranks.

    ``answer`` becomes the subtree's :class:`NodeAnswer` once every rank in it finished (an error
    as soon as one failed: the caller then reads rank by rank); ``outputs`` is its
    :class:`SubtreeOutputs`, read only by such a caller, or one that asks for each rank's reference.
    """

    answer: Any
    outputs: Any


def _lost(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class AgentAnswers:
    """The carrier of agents' answers (``name = "agent"``): a pending's handle is the ObjectRef of the
    answer that will hold its rank's outcome.  A dead agent is answered as :class:`AgentLostError`
    for every rank its answer would have held (its subtree's)."""

    name = "agent"

    def __init__(self) -> None:
        self._answers: dict[Any, tuple[NodeAnswer, frozenset[int]] | BaseException] = {}

    def read(self, refs: Sequence[Any], within: float) -> None:
        """Read the answers among ``refs`` that come within ``within`` seconds (kept for :meth:`poll`)."""
        refs = [ref for ref in dict.fromkeys(refs) if ref not in self._answers]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=within, fetch_local=False)
        for ref in ready:
            try:
                answer = ray.get(ref)
                self._answers[ref] = (answer, frozenset(answer.unfinished))
            except Exception as exc:  # noqa: BLE001 - the agent died (or lost its plans): its ranks are asked
                self._answers[ref] = exc

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        self.read([p.handle for p in pending], within)
        got: dict[int, Outcome] = {}
        for i, p in enumerate(pending):
            answer = self._answers.get(p.handle)
            if answer is None:
                continue
            if isinstance(answer, BaseException):
                got[i] = Outcome(error=AgentLostError(
                    f"the node agent serving rank {p.rank} (node {p.node}) died during {p.method}: {_lost(answer)}", [p.rank]))
                continue
            node_answer, unfinished = answer
            if p.rank in node_answer.errors:
                got[i] = Outcome(error=node_answer.errors[p.rank])
            elif p.rank not in unfinished:
                try:
                    got[i] = Outcome(_fetch_stored(node_answer.values.get(p.rank)))
                except Exception as exc:  # noqa: BLE001 - its owner (the agent) or its node is gone: the rank's error
                    got[i] = Outcome(error=exc)
        return got

    def forget(self, handles: Sequence[Any]) -> None:
        for handle in handles:
            self._answers.pop(handle, None)


class ChildAnswers:
    """An agent's carrier for its children's answers (``name = "child"``): one pending per child,
    done when the child answered, failed when anything in its subtree failed (the wait loop's
    fail-fast grace then starts) or the child's agent died."""

    name = "child"

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        refs = [p.handle for p in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=within, fetch_local=False)
        got: dict[int, Outcome] = {}
        done = set(ready)
        for i, ref in enumerate(refs):
            if ref not in done:
                continue
            try:
                answer = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the child's agent died (or lost its plans)
                got[i] = Outcome(error=exc)
                continue
            first_error = next(iter(answer.errors.values()), None)
            got[i] = Outcome(answer, first_error)
        return got


class RankTasks:
    """An agent's carrier for the Ray tasks it sent its own node's ranks (``name = "task"``: a data
    call, :meth:`.host.WorkerHost.execute_for`).  A pending's handle is ``(flag, output)``, the
    task's two returns: done once the flag is in.

    An output Ray already brought back with the task's reply (up to :data:`INLINE_BYTES`) is
    answered inline; a larger one stays in the rank's node's store and is answered by reference
    (:class:`Stored`), for the controller to fetch from there."""

    name = "task"

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        done = ready_refs([p.handle[0] for p in pending], within)
        got: dict[int, Outcome] = {}
        outputs: dict[int, Any] = {}
        for i, p in enumerate(pending):
            flag, output = p.handle
            if flag not in done:
                continue
            try:
                if ray.get(flag):
                    outputs[i] = output
                else:
                    got[i] = Outcome(None)
            except Exception as exc:  # noqa: BLE001 - the rank's error (or its death), as the controller names it
                got[i] = Outcome(error=translate_error(pending[i], exc))
        if outputs:
            got.update((i, Outcome(value)) for i, value in _small_inline(outputs).items())
        return got


def _small_inline(outputs: Mapping[int, Any]) -> dict[int, Any]:
    """Each output (a task's return ref, by index) as its value when it is small enough for Ray to
    have returned it inside the task's reply (:data:`INLINE_BYTES`), else as a :class:`Stored`
    reference.  The sizes come from the owner's record (``get_object_locations``), which knows
    them once the task replied, before any location is registered."""
    try:
        where = ray.experimental.get_object_locations(list(outputs.values()))
    except Exception:  # noqa: BLE001 - no location service: every output by reference
        where = {}
    out: dict[int, Any] = {}
    for i, ref in outputs.items():
        size = (where.get(ref) or {}).get("object_size")
        out[i] = ray.get(ref, timeout=TAKE_PARKED_S) if size is not None and size <= INLINE_BYTES else Stored(ref)
    return out


@dataclass
class Route:
    """What an agent keeps of one selection: its subtree's plans, its own node's, and the ranks the selection names below each child."""

    plans: NodePlans  # this subtree's nodes' plans
    mine: tuple[int | None, ...] | None  # this node's plan, None when the call names none of its ranks
    children: dict[str, tuple[int, ...]]  # child node id -> the ranks the call names in its subtree


class NodeAgent:
    """Ray actor body (see :func:`start_agents`): the call session of one group's ranks on one
    node, and the agents of its children in the tree (see the module docstring)."""

    def __init__(self) -> None:
        self._session: CallSession | None = None
        self._node = ""
        self._children: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._ranks_of: dict[str, list[int]] = {}
        self._routes: dict[int, Route] = {}  # a selection's key -> what this agent keeps of it
        self._told: dict[str, set[int]] = {}  # child -> the keys whose plans it was sent
        self._open: dict[int, Any] = {}  # rank -> the flag of the last Ray task sent to it, not seen finished
        self._given_up: set[int] = set()
        self._lock = threading.Lock()  # guards _given_up and _session between the two threads
        self._me: Any = None  # this actor's own handle, for the joins of non-blocking calls

    def open(self, ranks: Sequence[int], actors: Mapping[int, Any], pids: Mapping[int, int],
             nodes: Sequence[str | None], coords: Sequence[RankCoords | None], node: str = "",
             children: Mapping[str, tuple[Any, Sequence[str]]] | None = None,
             ranks_of: Mapping[str, Sequence[int]] | None = None) -> int:
        """Open a session with this node's ``ranks`` (rank-indexed ``nodes``/``coords``); returns this pid.

        ``node`` is this agent's node id; ``children`` maps each child agent's node id to its
        handle and the node ids of its subtree (itself first); ``ranks_of`` gives the ranks of
        every node below this one, to name them if a child's agent dies."""
        if self._session is not None:
            self._session.close()
        session = CallSession(ranks, actors, pids, nodes, coords)
        session.open()
        with self._lock:
            self._session = session
        self._node = node
        self._children = {child: (handle, tuple(subtree)) for child, (handle, subtree) in (children or {}).items()}
        self._ranks_of = {n: list(r) for n, r in (ranks_of or {}).items()}
        self._routes, self._told, self._open = {}, {child: set() for child in self._children}, {}
        return os.getpid()

    def _route(self, key: int | None, plans: NodePlans | None) -> Route | None:
        """What this agent does for selection ``key`` (its ``plans``, sent with the call the first time)."""
        if plans is None:
            return self._routes.get(key) if key is not None else None
        children = {}
        for child, (_, below) in self._children.items():
            called = tuple(r for n in below if n in plans for r, share in zip(self._ranks_of.get(n, ()), plans[n])
                           if share is not None)
            if called:
                children[child] = called
        mine = plans.get(self._node)
        route = Route(plans, mine if mine is not None and any(s is not None for s in mine) else None, children)
        if key is not None and len(self._routes) < PLANS_MAX:
            self._routes[key] = route
        return route

    def call(self, call_id: int, method: str, headers: tuple[bytes, ...], refs: tuple[tuple[Any, ...], ...],
             key: int | None, plans: NodePlans | None, timeout_s: float | None, generation: int = 0) -> NodeAnswer:
        """Run call ``call_id`` (its encoded ``headers``) on the ranks of this subtree that selection
        ``key`` names, and wait for every one of them.  ``refs[s]``: share ``s``'s objects in the
        store (a data call's pieces; ``()``: none), held here under Ray's own serialization.
        ``plans``: the selection's plans for this subtree's nodes, sent with the first call of it
        (``None`` after: this agent keeps them).

        Children get the call first; this node's ranks run meanwhile.  A rank whose share has
        objects gets it as a Ray task (Ray fetches each piece into this node's store once, and
        each rank reads it there, copy-on-write); the others through the node's ring.  A rank
        with a Ray task of this agent not seen finished gets a Ray task too (Ray keeps one
        caller's tasks in order), and a Ray task to a rank with an unanswered ring call runs
        after it (:meth:`.host.WorkerHost.execute_for`)."""
        deadline = Deadline.after(timeout_s)
        route = self._route(key, plans)
        if route is None:  # the controller thinks this agent keeps the plans, and it does not: say so, name nobody
            raise AgentLostError(f"{method}: node agent {self._node} has no plans for selection {key}; "
                                 "the group starts new agents", [])
        pending: list[Pending] = []
        if self._open:  # this agent's Ray tasks seen finished: their ranks may take the ring again
            done = ready_refs(list(self._open.values()), 0)
            self._open = {r: flag for r, flag in self._open.items() if flag not in done}
        for child, called in route.children.items():
            ref = self._children[child][0].call.remote(
                call_id, method, headers, refs, key, self._plans_for(child, key, route), deadline.timeout(), generation)
            pending.append(Pending(ref, called[0], method, child, None, ChildAnswers.name, call_id, generation))
        session = self._session
        if route.mine is not None:
            called = [r for r, share in zip(self._node_ranks(), route.mine) if share is not None]
            if session is None:
                return self._merge(pending, {}, {r: AgentLostError(f"{method}: the node agent's call session is closed", [r])
                                                 for r in called}, route, ())
            by_task = {r: share for r, share in zip(session.ranks, route.mine)
                       if share is not None and ((refs and refs[share]) or r in self._open)}
            plan = route.mine if not by_task else tuple(None if r in by_task else s for r, s in zip(session.ranks, route.mine))
            ring = [r for r in called if r not in by_task]
            if ring:
                try:
                    message = session.encode(Command(call_id, call_id, headers, plan))
                    session.write(message, call_id, method, deadline.bounded(WRITE_WAIT_S), ring)
                except Exception as exc:  # noqa: BLE001 - a full or aborted ring: every rank of this node fails with it
                    return self._merge(pending, {}, {r: exc for r in ring}, route, ())
                pending += [Pending(call_id, r, method, None, None, session.name, call_id, generation) for r in ring]
            if by_task:
                owed = session.last_unanswered()
                for rank, share in by_task.items():
                    flag, output = session.actors[rank].execute_for.options(num_returns=2).remote(
                        call_id, owed.get(rank, 0), deadline.timeout(), headers[share], *(refs[share] if refs else ()))
                    self._open[rank] = flag
                    pending.append(Pending((flag, output), rank, method, None, None, RankTasks.name, call_id, generation))
        got = self._wait(call_id, pending, deadline,
                         {"session": session, ChildAnswers.name: ChildAnswers(), RankTasks.name: RankTasks()})
        for i in got.outcomes:  # this agent's Ray tasks seen finished: a later call may take the ring again
            p = pending[i]
            if p.carrier == RankTasks.name and self._open.get(p.rank) is p.handle[0]:
                del self._open[p.rank]
        return self._merge(pending, got.outcomes, {}, route, got.unfinished)

    def submit(self, call_id: int, method: str, headers: tuple[bytes, ...], refs: tuple[tuple[Any, ...], ...],
               key: int | None, plans: NodePlans | None, timeout_s: float | None, generation: int = 0,
               answering: tuple[bool, ...] | None = None, joined: bool = False) -> dict[int, Any] | Joined:
        """Send non-blocking call ``call_id`` to the ranks of this subtree that selection ``key``
        names, and return at once each rank's output reference (``{rank: ObjectRef}``), owned by
        this agent (its child's, for a rank below): the controller's future holds them, and
        another group's ranks fetch them from the producers' stores.  Arguments as :meth:`call`'s;
        ``answering[s]``: whether share ``s``'s ranks send an output back (given when the caller
        keeps only theirs: the other ranks run the call, and their references are not returned).
        ``joined`` (a future that reads every rank's output): return a :class:`Joined` instead, two
        references for the whole subtree, so the controller receives none per rank.

        Every rank gets a Ray task (a non-blocking call's outputs are ObjectRefs), after the ring
        call it has not finished (the host waits for it), and stays open here, so this agent's
        next call to it is a Ray task too (Ray keeps one caller's tasks in order).  ``timeout_s``
        (else :data:`SUBMIT_WAIT_S`) bounds the wait for the children's sends; a child that fails
        to send fails the call."""
        deadline = Deadline.after(timeout_s).bounded(SUBMIT_WAIT_S)
        route = self._route(key, plans)
        if route is None:
            raise AgentLostError(f"{method}: node agent {self._node} has no plans for selection {key}; "
                                 "the group starts new agents", [])
        sent = [(child, called, self._children[child][0].submit.remote(
                    call_id, method, headers, refs, key, self._plans_for(child, key, route), deadline.timeout(), generation,
                    answering, joined))
                for child, called in route.children.items()]
        outputs: dict[int, Any] = {}
        flags: list[Any] = []
        if route.mine is not None:
            session = self._session
            if session is None:
                raise AgentLostError(f"{method}: the node agent of node {self._node} has no call session",
                                     [r for r, share in zip(self._node_ranks(), route.mine) if share is not None])
            owed = session.last_unanswered()
            for rank, share in zip(session.ranks, route.mine):
                if share is not None:
                    flag, output = session.actors[rank].execute_for.options(num_returns=2).remote(
                        call_id, owed.get(rank, 0), None, headers[share], *(refs[share] if refs else ()))
                    self._open[rank] = flag
                    if answering is None or answering[share]:
                        outputs[rank] = output
                        flags.append(flag)
        below: list[tuple[tuple[int, ...], Any]] = []
        for child, called, ref in sent:
            try:
                answer = ray.get(ref, timeout=deadline.timeout())
            except Exception as exc:  # noqa: BLE001 - the child (or one below it) did not send: the call fails, naming its ranks
                if isinstance(exc, AgentLostError):
                    raise
                raise AgentLostError(f"{method}: the node agent of node {child} did not send its ranks the call: "
                                     f"{_lost(exc)}", list(called)) from exc
            if joined:
                below.append((called, answer))
            else:
                outputs.update(answer)
        if not joined:
            return outputs
        if self._me is None:
            self._me = ray.get_runtime_context().current_actor
        # The join waits on its own thread: its pendings travel inside a list, so Ray starts it at
        # once and a later call's join never waits for this one's ranks.
        pending = [Pending(flag_output, rank, method, None, None, RankTasks.name, call_id, generation)
                   for rank, flag_output in zip(outputs, zip(flags, outputs.values()))]
        pending += [Pending(j.answer, called[0], method, child, None, ChildAnswers.name, call_id, generation)
                    for (child, called, _), (_, j) in zip(sent, below)]
        answer = self._me.join.remote(pending, {child: called for child, called, _ in sent}, JOIN_WAIT_S)
        return Joined(answer, ray.put(SubtreeOutputs(outputs, tuple((called, j.outputs) for called, j in below))))

    @ray.method(concurrency_group=JOIN_GROUP)
    def join(self, pending: list[Pending], children: dict[str, tuple[int, ...]], timeout_s: float) -> NodeAnswer:
        """A joined non-blocking call's subtree answer (:class:`Joined`): this node's ranks' tasks
        and the children's answers, waited for in the one wait loop within ``timeout_s`` (a failure
        answers after the loop's grace; past the bound the ranks still running are answered so, and
        the controller reads them rank by rank).  Outputs Ray brought back with a task's reply go
        inside the answer; larger ones stay in their node's store (:class:`Stored`)."""
        got = gather(pending, Deadline.after(timeout_s), {ChildAnswers.name: ChildAnswers(), RankTasks.name: RankTasks()})
        return self._merge(pending, got.outcomes, {}, Route({}, None, dict(children)), got.unfinished)

    def _plans_for(self, child: str, key: int | None, route: Route) -> NodePlans | None:
        """The plans to send ``child`` with a call of selection ``key``: its subtree's, the first
        time; ``None`` once it keeps them."""
        told = self._told[child]
        if key is not None and key in told:
            return None
        if key is not None and len(told) < PLANS_MAX:
            told.add(key)
        below = self._children[child][1]
        return {n: route.plans[n] for n in below if n in route.plans}

    def _merge(self, pending: Sequence[Pending], outcomes: Mapping[int, Outcome], errors: Mapping[int, BaseException],
               route: Route, unfinished: Sequence[int]) -> NodeAnswer:
        """One answer for the subtree: this node's ranks' outcomes, and every child's answer."""
        values: dict[int, Any] = {}
        errors = dict(errors)
        late: list[int] = []
        for i, p in enumerate(pending):
            outcome = outcomes.get(i)
            if p.carrier == ChildAnswers.name:
                called = route.children[p.node]
                if outcome is None:
                    late.extend(called)
                elif isinstance(outcome.value, NodeAnswer):
                    values.update(outcome.value.values)
                    errors.update(outcome.value.errors)
                    late.extend(outcome.value.unfinished)
                else:  # the child's agent died: its ranks' outcome is unknown (the controller asks their processes)
                    why = f"the node agent of node {p.node} died during {p.method}: {_lost(outcome.error)}"
                    errors.update((r, AgentLostError(why, [r])) for r in called)
            elif outcome is None:
                late.append(p.rank)
            elif outcome.error is not None:
                errors[p.rank] = outcome.error
            elif outcome.value is not None:
                values[p.rank] = outcome.value
        return NodeAnswer(values, errors, tuple(sorted(late)))

    def _wait(self, call_id: int, pending: Sequence[Pending], deadline: Deadline, carriers: Mapping[str, Any],
              stop_on_failure: bool = True) -> Gathered:
        """The one wait loop: until done, failed (its grace over), past the deadline, or given up."""
        def given_up() -> bool:
            with self._lock:
                return call_id in self._given_up

        got = gather(pending, deadline, carriers, stop_on_failure=stop_on_failure, stop=given_up)
        with self._lock:
            self._given_up.discard(call_id)
        return got

    def _node_ranks(self) -> tuple[int, ...]:
        return () if self._session is None else self._session.ranks

    @ray.method(concurrency_group=CONTROL_GROUP)
    def give_up(self, call_id: int) -> None:
        """The controller abandoned call ``call_id``: answer it with what is in (at the wait loop's next look)."""
        with self._lock:
            self._given_up.add(call_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def close(self) -> None:
        """Give the session up: the hosts' session threads end, dropping calls they have not read.
        The flags of the Ray tasks this agent sent go too, so that only references held by others
        keep it alive (:meth:`holds_references`)."""
        with self._lock:
            session, self._session = self._session, None
            self._open = {}
        if session is not None:
            session.close(stop=False)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def pid(self) -> int:
        """This agent's pid: whether it lives and answers, before a new session takes it over."""
        return os.getpid()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def holds_references(self) -> bool:
        """Whether Ray's reference table in this process still lists an object: an output this
        agent owns that a future elsewhere names, or one it borrows.  A retired agent lives while
        it does (:meth:`AgentSession.let_go_unowned`)."""
        gc.collect()  # a reference only a cycle keeps is not one anybody can use
        return referenced_objects() > 0


def ping_ranks(actors: Sequence[Any], ranks: Sequence[int]) -> tuple[set[int], dict[int, str]]:
    """Ask ``ranks``' processes at once, on their control threads, within :data:`PROBE_S`: the
    ranks that answered, and those with no process any more (each with why).  A rank in neither
    did not answer in time: neither alive nor dead as far as anyone here can tell."""
    refs = {actors[r].ping.remote(): r for r in ranks}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_S, fetch_local=False)
    answered, dead = set(), {}
    for ref in ready:
        try:
            ray.get(ref)
            answered.add(refs[ref])
        except PROCESS_DIED as exc:
            dead[refs[ref]] = _lost(exc)
        except Exception:  # noqa: BLE001 - answered, with an error of its own: the process lives
            answered.add(refs[ref])
    return answered, dead


def dead_ranks(actors: Sequence[Any], ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` have no process any more, each with why (:func:`ping_ranks`: one that
    does not answer in time is not called dead)."""
    return ping_ranks(actors, ranks)[1]


def owners_lost(actors: Sequence[Any], failures: Sequence[tuple[Pending, BaseException]]) -> list[tuple[Pending, BaseException]]:
    """``failures`` with each object lost with its owner, on a rank that lives, told as an
    :class:`AgentLostError` rather than the rank's death.

    A non-blocking call sent through the node agents leaves its outputs owned by the agent that
    sent each rank its task (Ray makes the submitter the owner).  Should that agent die before a
    future is read, Ray reports the output lost with its owner, which says nothing of the rank:
    counted as the rank's death it would fail a group whose every process lives.  So the ranks are
    asked (:func:`dead_ranks`)."""
    lost = sorted({p.rank for p, e in failures if isinstance(e, ray.exceptions.OwnerDiedError)})
    if not lost:
        return list(failures)
    dead = dead_ranks(actors, lost)
    told = []
    for pending, exc in failures:
        if isinstance(exc, ray.exceptions.OwnerDiedError) and pending.rank not in dead:
            exc = AgentLostError(f"{pending.method}: rank {pending.rank}: an object of this call (its output, or a "
                                 f"future's output passed to it) was lost with its owner, the node agent that sent a "
                                 f"non-blocking call ({_lost(exc)}); the rank lives and the group stays usable: make "
                                 f"the call again", [pending.rank])
        told.append((pending, exc))
    return told


def start_agents(node_ids: Sequence[str]) -> dict[str, Any]:
    """One :class:`NodeAgent` per node id, pinned there (``num_cpus=0``); by node id."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(num_cpus=0, concurrency_groups={CONTROL_GROUP: 1, JOIN_GROUP: JOINS})(NodeAgent)
    return {
        node: cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote()
        for node in node_ids
    }


def agent_tree(nodes: Sequence[str], fanout: int) -> tuple[list[str], dict[str, list[str]]]:
    """The tops (the controller's children) and each node's children, for ``nodes`` in order.

    Breadth first, ``fanout`` children each: ``nodes[:fanout]`` are the tops, and ``nodes[i]``'s
    children are ``nodes[fanout * (i + 1):fanout * (i + 2)]``."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"agent fanout must be a positive integer, got {fanout!r}")
    children = {node: list(nodes[fanout * (i + 1):fanout * (i + 2)]) for i, node in enumerate(nodes)}
    return list(nodes[:fanout]), children


def subtree(node: str, children: Mapping[str, Sequence[str]]) -> list[str]:
    """``node`` and every node below it in the tree, breadth first."""
    out = [node]
    for below in out:
        out.extend(children[below])
    return out


# ----- the controller's end ------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What the controller keeps of one selection for its agents: the tops the call goes to, each
    top's subtree plans, each selected rank's top (an index into ``tops``), the largest node plan
    (to size a command) and each selected rank's place in the call's outputs."""

    tops: tuple[str, ...]
    plans: dict[str, NodePlans]
    top_of: tuple[int, ...]
    biggest: tuple[int | None, ...]
    index_of: dict[int, int]


class AgentCall(Sequence[Pending]):
    """The pending calls of one call sent to node agents: one answer per top agent, the ranks' pendings made only if asked for.

    The controller's usual wait reads the top agents' answers whole (:meth:`AgentSession.outputs`);
    a call that failed or ran late is waited for rank by rank, as every carrier's is.
    """

    def __init__(self, record: CallRecord, refs: Sequence[Any], plan: Plan) -> None:
        self.record, self.refs, self.plan = record, list(refs), plan
        self.answers: dict[Any, NodeAnswer] = {}  # the top agents' answers read so far (AgentSession.outputs)
        self.call_id, self.generation, self.method = record.call_id, record.generation, record.method
        self._each: list[Pending] | None = None

    def each(self) -> list[Pending]:
        if self._each is None:
            refs, top_of = self.refs, self.plan.top_of
            self._each = self.record.pending(AgentSession.name, [refs[top_of[i]] for i in range(len(top_of))])
        return self._each

    def __len__(self) -> int:
        return len(self.plan.top_of)

    def __getitem__(self, index: Any) -> Any:
        return self.each()[index]

    def __iter__(self) -> Any:
        return iter(self.each())


class NoOutput:
    """The carrier of a rank that sends no output back in a call whose caller keeps only the
    outputs (``name = "none"``, :attr:`.calls.CallRecord.outputs_only`): its pending is a
    placeholder, done at once with ``None``.  The rank still runs the call; its node agent keeps
    its task in order with the rank's next calls."""

    name = "none"

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        return {i: Outcome(None) for i in range(len(pending))}


class AgentSends:
    """A non-blocking call sent to the node agents, until each top agent said its subtree's ranks
    have their tasks (:meth:`resolve`).

    A call whose caller keeps only the outputs (:attr:`.calls.CallRecord.outputs_only`) then gets
    one Ray-task pending per rank that sends an output back, whose handle is the ObjectRef of the
    rank's output (an agent owns it), as a future's parts are on Ray's tasks, and a
    :class:`NoOutput` placeholder for every other rank: the controller receives one reference per
    collect rank.  Any other call (its future reads every rank's output) gets a
    :class:`JoinedCall`: two references per top agent, none per rank."""

    def __init__(self, record: CallRecord, refs: Sequence[Any], plan: Plan) -> None:
        self.record, self.refs, self.plan = record, list(refs), plan

    def __len__(self) -> int:
        return len(self.record.selection.ranks)

    def resolve(self) -> Sequence[Pending]:
        """Wait for the top agents' sends (bounded: the call's deadline, else :data:`SUBMIT_WAIT_S`);
        raises :class:`~rankmesh.errors.AgentLostError` naming the ranks when an agent did not send."""
        record = self.record
        try:
            answers = ray.get(self.refs, timeout=record.deadline.bounded(SUBMIT_WAIT_S).timeout())
        except Exception as exc:  # noqa: BLE001 - an agent died or is stuck in an earlier call: say which ranks
            cause = getattr(exc, "cause", exc)  # an agent's own AgentLostError comes wrapped by Ray
            if isinstance(cause, AgentLostError):
                raise AgentLostError(str(cause), cause.ranks) from exc
            raise AgentLostError(
                f"{record.method}: the node agents did not say within the call's bound that every rank was sent "
                f"the call ({_lost(exc)}); the next call starts new agents", list(record.ranks)) from exc
        if not record.outputs_only:
            return JoinedCall(record, [a.answer for a in answers], [a.outputs for a in answers], self.plan)
        outputs: dict[int, Any] = {}
        for answer in answers:
            outputs.update(answer)
        return OutputsOnly(record, outputs)


class JoinedCall(AgentCall):
    """A non-blocking call on the node agents whose future reads every rank's output: the top
    agents' :class:`Joined` answers.

    Read whole like a blocking call's answers (:meth:`AgentSession.outputs`: ``refs`` are the
    subtrees' answers, ready once their ranks finished), so the controller holds and reads
    nothing per rank.  :meth:`each` (a call that failed or ran late, or a caller that wants each
    rank's reference: ``GroupFuture.handles``) reads where the outputs are, from every agent down
    the tree, and gives one Ray-task pending per rank whose handle is the rank's output reference,
    as Ray's own tasks would: an agent that died gives its subtree's ranks its lost reference,
    which reads as the owner's death (:func:`owners_lost` tells the ranks' fate).
    """

    def __init__(self, record: CallRecord, refs: Sequence[Any], outputs: Sequence[Any], plan: Plan) -> None:
        super().__init__(record, refs, plan)
        self.outputs = list(outputs)

    @property
    def waits(self) -> tuple[Any, ...]:
        """What says the call is done: one answer per top agent (:class:`rankmesh.backend.JoinedPendings`)."""
        return tuple(self.refs)

    def each(self) -> list[Pending]:
        if self._each is None:
            ranks = self.record.selection.ranks
            under: list[list[int]] = [[] for _ in self.outputs]  # each top's ranks
            for rank, top in zip(ranks, self.plan.top_of):
                under[top].append(rank)
            found, unreached = _find_outputs(list(zip(self.outputs, under)), OUTPUTS_WAIT_S)
            lost = None
            if unreached:
                lost = AgentLostError(
                    f"{self.method}: the node agents serving ranks {sorted(unreached)} did not say within "
                    f"{OUTPUTS_WAIT_S:g} s where their outputs are ({next(iter(unreached.values()))}); the ranks may "
                    "live (a partitioned or overloaded node), and what the call did there is unknown; the group's "
                    "next call starts new agents", sorted(unreached))
            self._each = [self.record.pending_at(i, RayTasks.name, found[rank]) if rank in found
                          else self.record.pending_at(i, Unreached.name, lost) for i, rank in enumerate(ranks)]
        return self._each

    def __iter__(self) -> Any:
        """Each rank's pending, whose handle is its output reference (``GroupFuture.handles``);
        raises :class:`~rankmesh.errors.AgentLostError` for ranks whose agents cannot say where
        their outputs are, since no reference of theirs can be given."""
        each = self.each()
        lost = next((p.handle for p in each if p.carrier == Unreached.name), None)
        if lost is not None:
            raise lost
        return iter(each)


def _find_outputs(tops: Sequence[tuple[Any, Sequence[int]]], within: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Each rank's output reference, read from the :class:`SubtreeOutputs` of ``tops`` (each
    with its ranks) and below them, level by level, all within ``within`` seconds: ``(found,
    unreached)``.  Where an agent on the way died, its reference stands for its ranks' (reading
    it says the owner died, and :func:`owners_lost` asks the ranks); ranks whose agent did not
    answer in time are ``unreached``, with why."""
    found: dict[int, Any] = {}
    unreached: dict[int, str] = {}
    deadline = Deadline.after(within)
    level = list(tops)
    while level:
        refs = [ref for ref, _ in level]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline.left(), fetch_local=True)
        done = set(ready)
        below: list[tuple[Any, Sequence[int]]] = []
        for ref, ranks in level:
            if ref not in done:
                unreached.update(dict.fromkeys(ranks, "no answer"))
                continue
            try:
                where = ray.get(ref)
            except Exception:  # noqa: BLE001 - the agent died: its ranks' outputs went with it
                found.update(dict.fromkeys(ranks, ref))
                continue
            found.update(where.own)
            below += [(child, called) for called, child in where.children]
        level = below
    return found, unreached


class Unreached:
    """The carrier of ranks whose agents could not say where their outputs are (``name =
    "unreached"``, :meth:`JoinedCall.each`): a pending's handle is the
    :class:`~rankmesh.errors.AgentLostError` it is answered with, at once."""

    name = "unreached"

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        return {i: Outcome(error=p.handle) for i, p in enumerate(pending)}


class OutputsOnly(Sequence[Pending]):
    """The pendings of a non-blocking call whose caller keeps only the outputs
    (:attr:`.calls.CallRecord.outputs_only`), made as they are asked for: a Ray-task pending for a
    rank whose output reference its agent sent back, a :class:`NoOutput` placeholder for any other.
    The caller asks for the collect ranks' alone, so nothing here is per rank."""

    def __init__(self, record: CallRecord, outputs: Mapping[int, Any]) -> None:
        self.record, self.outputs = record, outputs
        self._made: dict[int, Pending] = {}

    def __len__(self) -> int:
        return len(self.record.selection.ranks)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        made = self._made.get(index)
        if made is None:
            handle = self.outputs.get(self.record.selection.ranks[index])
            made = self._made[index] = self.record.pending_at(
                index, NoOutput.name if handle is None else RayTasks.name, handle)
        return made

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))


class AgentSession:
    """The controller's end of a group's node agents: one call is one Ray task to each of at most
    ``fanout`` agents, which forward it down their subtrees (see the module docstring).

    ``node_ids[r]`` is rank ``r``'s Ray node; every node gets an agent (the controller's own too,
    so that one path serves the whole group).  A carrier (``name = "agent"``), as
    :class:`.session.CallSession` is.
    """

    name = "agent"

    def __init__(self, actors: Sequence[Any], pids: Sequence[int], node_ids: Sequence[str],
                 nodes: Sequence[str | None], coords: Sequence[RankCoords | None], fanout: int = AGENT_FANOUT) -> None:
        self.ranks = tuple(range(len(actors)))
        self.served = frozenset(self.ranks)
        self.actors, self.pids = list(actors), list(pids)
        self.nodes, self.coords = list(nodes), list(coords)
        self.by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(node_ids):
            self.by_node.setdefault(node, []).append(rank)
        self.node_of = {rank: node for node, ranks in self.by_node.items() for rank in ranks}
        self.reader_of = {rank: i for ranks in self.by_node.values() for i, rank in enumerate(ranks)}
        self.tops, self.children = agent_tree(list(self.by_node), fanout)
        self.top_of = {n: top for top in self.tops for n in subtree(top, self.children)}
        self.agents: dict[str, Any] = {}
        self._answers = AgentAnswers()
        self._lock = threading.Lock()
        self._plans: dict[int, Plan] = {}  # a selection's key -> its plan (made once)
        self._told: set[int] = set()  # the keys whose plans the agents keep
        self._unsettled: dict[int, tuple[int, ...] | set[int]] = {}  # call id -> its ranks whose outcome was not read
        # The last non-blocking call sent to each rank set (its hosts mark it done), kept per set of ranks
        # (a selection's, the same tuple for every call of it: id -> (call id, ranks)), not per rank.
        self._submitted: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._submitted_before: dict[int, int] = {}  # rank -> the same, folded from sets beyond SUBMITTED_SETS
        self._inherited = False  # agents taken over from a session that owned outputs (open(reuse=...))
        self.standby: dict[str, Any] = {}  # node -> an agent serving nothing yet (open(standby=...))
        self._starting: set[str] = set()  # standby nodes whose agents start_standby started, not yet probed
        #: The nodes whose agents :meth:`open` started itself (the others it took over).
        self.started: list[str] = []

    def open(self, timeout_s: float = 60.0, reuse: AgentSession | None = None, standby: Sequence[str] = ()) -> None:
        """Start an agent on each node, or take over the live agent that ``reuse`` (an earlier
        session of the group, retired) has there; also start one, serving nothing yet, on each
        node of ``standby`` (the group's warm spares' nodes without a rank).

        Why: a new agent is a new Ray worker process, seconds of start-up and imports that the
        group's first call after a replacement would wait for.  After a rank's replacement most
        nodes still hold the group's ranks, and a warm spare that took a rank's place on a node of
        its own finds an agent there already.  A taken agent keeps owning the outputs of the
        non-blocking calls it sent (:attr:`owns_outputs` carries over); the agents not taken stay
        with ``reuse``.  If opening fails, the taken agents go back to ``reuse``."""
        taken = reuse.hand_over([*self.by_node, *standby]) if reuse is not None else {}
        self.started = [n for n in self.by_node if n not in taken]
        self.agents = {**start_agents(self.started), **{n: a for n, a in taken.items() if n in self.by_node}}
        self.standby = {**start_agents([n for n in standby if n not in taken and n not in self.by_node]),
                        **{n: a for n, a in taken.items() if n not in self.by_node}}
        self._inherited = bool(taken) and reuse is not None and reuse.owns_outputs
        try:
            opened = []
            for node, ranks in self.by_node.items():
                kids = {child: (self.agents[child], subtree(child, self.children)) for child in self.children[node]}
                below = {n: self.by_node[n] for child in self.children[node] for n in subtree(child, self.children)}
                opened.append(self.agents[node].open.remote(
                    ranks, {r: self.actors[r] for r in ranks}, {r: self.pids[r] for r in ranks}, self.nodes, self.coords,
                    node, kids, below))
            ray.get(opened, timeout=timeout_s)
        except BaseException:
            if reuse is not None:
                reuse.standby.update(taken)
            self.agents = {n: a for n, a in self.agents.items() if n not in taken}
            self.standby = {n: a for n, a in self.standby.items() if n not in taken}
            self.close()
            raise

    def hand_over(self, nodes: Sequence[str]) -> dict[str, Any]:
        """This retired session's agents (serving or standby) on ``nodes`` that answer within
        :data:`PROBE_S`, given up by it (a later session serves with them); a dead or silent one
        stays here."""
        held = {**self.standby, **self.agents}
        asked = {held[n].pid.remote(): n for n in dict.fromkeys(nodes) if n in held}
        if not asked:
            return {}
        ready, rest = ray.wait(list(asked), num_returns=len(asked), timeout=PROBE_S, fetch_local=True)
        starting = [ref for ref in rest if asked[ref] in self._starting]
        if starting:  # started moments ago (start_standby): its process may still be importing
            more, _ = ray.wait(starting, num_returns=len(starting), timeout=AGENT_START_S, fetch_local=True)
            ready += more
        taken = {}
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:  # gone with its node: its outputs are lost already
                continue
            node = asked[ref]
            taken[node] = self.agents.pop(node, None) or self.standby.pop(node)
            self._starting.discard(node)
        return taken

    def start_standby(self, nodes: Sequence[str]) -> list[str]:
        """Start an agent, serving nothing yet, on each of ``nodes`` where this retired session
        holds none; the nodes started on.

        Why: the nodes of a replacement's new processes may hold no agent of the group (a lost
        node's ranks placed again elsewhere, a spare refilled after the session opened).  An
        agent is a new Ray worker process, 1.2-2.3 s of start-up and imports here, which the
        first call after the replacement would wait for; started while the new ranks start,
        import and restore, it is ready when the next session takes it (:meth:`hand_over`)."""
        missing = [n for n in dict.fromkeys(nodes) if n and n not in self.agents and n not in self.standby]
        self.standby.update(start_agents(missing))
        self._starting.update(missing)
        return missing

    def drop_standby(self) -> None:
        """End the standby agents (they serve nothing and own nothing)."""
        standby, self.standby = self.standby, {}
        for agent in standby.values():
            try:
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass

    @property
    def owns_outputs(self) -> bool:
        """Whether these agents sent non-blocking calls, or were taken over from a session that
        did: they own those outputs (futures may still name them)."""
        return bool(self._submitted or self._submitted_before or self._inherited)

    def retire(self) -> None:
        """Stop serving (each agent closes its node's session) but keep the agents alive: they own
        the outputs of the non-blocking calls they sent.  :meth:`close` ends them."""
        for agent in self.agents.values():
            try:
                agent.close.remote()
            except Exception:  # noqa: BLE001 - gone with its node already
                pass

    def let_go_unowned(self, timeout_s: float = OWNER_CHECK_S) -> bool:
        """End each retired agent that owns no object anybody still references; whether any is kept.

        An agent is the owner of the outputs of the non-blocking calls it sent (Ray makes whoever
        submits a task the owner of its return), and an owner's process must live for as long as
        a future, a verl handle or another process's borrowed copy names the output.  Ray's
        reference table in the agent knows of every such reference, so each agent is asked
        (:meth:`NodeAgent.holds_references`).  One that does not answer within ``timeout_s`` is
        kept (the question is asked again at the next change); one that is gone is dropped."""
        if not self.agents:
            return False
        asked = {agent.holds_references.remote(): node for node, agent in self.agents.items()}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=timeout_s, fetch_local=True)
        for ref in ready:  # all asked at once, one bound for all
            node = asked[ref]
            try:
                holds = ray.get(ref)
            except ray.exceptions.RayError:  # the agent (or its node) is gone: nothing left to keep
                holds = False
            if not holds:
                agent = self.agents.pop(node)
                try:
                    ray.kill(agent, no_restart=True)
                except Exception:  # noqa: BLE001 - gone with its node already
                    pass
        return bool(self.agents)

    def close(self) -> None:
        """Stop the agents (their sessions end with them: the hosts watch the writer's pid)."""
        for agent in self.agents.values():
            try:
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass
        self.agents = {}
        self.drop_standby()

    # ----- sending ----------------------------------------------------------------------------

    def _plan(self, selection: Selection) -> Plan | None:
        """The agents' plan for ``selection`` (kept under its key), or ``None``: a rank no agent serves."""
        plan = self._plans.get(selection.key) if selection.key is not None else None
        if plan is not None:
            return plan
        if not self.served.issuperset(selection.ranks):
            return None
        node_of, reader_of, top_of = self.node_of, self.reader_of, self.top_of
        per_node: dict[str, list[int | None]] = {}
        for rank, share in zip(selection.ranks, selection.share):
            node = node_of[rank]
            readers = per_node.get(node)
            if readers is None:
                readers = per_node[node] = [None] * len(self.by_node[node])
            readers[reader_of[rank]] = share
        tops = tuple(dict.fromkeys(top_of[n] for n in per_node))
        plans: dict[str, NodePlans] = {top: {} for top in tops}
        for node, readers in per_node.items():
            plans[top_of[node]][node] = tuple(readers)
        at = {top: i for i, top in enumerate(tops)}
        plan = Plan(tops, plans, tuple(at[top_of[node_of[r]]] for r in selection.ranks),
                    max((p for top in plans.values() for p in top.values()), key=len),
                    {r: i for i, r in enumerate(selection.ranks)})
        if selection.key is not None and len(self._plans) < PLANS_MAX:
            self._plans[selection.key] = plan
        return plan

    def prepare(self, call: CallRecord) -> tuple[Plan, tuple[bytes, ...], tuple[tuple[Any, ...], ...]] | None:
        """The call's plan, headers and each share's objects in the store, or ``None``: a traced
        data call or traced non-blocking call, a rank no agent serves, or a command too big for a
        node's ring (the same size rule as the controller's own session)."""
        if not self.agents or any(share.keep or (share.trace and share.refs) for share in call.shares):
            return None
        plan = self._plan(call.selection)
        if plan is None:
            return None
        headers = tuple(share.header for share in call.shares)
        if len(encode_command(Command(call.call_id, call.call_id, headers, plan.biggest))) + COMMAND_MARGIN > COMMAND_BYTES:
            return None
        refs = tuple(share.refs for share in call.shares) if any(share.refs for share in call.shares) else ()
        return plan, headers, refs

    def send(self, call: CallRecord, prepared: tuple[Plan, tuple[bytes, ...], tuple[tuple[Any, ...], ...]]
             ) -> AgentCall | AgentSends:
        """One Ray task per top agent: ``call`` (blocking: :meth:`NodeAgent.call`, answered once
        it ran; non-blocking: :meth:`NodeAgent.submit`, answered once sent, :meth:`AgentSends.resolve`)."""
        plan, headers, objects = prepared
        key = call.selection.key
        told = key is not None and key in self._told
        timeout = call.deadline.timeout()
        if call.blocking:
            refs = [self.agents[top].call.remote(call.call_id, call.method, headers, objects, key,
                                                 None if told else plan.plans[top], timeout, call.generation)
                    for top in plan.tops]
        else:
            answering = tuple(share.returns for share in call.shares) if call.outputs_only else None
            refs = [self.agents[top].submit.remote(call.call_id, call.method, headers, objects, key,
                                                   None if told else plan.plans[top], timeout, call.generation, answering,
                                                   not call.outputs_only)
                    for top in plan.tops]
        if key is not None and not told and len(self._told) < PLANS_MAX:
            self._told.add(key)
        with self._lock:
            if call.blocking:
                self._unsettled[call.call_id] = call.ranks
            else:  # its outcomes are read by the future's owner, not here; its hosts mark it done (execute_for)
                submitted = self._submitted
                submitted.pop(id(call.ranks), None)
                submitted[id(call.ranks)] = (call.call_id, call.ranks)
                while len(submitted) > SUBMITTED_SETS:  # one-off rank sets (per-rank calls): fold the oldest
                    call_id, ranks = submitted.pop(next(iter(submitted)))
                    self._submitted_before.update(dict.fromkeys(ranks, call_id))
        return AgentCall(call, refs, plan) if call.blocking else AgentSends(call, refs, plan)

    def last_unanswered(self) -> dict[int, int]:
        """Rank -> the last call sent to it whose outcome was not read, or the last non-blocking call
        sent to it (done or not: its host knows): a Ray task waits for it there."""
        with self._lock:
            calls = sorted(self._unsettled.items())
            owed = dict(self._submitted_before)
            for call_id, ranks in sorted(self._submitted.values()):
                owed.update(dict.fromkeys(ranks, call_id))
        for call_id, ranks in calls:
            for rank in ranks:
                if call_id > owed.get(rank, 0):
                    owed[rank] = call_id
        return owed

    def _settled(self, call_id: int, ranks: Sequence[int] | None = None) -> None:
        """The outcomes of ``ranks`` (``None``: every rank) of call ``call_id`` were read."""
        with self._lock:
            if ranks is None:
                self._unsettled.pop(call_id, None)
                return
            left = self._unsettled.get(call_id)
            if left is None:
                return
            left = set(left).difference(ranks)
            if left:
                self._unsettled[call_id] = left
            else:
                del self._unsettled[call_id]

    def give_up(self, pending: Sequence[Pending]) -> None:
        """The caller abandoned these calls: every agent answers them with what it has."""
        self._answers.forget([p.handle for p in pending])
        for call_id in {p.call_id for p in pending}:
            for agent in self.agents.values():
                try:
                    agent.give_up.remote(call_id)
                except Exception:  # noqa: BLE001 - an agent gone with its node
                    pass

    # ----- answers ------------------------------------------------------------------------------

    def outputs(self, call: AgentCall, within: float) -> tuple[str, list[Any] | None]:
        """The call read whole: ``("done", outputs)`` (every selected rank's output, in selection
        order) once every top agent answered with nothing failed or late; ``("failed", None)`` as
        soon as an answer holds a failure or a rank still running (or its agent died);
        ``("waiting", None)`` when ``within`` seconds passed first.  Answers read stay with the call."""
        end = time.monotonic() + within
        answers = call.answers
        left = [ref for ref in call.refs if ref not in answers]
        while left:
            ready, left = ray.wait(left, num_returns=len(left), timeout=0, fetch_local=True)
            if not ready:
                ready, left = ray.wait(left, num_returns=1, timeout=max(0.0, end - time.monotonic()), fetch_local=True)
                if not ready:
                    return "waiting", None
            for ref in ready:
                try:
                    answer = answers[ref] = ray.get(ref)
                except Exception:  # noqa: BLE001 - an agent died: sorted out rank by rank
                    return "failed", None
                if not answer.clean:
                    return "failed", None
        outputs: list[Any] = [None] * len(call)
        index_of = call.plan.index_of
        stored: list[tuple[int, Any]] = []
        for answer in answers.values():
            for rank, value in answer.values.items():
                if isinstance(value, Stored):
                    stored.append((index_of[rank], value.ref))
                else:
                    outputs[index_of[rank]] = value
        if stored:  # a data call's outputs: from the ranks' nodes' stores, straight to the controller
            try:
                fetched = ray.get([ref for _, ref in stored], timeout=TAKE_PARKED_S)
            except Exception:  # noqa: BLE001 - sorted out rank by rank (the rank's error, named)
                return "failed", None
            for (at, _), value in zip(stored, fetched):
                outputs[at] = value
        self._settled(call.call_id)
        return "done", outputs

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        """The ranks' outcomes in their agents' answers; a lost agent's ranks are asked whether they live."""
        got = self._answers.poll(pending, within, first)
        lost = [i for i, o in got.items() if isinstance(o.error, AgentLostError)]
        if lost:
            dead = self._dead([pending[i].rank for i in lost])
            for i in lost:
                p = pending[i]
                if p.rank in dead:
                    got[i] = Outcome(error=WorkerDiedError(p.rank, p.method, f"its process is gone (with its node agent): "
                                                           f"{dead[p.rank]}", p.node, coords={p.rank: p.coords}))
        by_call: dict[int, list[int]] = {}
        for i in got:
            by_call.setdefault(pending[i].call_id, []).append(pending[i].rank)
        for call_id, ranks in by_call.items():
            self._settled(call_id, ranks)
        waiting = {p.handle for i, p in enumerate(pending) if i not in got}
        self._answers.forget([p.handle for p in pending if p.handle not in waiting])  # answers read whole
        return got

    def _dead(self, ranks: Sequence[int]) -> dict[int, str]:
        return dead_ranks(self.actors, ranks)
