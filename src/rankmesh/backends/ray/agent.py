"""Node agents: one Ray actor per node of a group that takes one message per call and serves its node's ranks through a call session.

Why: with a call session the controller's cost per call stops growing with ranks on its own
node, but a group spanning nodes cannot share one ring (shared memory is per machine).  An agent
on each node holds that node's session (:class:`.session.CallSession`): a call costs one Ray task
per node, carrying that node's rank calls, and one answer per node with the outputs of its ranks.

**The tree.**  One Ray task costs its sender about as much as a task per rank did (~0.9 ms of
CPU here, ``docs/control_plane.md``), so a flat send would still cost the controller a second
per call at 1,024 nodes.  The agents therefore form a tree of ``fanout`` children per agent:
the controller sends to at most ``fanout`` agents, each forwards their share to its children
before serving its own node, and answers once for its whole subtree.  The controller's cost per
call grows with ``fanout``, and the time to reach the last node with the tree's depth
(``log_fanout(nodes)``).

An agent is a ``num_cpus=0`` actor pinned to its node (it only waits and copies small
messages).  Its calls run one at a time on its default thread; :meth:`NodeAgent.close` runs on
its control thread, so a group can give its sessions up while an agent still waits on a hung call.
An agent answers every call with a :class:`NodeAnswer`: the outputs, or the error that names the
failed ranks (a rank's exception, a dead rank's process, a child agent gone with its node),
never a Ray task error of its own; a failure anywhere in its subtree is answered after
:data:`.waiting.FAIL_GRACE`, whatever the rest still runs.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray

from rankmesh.backend import RankCall
from rankmesh.errors import RankMeshError, WorkerDiedError, WorkerError
from rankmesh.mesh import RankCoords
from rankmesh.tracing.recorder import FETCH

from .session import CallSession, fits_a_session
from .waiting import FAIL_GRACE, PROCESS_DIED, POLL_INTERVAL, timed_out, translate_error, warn_stall

CONTROL_GROUP = "control"
#: Children per agent, and agents the controller sends to: up to 8 nodes take one level, 72 two,
#: 584 three (``AgentSession(fanout=...)``, ``RayWorkerGroup.set_control(agent_fanout=...)``).
AGENT_FANOUT = 8

#: One node's share of a call: its rank calls, and per rank the Ray-path calls it must have run first.
NodeWork = tuple[Sequence[RankCall], Mapping[int, int]]


@dataclass(frozen=True)
class NodeAnswer:
    """A subtree's answer to a call: ``outputs`` by rank, or ``error`` naming the failed ranks."""

    outputs: dict[int, Any] | None = None
    error: BaseException | None = None


class NodeAgent:
    """Ray actor body (see :func:`start_agents`): the call session of one group's ranks on one
    node, and the agents of its children in the tree (see the module docstring)."""

    def __init__(self) -> None:
        self._session: CallSession | None = None
        self._lock = threading.Lock()
        self._calling = False
        self._serving = False  # this node's share still runs (maybe after the call answered a failure below)
        self._node = ""
        self._children: dict[str, tuple[Any, tuple[str, ...]]] = {}
        self._ranks_of: dict[str, list[int]] = {}
        self._here: concurrent.futures.ThreadPoolExecutor | None = None  # serves this node while children answer

    def open(self, ranks: Sequence[int], actors: Mapping[int, Any], pids: Mapping[int, int],
             nodes: Sequence[str | None], coords: Sequence[RankCoords | None], node: str = "",
             children: Mapping[str, tuple[Any, Sequence[str]]] | None = None,
             ranks_of: Mapping[str, Sequence[int]] | None = None) -> int:
        """Open a session with this node's ``ranks`` (rank-indexed ``nodes``/``coords``); returns this pid.

        ``node`` is this agent's node id; ``children`` maps each child agent's node id to its
        handle and the node ids of its subtree (itself first); ``ranks_of`` gives each child's
        ranks, to name them if the child's agent dies."""
        self.close()
        session = CallSession(ranks, actors, pids, nodes, coords)
        session.open()
        with self._lock:
            self._session = session
            self._node = node
            self._children = {child: (handle, tuple(subtree)) for child, (handle, subtree) in (children or {}).items()}
            self._ranks_of = {n: list(r) for n, r in (ranks_of or {}).items()}
            if self._children and self._here is None:
                self._here = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rankmesh-agent")
        return os.getpid()

    def call(self, role: str | None, method: str, work: Mapping[str, NodeWork]) -> NodeAnswer:
        """Run ``work`` (by node id: this node's and its subtree's) and wait for every answer.

        Children get their subtrees' shares first; this node's ranks run meanwhile."""
        with self._lock:
            session, self._calling = self._session, True
        try:
            if session is None:
                return NodeAnswer(error=RankMeshError(f"{method}: the node agent's call session is closed"))
            forwards = []
            for child, (handle, subtree) in self._children.items():
                share = {n: work[n] for n in subtree if n in work}
                if share:
                    forwards.append((child, handle.call.remote(role, method, share)))
            mine = work.get(self._node)
            if not forwards:
                return self._serve(session, role, method, mine)
            parts: dict[concurrent.futures.Future, str | None] = {ref.future(): child for child, ref in forwards}
            if mine is not None:
                assert self._here is not None
                parts[self._here.submit(self._serve, session, role, method, mine)] = None
            return self._gather(parts, method, session)
        finally:
            with self._lock:
                self._calling = False
                release = session is not None and session is not self._session and not self._serving
            if release:  # closed meanwhile, and nobody uses it any more: let it go here
                session.close()

    def _serve(self, session: CallSession, role: str | None, method: str, mine: NodeWork | None) -> NodeAnswer:
        """This node's share, through its session."""
        if mine is None:
            return NodeAnswer(outputs={})
        with self._lock:
            self._serving = True
        try:
            calls, after = mine
            pending = session.submit(role, method, calls, after)
            if pending is None:  # the controller sizes messages first (AgentSession.submit): not expected
                return NodeAnswer(error=RankMeshError(f"{method}: the call does not fit the node's command ring"))
            try:
                outputs = session.fetch(pending, None, None, None, None)
            except RankMeshError as exc:
                return NodeAnswer(error=exc)
            return NodeAnswer(outputs={p.rank: out for p, out in zip(pending, outputs)})
        finally:
            with self._lock:
                self._serving = False
                release = session is not self._session and not self._calling
            if release:
                session.close()

    def _gather(self, parts: dict[concurrent.futures.Future, str | None], method: str, session: CallSession) -> NodeAnswer:
        """One answer from this node's and its children's: every output, or every failure seen
        within :data:`.waiting.FAIL_GRACE` of the first."""
        outputs: dict[int, Any] = {}
        errors: list[BaseException] = []
        left = set(parts)
        grace_end = None
        while left:
            timeout = None if grace_end is None else max(0.0, grace_end - time.monotonic())
            done, left = concurrent.futures.wait(left, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                try:
                    answer = future.result()
                except PROCESS_DIED as exc:  # the child agent is gone, with its node: its ranks count as dead
                    child = parts[future] or ""
                    errors += [translate_error(AgentPending(None, child, r, method, session.nodes[r], session.coords[r]), exc)
                               for r in self._ranks_of.get(child, [])]
                    continue
                if answer.error is not None:
                    errors.append(answer.error)
                else:
                    outputs.update(answer.outputs or {})
            if errors and grace_end is None:
                grace_end = time.monotonic() + FAIL_GRACE
            if grace_end is not None and time.monotonic() >= grace_end:
                break
        if errors:
            return NodeAnswer(error=merge_errors(errors, ()))
        return NodeAnswer(outputs=outputs)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def close(self) -> None:
        """Give the session up (its hosts' session threads end); a call still waiting ends too."""
        with self._lock:
            session, self._session = self._session, None
            if session is None:
                return
            if self._calling or self._serving:  # the thread using it closes it when it is done
                session.give_up()
                return
        session.close()


def start_agents(node_ids: Sequence[str]) -> dict[str, Any]:
    """One :class:`NodeAgent` per node id, pinned there (``num_cpus=0``); by node id."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    cls = ray.remote(num_cpus=0, concurrency_groups={CONTROL_GROUP: 1})(NodeAgent)
    return {
        node: cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote()
        for node in node_ids
    }


# ----- the controller's end ------------------------------------------------------------------


@dataclass(frozen=True)
class AgentPending:
    """One rank's share of a call sent through the agents: the answer of its subtree's top agent
    (``ref``), and the node id whose agent serves the rank (``agent_node``)."""

    ref: Any
    agent_node: str
    rank: int
    method: str
    node: str | None = None
    coords: RankCoords | None = None


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


class AgentSession:
    """The controller's end of a group's node agents: one call is one Ray task to each of at most
    ``fanout`` agents, which forward their subtrees' shares (see the module docstring).

    ``node_ids[r]`` is rank ``r``'s Ray node; every node gets an agent (the controller's own too,
    so that one path serves the whole group).  Same interface as :class:`.session.CallSession`.
    """

    def __init__(self, actors: Sequence[Any], pids: Sequence[int], node_ids: Sequence[str],
                 nodes: Sequence[str | None], coords: Sequence[RankCoords | None], fanout: int = AGENT_FANOUT) -> None:
        self.ranks = tuple(range(len(actors)))
        self.actors, self.pids = list(actors), list(pids)
        self.nodes, self.coords = list(nodes), list(coords)
        self.by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(node_ids):
            self.by_node.setdefault(node, []).append(rank)
        self.node_of = {rank: node for node, ranks in self.by_node.items() for rank in ranks}
        self.tops, self.children = agent_tree(list(self.by_node), fanout)
        self.top_of = {n: top for top in self.tops for n in subtree(top, self.children)}
        self.agents: dict[str, Any] = {}
        self._unread: set[Any] = set()  # answers nobody has read (a failed call's)

    def open(self, timeout_s: float = 60.0) -> None:
        self.agents = start_agents(list(self.by_node))
        try:
            opened = []
            for node, ranks in self.by_node.items():
                kids = {child: (self.agents[child], subtree(child, self.children)) for child in self.children[node]}
                below = {child: self.by_node[child] for child in self.children[node]}
                opened.append(self.agents[node].open.remote(
                    ranks, {r: self.actors[r] for r in ranks}, {r: self.pids[r] for r in ranks}, self.nodes, self.coords,
                    node, kids, below))
            ray.get(opened, timeout=timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for agent in self.agents.values():
            try:
                agent.close.remote()
                ray.kill(agent, no_restart=True)
            except Exception:  # noqa: BLE001 - gone with its node already
                pass
        self.agents = {}

    def takes(self, calls: Sequence[RankCall]) -> bool:
        return bool(self.agents) and all(c.rank in self.node_of for c in calls) and fits_a_session(calls)

    def submit(self, role: str | None, method: str, calls: Sequence[RankCall], after: Mapping[int, int],
               cache: Any = None) -> list[AgentPending]:
        per_node: dict[str, list[RankCall]] = {}
        for call in calls:
            per_node.setdefault(self.node_of[call.rank], []).append(call)
        per_top: dict[str, dict[str, NodeWork]] = {}
        for node, node_calls in per_node.items():
            per_top.setdefault(self.top_of[node], {})[node] = (node_calls, {c.rank: after.get(c.rank, 0) for c in node_calls})
        refs = {top: self.agents[top].call.remote(role, method, work) for top, work in per_top.items()}
        self._unread.update(refs.values())
        pending = []
        for call in calls:
            node = self.node_of[call.rank]
            pending.append(AgentPending(refs[self.top_of[node]], node, call.rank, method, self.nodes[call.rank],
                                        self.coords[call.rank]))
        return pending

    def owes(self, ranks: Sequence[int]) -> bool:
        return bool(self._unread)

    def drain(self, ranks: Sequence[int], timeout: float | None, on_died: Any = None, inspect: Any = None) -> None:
        """Wait for every answer nobody read (a failed call's), so later Ray calls run after them."""
        refs = list(self._unread)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - reported with its own call
                pass
        self._unread.difference_update(ready)

    def fetch(self, pending: Sequence[AgentPending], timeout: float | None, on_died: Any, stall_warn_s: float | None,
              inspect: Any) -> list[Any]:
        """The outputs of ``pending``: the top agents' answers waited for together, failing fast as :mod:`.waiting` does."""
        refs = list(dict.fromkeys(p.ref for p in pending))
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        warn_at = None if stall_warn_s is None or inspect is None else start + stall_warn_s
        answers: dict[Any, NodeAnswer] = {}
        failures: list[BaseException] = []
        remaining = refs
        grace_end = None
        while remaining:
            limits = [t - time.monotonic() for t in (deadline, warn_at, grace_end) if t is not None]
            ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=max(0.0, min([POLL_INTERVAL, *limits])))
            for ref in ready:
                self._unread.discard(ref)
                try:
                    answers[ref] = ray.get(ref)
                except PROCESS_DIED as exc:  # the top agent is gone, with its node: that node's ranks count as dead
                    top = next(p.agent_node for p in pending if p.ref == ref)
                    failures += [translate_error(p, exc) for p in pending if p.agent_node == top]
                    continue
                if answers[ref].error is not None:
                    failures.append(answers[ref].error)
            if failures and grace_end is None:
                grace_end = time.monotonic() + FAIL_GRACE
            now = time.monotonic()
            if not remaining or (grace_end is not None and now >= grace_end):
                break
            slow = [p for p in pending if p.ref in remaining]
            if deadline is not None and now >= deadline:
                raise timed_out(pending, slow, timeout or 0.0, now - start, on_died, inspect)
            if warn_at is not None and now >= warn_at:
                warn_at = None
                warn_stall(pending, slow, stall_warn_s or 0.0, now - start, inspect)
        if failures:
            err = merge_errors(failures, pending)
            if isinstance(err, WorkerDiedError) and on_died is not None:
                on_died(err)
            raise err
        FETCH.ready_ns = time.time_ns()
        return [answers[p.ref].outputs[p.rank] for p in pending]


def merge_errors(errors: Sequence[BaseException], pending: Sequence[Any]) -> BaseException:
    """One error for several nodes' failures: the dead ranks of every node first, else the lowest rank's error.

    A rank's coordinates and node come from ``pending`` (rank, node, coords) where it is there,
    else from the errors themselves (an agent merging its subtree's answers has no pending)."""
    by_rank = {p.rank: p for p in pending}
    died = [e for e in errors if isinstance(e, WorkerDiedError)]
    if died:
        ranks = sorted({r for e in died for r in e.ranks})
        first = min(died, key=lambda e: e.rank)
        coords = {r: c for e in died for r, c in e.coords.items()}
        coords.update({r: by_rank[r].coords for r in ranks if r in by_rank and by_rank[r].coords is not None})
        nodes = {n for e in died for n in (e.node or "").split(", ") if n}
        nodes |= {by_rank[r].node for r in ranks if r in by_rank and by_rank[r].node}
        merged = WorkerDiedError(first.rank, first.method, first.detail, ", ".join(sorted(nodes)) or None, ranks=ranks,
                                 coords=coords)
        merged.__cause__ = first.__cause__
        return merged
    workers = {id(w): w for e in errors if isinstance(e, WorkerError) for w in (e, *e.others)}  # a subtree's: flat
    if workers:
        ordered = sorted(workers.values(), key=lambda e: e.rank)
        return ordered[0].attach([w.attach([]) for w in ordered[1:]])
    return errors[0]
