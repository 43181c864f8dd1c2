"""Node agents: one Ray actor per node of a group that takes one message per call and serves its node's ranks through a call session.

Why: with a call session the controller's cost per call stops growing with ranks on its own
node, but a group spanning nodes cannot share one ring (shared memory is per machine).  An agent
on each node writes that node's ring (:class:`.session.CallSession`): a call costs one Ray task
per node, carrying that node's share of the call (its headers and plan, :class:`.wire.Command`,
sized by the controller so that every carrier falls back to Ray's tasks at the same size), and
one answer per node with the outcome of each of its ranks.

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

**Answers.**  A :class:`NodeAnswer` holds each finished rank's :class:`~.waiting.Outcome` and the
ranks still running (after a failure's grace, or the call's deadline).  A child agent that died
is answered for its ranks as :class:`~rankmesh.errors.AgentLostError`; the controller then asks
those ranks' processes themselves (:meth:`AgentSession.poll`), so a rank is reported dead only if
its own process is gone, and the ranks of a dead agent are never confused with another node's.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import ray

from rankmesh.deadline import Deadline
from rankmesh.errors import AgentLostError, WorkerDiedError
from rankmesh.mesh import RankCoords

from .calls import CallRecord, Outcome, Pending
from .session import COMMAND_MARGIN, CallSession
from .waiting import PROCESS_DIED, gather
from .wire import COMMAND_BYTES, Command, command_plan, encode_command

CONTROL_GROUP = "control"
#: Children per agent, and agents the controller sends to: up to 8 nodes take one level, 72 two,
#: 584 three (``AgentSession(fanout=...)``, ``RayWorkerGroup.set_control(agent_fanout=...)``).
AGENT_FANOUT = 8
#: How long the controller waits for the processes of a dead agent's ranks to say they live (seconds).
PROBE_S = 2.0
#: The longest an agent waits for a free slot in its node's ring when the call has no deadline
#: (seconds): a full ring means a rank there still runs an earlier call, and the controller is told.
WRITE_WAIT_S = 30.0

#: One node's share of a call: the distinct headers and, per reader, (header index, sequence number).
NodeWork = tuple[tuple[bytes, ...], tuple]


@dataclass(frozen=True)
class NodeAnswer:
    """A subtree's answer to a call: the outcome of each finished rank, and the ranks still running."""

    outcomes: dict[int, Outcome] = field(default_factory=dict)
    unfinished: tuple[int, ...] = ()


class AgentAnswers:
    """The carrier of agents' answers (``name = "agent"``): a pending's handle is the ObjectRef of the
    answer that will hold its rank's outcome.  A dead agent is answered as :class:`AgentLostError`
    for every rank its answer would have held (its subtree's)."""

    name = "agent"

    def __init__(self) -> None:
        self._answers: dict[Any, NodeAnswer | BaseException] = {}

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        refs = list(dict.fromkeys(p.handle for p in pending if p.handle not in self._answers))
        if refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=within, fetch_local=False)
            for ref in ready:
                try:
                    self._answers[ref] = ray.get(ref)
                except PROCESS_DIED as exc:
                    self._answers[ref] = exc
        got: dict[int, Outcome] = {}
        for i, p in enumerate(pending):
            answer = self._answers.get(p.handle)
            if isinstance(answer, BaseException):
                got[i] = Outcome(error=AgentLostError(
                    f"the node agent serving rank {p.rank} (node {p.node}) died during {p.method}: "
                    f"{str(answer).strip().splitlines()[0] if str(answer).strip() else type(answer).__name__}",
                    [p.rank]))
            elif answer is not None and p.rank in answer.outcomes:
                got[i] = answer.outcomes[p.rank]
            elif answer is not None and p.rank not in answer.unfinished:
                got[i] = Outcome(error=AgentLostError(f"rank {p.rank}: its node agent answered without it", [p.rank]))
        return got

    def forget(self, handles: Sequence[Any]) -> None:
        for handle in handles:
            self._answers.pop(handle, None)


class NodeAgent:
    """Ray actor body (see :func:`start_agents`): the call session of one group's ranks on one
    node, and the agents of its children in the tree (see the module docstring)."""

    def __init__(self) -> None:
        self._session: CallSession | None = None
        self._node = ""
        self._children: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._ranks_of: dict[str, list[int]] = {}
        self._given_up: set[int] = set()
        self._lock = threading.Lock()  # guards _given_up and _session between the two threads

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
        return os.getpid()

    def call(self, call_id: int, method: str, work: Mapping[str, NodeWork], timeout_s: float | None,
             generation: int = 0) -> NodeAnswer:
        """Run ``work`` (by node id: this node's and its subtree's) and wait for every rank.

        Children get their subtrees' shares first; this node's ranks run meanwhile."""
        deadline = Deadline.after(timeout_s)
        session = self._session
        pending: list[Pending] = []
        for child, (handle, subtree) in self._children.items():
            share = {n: work[n] for n in subtree if n in work}
            if share:
                ref = handle.call.remote(call_id, method, share, deadline.timeout(), generation)
                ranks = [r for n in subtree if n in share for r, piece in zip(self._ranks_of.get(n, []), share[n][1])
                         if piece is not None]
                pending += [Pending(ref, r, method, None, None, "agent", call_id, generation) for r in ranks]
        mine = work.get(self._node)
        if mine is not None:
            if session is None:
                return NodeAnswer({r: Outcome(error=AgentLostError(f"{method}: the node agent's call session is closed", [r]))
                                   for r in _called(self._node_ranks(), mine)})
            headers, plan = mine
            called = _called(session.ranks, mine)
            try:
                message = session.encode(Command(call_id, call_id, headers, plan))
                session.write(message, call_id, method, deadline.bounded(WRITE_WAIT_S), called)
            except Exception as exc:  # noqa: BLE001 - a full or aborted ring: every rank of this node fails with it
                return NodeAnswer({r: Outcome(error=exc) for r in called})
            pending += [Pending(call_id, r, method, None, None, session.name, call_id, generation) for r in called]
        return self._wait(call_id, pending, deadline, {"session": session, "agent": AgentAnswers()})

    def _wait(self, call_id: int, pending: Sequence[Pending], deadline: Deadline, carriers: Mapping[str, Any],
              stop_on_failure: bool = True) -> NodeAnswer:
        """The one wait loop: until done, failed (its grace over), past the deadline, or given up."""
        def given_up() -> bool:
            with self._lock:
                return call_id in self._given_up

        got = gather(pending, deadline, carriers, stop_on_failure=stop_on_failure, stop=given_up)
        with self._lock:
            self._given_up.discard(call_id)
        outcomes = {pending[i].rank: outcome for i, outcome in got.outcomes.items()}
        return NodeAnswer(outcomes, tuple(sorted(pending[i].rank for i in got.unfinished)))

    def _node_ranks(self) -> tuple[int, ...]:
        return () if self._session is None else self._session.ranks

    @ray.method(concurrency_group=CONTROL_GROUP)
    def give_up(self, call_id: int) -> None:
        """The controller abandoned call ``call_id``: answer it with what is in (at the wait loop's next look)."""
        with self._lock:
            self._given_up.add(call_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def close(self) -> None:
        """Give the session up: the hosts' session threads end, dropping calls they have not read."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close(stop=False)


def _called(ranks: Sequence[int], work: NodeWork) -> list[int]:
    return [r for r, piece in zip(ranks, work[1]) if piece is not None]


def start_agents(node_ids: Sequence[str]) -> dict[str, Any]:
    """One :class:`NodeAgent` per node id, pinned there (``num_cpus=0``); by node id."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(num_cpus=0, concurrency_groups={CONTROL_GROUP: 1})(NodeAgent)
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


class AgentSession:
    """The controller's end of a group's node agents: one call is one Ray task to each of at most
    ``fanout`` agents, which forward their subtrees' shares (see the module docstring).

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
        self.tops, self.children = agent_tree(list(self.by_node), fanout)
        self.top_of = {n: top for top in self.tops for n in subtree(top, self.children)}
        self.agents: dict[str, Any] = {}
        self._answers = AgentAnswers()
        self._lock = threading.Lock()
        self._unsettled: dict[int, int] = {}  # rank -> the last call sent to it whose outcome was not read yet

    def open(self, timeout_s: float = 60.0) -> None:
        self.agents = start_agents(list(self.by_node))
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
            self.close()
            raise

    def close(self) -> None:
        """Stop the agents (their sessions end with them: the hosts watch the writer's pid)."""
        for agent in self.agents.values():
            try:
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass
        self.agents = {}

    # ----- sending ----------------------------------------------------------------------------

    def prepare(self, call: CallRecord) -> dict[str, NodeWork] | None:
        """Each node's share of ``call``, or ``None``: not inline, a rank no agent serves, or a node's
        share too big for its ring (the same size rule as the controller's own session)."""
        if not self.agents or not call.inline or any(rank not in self.served for rank in call.ranks):
            return None
        per_node: dict[str, list[tuple[int, bytes, int]]] = {}
        for part in call.parts:
            per_node.setdefault(self.node_of[part.rank], []).append((part.rank, part.header, part.seq))
        work = {}
        for node, node_parts in per_node.items():
            headers, plan = command_plan(self.by_node[node], node_parts)
            if len(encode_command(Command(call.call_id, call.call_id, headers, plan))) + COMMAND_MARGIN > COMMAND_BYTES:
                return None
            work[node] = (headers, plan)
        return work

    def send(self, call: CallRecord, work: Mapping[str, NodeWork]) -> list[Pending]:
        per_top: dict[str, dict[str, NodeWork]] = {}
        for node, share in work.items():
            per_top.setdefault(self.top_of[node], {})[node] = share
        refs = {top: self.agents[top].call.remote(call.call_id, call.method, share, call.deadline.timeout(), call.generation)
                for top, share in per_top.items()}
        with self._lock:
            self._unsettled.update((rank, call.call_id) for rank in call.ranks)
        return call.pending(self.name, [refs[self.top_of[self.node_of[rank]]] for rank in call.ranks])

    def last_unanswered(self) -> dict[int, int]:
        """Rank -> the last call sent to it whose outcome was not read (a Ray task waits for it there)."""
        with self._lock:
            return dict(self._unsettled)

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
        with self._lock:
            for i in got:  # an outcome of the rank's last call sent settles it; one of an older call does not
                if self._unsettled.get(pending[i].rank) == pending[i].call_id:
                    del self._unsettled[pending[i].rank]
        waiting = {p.handle for i, p in enumerate(pending) if i not in got}
        self._answers.forget([p.handle for p in pending if p.handle not in waiting])  # answers read whole
        return got

    def _dead(self, ranks: Sequence[int]) -> dict[int, str]:
        """Which of ``ranks`` have no process any more (each asked at once, on its control thread)."""
        refs = {self.actors[r].ping.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=PROBE_S, fetch_local=False)
        dead = {}
        for ref in ready:
            try:
                ray.get(ref)
            except PROCESS_DIED as exc:
                dead[refs[ref]] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return dead
