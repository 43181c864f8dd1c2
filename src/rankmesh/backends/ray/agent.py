"""Node agents: one Ray actor per node of a group that takes one message per call and serves its node's ranks through a call session.

Why: with a call session the controller's cost per call stops growing with ranks on its own
node, but a group spanning nodes cannot share one ring (shared memory is per machine).  An agent
on each node holds that node's session (:class:`.session.CallSession`): the controller sends it
one Ray task per call, carrying the node's rank calls, and gets one answer per node with the
outputs of its ranks.  So a call costs the controller one task per *node*, not per rank.

An agent is a ``num_cpus=0`` actor pinned to its node (it only waits and copies small
messages).  Its calls run one at a time on its default thread; :meth:`NodeAgent.close` runs on
its control thread, so a group can give its sessions up while an agent still waits on a hung call.
An agent answers every call with a :class:`NodeAnswer`: the outputs, or the error that names the
failed ranks (a rank's exception, a dead rank's process), never a Ray task error of its own.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class NodeAnswer:
    """One node's answer to a call: ``outputs`` in the order of its calls, or ``error``; ``unsent``
    when the call did not fit a session slot and nothing ran (the controller sends it through Ray)."""

    outputs: list[Any] | None = None
    error: BaseException | None = None
    unsent: bool = False


class NodeAgent:
    """Ray actor body (see :func:`start_agents`): the call session of one group's ranks on one node."""

    def __init__(self) -> None:
        self._session: CallSession | None = None
        self._lock = threading.Lock()
        self._calling = False

    def open(self, ranks: Sequence[int], actors: Mapping[int, Any], pids: Mapping[int, int],
             nodes: Sequence[str | None], coords: Sequence[RankCoords | None]) -> int:
        """Open a session with this node's ``ranks`` (rank-indexed ``nodes``/``coords``); returns this pid."""
        self.close()
        session = CallSession(ranks, actors, pids, nodes, coords)
        session.open()
        with self._lock:
            self._session = session
        return os.getpid()

    def call(self, role: str | None, method: str, calls: Sequence[RankCall], after: Mapping[int, int]) -> NodeAnswer:
        """Run ``calls`` on this node's ranks through the session and wait for every answer."""
        with self._lock:
            session, self._calling = self._session, True
        try:
            if session is None:
                return NodeAnswer(error=RankMeshError(f"{method}: the node agent's call session is closed"))
            pending = session.submit(role, method, calls, after)
            if pending is None:
                return NodeAnswer(unsent=True)
            try:
                return NodeAnswer(outputs=session.fetch(pending, None, None, None, None))
            except RankMeshError as exc:
                return NodeAnswer(error=exc)
        finally:
            with self._lock:
                self._calling = False
                if session is not None and session is not self._session:  # closed meanwhile: let it go here
                    session.close()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def close(self) -> None:
        """Give the session up (its hosts' session threads end); a call still waiting ends too."""
        with self._lock:
            session, self._session = self._session, None
            if session is None:
                return
            if self._calling:  # the calling thread closes it when its call returns
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
    """One rank's share of a call sent through its node's agent: the node's answer, and this rank's place in it."""

    ref: Any
    index: int
    rank: int
    method: str
    node: str | None = None
    coords: RankCoords | None = None


class AgentSession:
    """The controller's end of a group's node agents: one call is one Ray task per node.

    ``node_ids[r]`` is rank ``r``'s Ray node; every node gets an agent (the controller's own too,
    so that one path serves the whole group).  Same interface as :class:`.session.CallSession`.
    """

    def __init__(self, actors: Sequence[Any], pids: Sequence[int], node_ids: Sequence[str],
                 nodes: Sequence[str | None], coords: Sequence[RankCoords | None]) -> None:
        self.ranks = tuple(range(len(actors)))
        self.actors, self.pids = list(actors), list(pids)
        self.nodes, self.coords = list(nodes), list(coords)
        self.by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(node_ids):
            self.by_node.setdefault(node, []).append(rank)
        self.node_of = {rank: node for node, ranks in self.by_node.items() for rank in ranks}
        self.agents: dict[str, Any] = {}
        self._unread: set[Any] = set()  # node answers nobody has read (a failed call's)

    def open(self, timeout_s: float = 60.0) -> None:
        self.agents = start_agents(list(self.by_node))
        try:
            ray.get([
                self.agents[node].open.remote(ranks, {r: self.actors[r] for r in ranks}, {r: self.pids[r] for r in ranks},
                                              self.nodes, self.coords)
                for node, ranks in self.by_node.items()
            ], timeout=timeout_s)
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
        refs = {node: self.agents[node].call.remote(role, method, node_calls, {c.rank: after.get(c.rank, 0) for c in node_calls})
                for node, node_calls in per_node.items()}
        self._unread.update(refs.values())
        seen: dict[str, int] = {}
        pending = []
        for call in calls:
            node = self.node_of[call.rank]
            index = seen[node] = seen.get(node, -1) + 1
            pending.append(AgentPending(refs[node], index, call.rank, method, self.nodes[call.rank], self.coords[call.rank]))
        return pending

    def owes(self, ranks: Sequence[int]) -> bool:
        return bool(self._unread)

    def drain(self, ranks: Sequence[int], timeout: float | None, on_died: Any = None, inspect: Any = None) -> None:
        """Wait for every node answer nobody read (a failed call's), so later Ray calls run after them."""
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
        """The outputs of ``pending``: node answers waited for together, failing fast as :mod:`.waiting` does."""
        refs = list(dict.fromkeys(p.ref for p in pending))
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        warn_at = None if stall_warn_s is None or inspect is None else start + stall_warn_s
        answers: dict[Any, NodeAnswer] = {}
        failures: list[tuple[Any, BaseException]] = []
        remaining = refs
        grace_end = None
        while remaining:
            limits = [t - time.monotonic() for t in (deadline, warn_at, grace_end) if t is not None]
            ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=max(0.0, min([POLL_INTERVAL, *limits])))
            for ref in ready:
                self._unread.discard(ref)
                try:
                    answers[ref] = ray.get(ref)
                except PROCESS_DIED as exc:  # the agent is gone, with its node: its ranks count as dead
                    failures += [(p, translate_error(p, exc)) for p in pending if p.ref == ref]
                    continue
                error = answers[ref].error
                if error is not None:
                    failures.append((next(p for p in pending if p.ref == ref), error))
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
            err = merge_errors([e for _, e in failures], pending)
            if isinstance(err, WorkerDiedError) and on_died is not None:
                on_died(err)
            raise err
        FETCH.ready_ns = time.time_ns()
        return [answers[p.ref].outputs[p.index] for p in pending]


def merge_errors(errors: Sequence[BaseException], pending: Sequence[AgentPending]) -> BaseException:
    """One error for several nodes' failures: the dead ranks of every node first, else the lowest rank's error."""
    by_rank = {p.rank: p for p in pending}
    translated = list(errors)
    died = [e for e in translated if isinstance(e, WorkerDiedError)]
    if died:
        ranks = sorted({r for e in died for r in e.ranks})
        first = min(died, key=lambda e: e.rank)
        coords = {r: by_rank[r].coords for r in ranks if r in by_rank and by_rank[r].coords is not None}
        nodes = sorted({by_rank[r].node for r in ranks if r in by_rank and by_rank[r].node})
        merged = WorkerDiedError(first.rank, first.method, first.detail, ", ".join(nodes) or None, ranks=ranks, coords=coords)
        merged.__cause__ = first.__cause__
        return merged
    workers = sorted((e for e in translated if isinstance(e, WorkerError)), key=lambda e: e.rank)
    if workers:
        return workers[0].attach(workers[1:])
    return translated[0]
