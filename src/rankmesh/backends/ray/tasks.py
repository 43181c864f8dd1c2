"""The Ray-task carrier: one Ray task per rank, the way every call can travel.

Calls with object-store arguments on one node, non-blocking calls on one node (their outputs are
ObjectRefs that other groups' workers fetch), host steps, and any call a session or the node
agents cannot take travel this way.  Sending
(:meth:`RayTasks.start`) picks the host method for one rank's encoded call (:mod:`.wire`): a
header installed as a call slot runs as ``call_<slot>(*shared)`` (or ``bare_<slot>()``), without
a header argument; a traced call's rank reads its clock on arrival (``execute_traced``); a
non-blocking traced call keeps its timing (``execute_kept``).  Waiting is the one loop's
(:mod:`.waiting`): :meth:`RayTasks.poll` only says which tasks are done.

Ray runs one caller's tasks on an actor in submission order, which is what keeps a rank's calls
in order on this carrier; across carriers the executor orders them (:mod:`.order`).
"""

from __future__ import annotations

from typing import Any, Sequence

import ray

from rankmesh.backend import RankCall
from rankmesh.errors import BackendError
from rankmesh.mesh import RankCoords

from .calls import CallRecord, Outcome, Pending, RankPart
from .reshard import holder_objects
from .wire import HeaderCache, encode_rank_call, slot_method


def get_objects(refs: Sequence[Any], timeout: float | None = None) -> list[Any]:
    """``ray.get(refs, timeout)``, through the holder in a forked rank (:func:`.reshard.use_holder_objects`)."""
    holder = holder_objects()
    return ray.get(list(refs), timeout=timeout) if holder is None else holder.get(list(refs), timeout)


class RayTasks:
    """The Ray-task carrier (``name = "ray"``): it takes every call.

    ``processes`` is what holds the group's processes by rank (its ``actors``: a group's host set,
    read at each send, so a replaced or renumbered rank's new process gets the next call) and
    ``cache`` their call slots; without them (a process that only waits, a worker fetching a
    future's parts) it polls and nothing else.
    """

    name = "ray"

    def __init__(self, processes: Any = None, cache: HeaderCache | None = None) -> None:
        self.processes, self.cache = processes, cache

    def prepare(self, call: CallRecord) -> CallRecord:
        return call

    def send(self, call: CallRecord, prepared: Any = None, actors: Any = None) -> list[Pending]:
        """One task per part; ``actors`` (by rank) instead of the carrier's processes (a spare's step)."""
        if actors is None:
            if self.processes is None:
                raise TypeError("this Ray-task carrier has no processes to send to: give it actors")
            actors = self.processes.actors
        return call.pending(self.name, [self._start(actors[part.rank], part) for part in call.parts])

    def _start(self, actor: Any, part: RankPart) -> Any:
        header, refs, slot, cache = part.header, part.refs, part.slot, self.cache
        if part.after:  # after session calls the rank has not finished: the host waits for them first
            return actor.execute_after.remote(part.after, part.after_s, part.keep, part.trace, header, *refs)
        if part.keep:  # traced non-blocking: the host keeps the timing (drain_timings)
            return actor.execute_kept.remote(part.keep, header, *refs)
        if slot is None or cache is None:
            return (actor.execute_traced if part.trace else actor.execute).remote(header, *refs)
        if cache.installed(slot, part.rank, actor):  # no header argument (see wire.HeaderCache)
            return getattr(actor, slot_method(slot, len(refs))).remote(*refs)
        ref = actor.execute_install.remote(slot, header, *refs)
        cache.mark_installed(slot, part.rank, actor)
        return ref

    def poll(self, pending: Sequence[Pending], within: float, first: bool = False) -> dict[int, Outcome]:
        """Outcomes of the finished tasks among ``pending``, waiting up to ``within`` for one.

        On the first look the success path is one ``ray.get`` of every output (a ``ray.wait``
        round first costs ~0.3 ms per 8-rank fan-out here); it still fails fast, since
        ``ray.get`` returns at the first error, and anything but success falls through to
        finding who is slow or failed (the outputs stay in the store, so asking twice loses nothing).
        In a forked rank both steps go through its holder (:func:`get_objects`, :func:`ready_refs`).
        """
        refs = [p.handle for p in pending]
        if first:
            try:
                return {i: Outcome(v) for i, v in enumerate(get_objects(refs, within))}
            except Exception:  # noqa: BLE001 - sorted out below, rank by rank
                within = 0.0
        done = ready_refs(refs, within)
        if not done:
            return {}
        finished = [i for i, ref in enumerate(refs) if ref in done]
        try:
            return {i: Outcome(v) for i, v in zip(finished, get_objects([refs[i] for i in finished]))}
        except Exception:  # noqa: BLE001 - find which ranks failed; read every output (or Ray logs it as unhandled)
            out: dict[int, Outcome] = {}
            for i in finished:
                try:
                    out[i] = Outcome(get_objects([refs[i]])[0])
                except Exception as exc:  # noqa: BLE001
                    out[i] = Outcome(error=exc)
            return out


def output_refs(pending: Sequence[Pending]) -> list[Any]:
    """The ObjectRefs of ``pending``'s outputs, in order: what ``ray.get`` takes (verl's futures).

    Only this carrier's handles are ObjectRefs of the ranks' outputs (a session's are call ids on
    a ring, an agent's blocking call the answer of a whole subtree).  A non-blocking call's
    per-rank pendings are always this carrier's: sent here, or across nodes by the node agents,
    whose ranks' output refs are read from the agents when asked for (:class:`.agent.JoinedCall`),
    so its :attr:`rankmesh.GroupFuture.handles` give their refs; another carrier's pending is
    refused, naming it.
    """
    other = sorted({p.carrier for p in pending if p.carrier != RayTasks.name})
    if other:
        raise BackendError(
            f"{pending[0].method}: its ranks' answers travel on the {'/'.join(other)} carrier, which has no "
            "ObjectRef per rank; only a non-blocking call's outputs are ObjectRefs (ray.get takes those)"
        )
    return [p.handle for p in pending]


def ready_refs(refs: Sequence[Any], timeout: float | None = 0.0) -> set[Any]:
    """The done ones among ``refs``; a positive ``timeout`` (or ``None``) first waits for one of them."""
    unique = list(dict.fromkeys(refs))
    if not unique:
        return set()
    holder = holder_objects()
    if holder is not None:
        return {unique[i] for i in holder.wait_any(unique, timeout)}
    if timeout is None or timeout > 0:
        ready, _ = ray.wait(unique, num_returns=1, timeout=timeout, fetch_local=False)
        if not ready:
            return set()
    return set(ray.wait(unique, num_returns=len(unique), timeout=0, fetch_local=False)[0])



def step_part(rank: int, step: str, args: tuple[Any, ...] = (), node: str | None = None,
              coords: RankCoords | None = None) -> RankPart:
    """Rank ``rank``'s share of a call of host step ``step(*args)`` (:data:`.host.STEPS`); an
    argument given as :class:`~rankmesh.backend.Shared` travels by reference (Ray resolves it
    on the rank's node: the controller never fetches it)."""
    header, refs, _ = encode_rank_call(None, step, RankCall(rank, tuple(args)), None, step=True)
    return RankPart(rank, header, tuple(refs), node=node, coords=coords)


def start_step(actor: Any, rank: int, step: str, args: tuple[Any, ...] = (), what: str | None = None,
               node: str | None = None, coords: RankCoords | None = None, call_id: int = 0, generation: int = 0) -> Pending:
    """Send host step ``step(*args)`` to ``actor`` (rank ``rank``'s process, or a spare's) as a call
    on Ray's tasks, for a process no executor drives yet; its pending (named ``what``, default the step)."""
    call = CallRecord.of_parts(call_id, generation, what or step, (step_part(rank, step, args, node, coords),))
    return RayTasks().send(call, actors={rank: actor})[0]
