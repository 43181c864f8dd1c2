"""Recording group calls: the recorder (a group's call observer), and what each traced call adds to it.

Tracing is off unless a group has an observer (:mod:`.observer`): ``wg.trace(path)``'s recorder
for that group, else the program-wide one in :data:`TRACING` (``with rankmesh.trace(path):``
around a block, or ``RANKMESH_TRACE=path`` for a whole program).  The hot path pays one
attribute read for it: a group call reads its observer once and, when it is ``None``, does
nothing else different.  ``RANKMESH_TRACE`` is read once, by the first read of
``TRACING.recorder`` (a group's first call or shutdown, or entering ``rankmesh.trace``), never when a group
is built or this module imported: worker processes, which import it but call no group, never
record; the program's recorder is written at exit.

With a recorder observing, a blocking call records on the controller the end of each phase
(split, put, submit, wait, fetch, concat) with :class:`CallTrace`, and asks every rank to time itself
(``RankCall.trace``): the rank's host wraps its output in a :data:`TracedOutput` carrying a
:class:`RankTiming` (worker clock), which :meth:`CallTrace.received` strips before the outputs are
joined.  A non-blocking call's outputs travel inside a future, untouched, so its ranks keep their
timings instead (``RankCall.keep``, a key the recorder files the call under in :attr:`Recorder.kept`):
a Ray host holds them in a small
buffer (:data:`KEEP_MAX` per process, oldest dropped) that the controller drains for free with
the next traced blocking call on that host (appended to its :data:`TracedOutput`), or with one
``drain_timings`` round per group when the trace is written or the group shut down
(:meth:`TraceSlot.drain`; a call still running then is left out).  A host's buffer serves every
recorder whose calls ran there, so the keys are unique in the process (:attr:`TraceSlot.keys`)
and whoever receives a timing hands it to the recorder that made the call
(:meth:`TraceSlot.deliver`).  The future a non-blocking call returns becomes
the tail of a flow arrow to every later call that takes it as an argument.

``wait`` ends when every rank's output is ready and ``fetch`` when the controller has them all
deserialized, without a Ray round between the two: on Ray the first rank's traced output starts
with a :class:`FetchMark`, which Ray's ``ray.get`` unpickles only after every object of the call is
available (checked with a slow rank: a fast rank's mark is unpickled when the slow one's output
arrives), so its unpickling (:func:`fetch_started`) is the end of the wait.  A call long enough to
be waited for in slices (:mod:`rankmesh.backends.ray.waiting`) sets :attr:`FetchClock.ready_ns`
when the last output is ready instead; outputs of ranks that finished early in such a call are
fetched while the others run, inside ``wait``.

Worker clocks are not assumed to equal the controller's.  Each traced call bounds the offset
``theta = worker_clock - controller_clock`` of every rank from both sides: the rank cannot start
before the controller submitted (``theta <= t_enter - t_submit``) nor finish after the
controller fetched (``theta >= t_end - t_fetched``; for a non-blocking call, whose outputs the
controller may never fetch, the time its timing reached the controller).  A drain round bounds
it from both sides too: the host's clock read between sending and receiving it.  The recorder keeps the tightest bounds
over all calls and uses the offset they allow that is nearest zero, so every rank span lands
inside its call's window on the controller's clock.  Not their midpoint (NTP's estimate): a rank
whose calls reach it late (a slow link to its node) widens its upper bound by that lateness, and
the midpoint would move its spans earlier by half of it, hiding the very delay a trace should
show; clocks of one machine, or of machines NTP keeps in step, agree to well within a call.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple, Sequence

from rankmesh.errors import TraceError
from rankmesh.validate import ErrorType, writable_file

from .chrome import write_trace
from .marks import FETCH, FETCH_MARK, RankTiming, payload_bytes

logger = logging.getLogger(__name__)

#: Environment variable: a path; when set, the process records every call and writes the file at exit.
TRACE_ENV = "RANKMESH_TRACE"

#: Controller phases of a call, in order (a call has the ones it went through).
PHASES = ("split", "put", "submit", "wait", "fetch", "concat")
#: Phases of one rank's share of a call.
RANK_PHASES = ("receive", "method", "return")
#: Mesh axes a trace names ranks by (the expert view's etp/edp repeat them).
MESH_AXES = ("tp", "cp", "ep", "pp", "dp")


@dataclass
class GroupTrack:
    """One worker group as the trace shows it: a process track with one thread per rank."""

    pid: int
    name: str
    mesh: dict[str, int]
    ranks: list[dict[str, Any]]  # per rank: {"rank", "coords": RankCoords.to_dict(), "label": RankCoords.label(), "node"}
    at_once: bool = True  # the ranks of a call run at the same time (WorkerGroup.ranks_run_at_once)

    def rank_label(self, rank: int) -> str:
        info = self.ranks[rank]
        return " · ".join(part for part in (f"rank {rank}", info["label"], info["node"]) if part)


class RankRecord(NamedTuple):
    rank: int
    timing: RankTiming


class CallTrace:
    """What the controller records of one group call: the :class:`~.observer.ObservedCall` a recorder hands out.

    Kept lean, because a traced call pays for it: phases are ``(name, end time)`` pairs, the
    ranks' timings stay the plain tuples they arrived as until the trace is written
    (:attr:`ranks`), and clock bounds are folded in then too (:attr:`Recorder.clock_bounds`).
    """

    __slots__ = ("recorder", "id", "group", "method", "thread", "start_ns", "blocking", "marks", "put_bytes",
                 "flows_in", "flow_out", "end_ns", "fetched_ns", "_ranks", "_timings", "_seen", "_expect")

    def __init__(self, recorder: "Recorder", id: int, group: GroupTrack, method: str, thread: int, start_ns: int,
                 blocking: bool) -> None:
        self.recorder, self.id, self.group, self.method = recorder, id, group, method
        self.thread, self.start_ns, self.blocking = thread, start_ns, blocking
        self.marks: list[tuple[str, int]] = []
        self.put_bytes = 0
        self.flows_in: list[int] = []
        self.flow_out: int | None = None
        self.end_ns: int | None = None
        self.fetched_ns = 0  # when the ranks' outputs (and timings) were in the controller's hands
        self._ranks: Sequence[int] = ()
        self._timings: Sequence[tuple[int, ...]] = ()
        self._seen: list[int] | None = None  # a kept call: when each rank's timing reached the controller
        self._expect = 0

    # ----- what the group tells it (rankmesh.tracing.observer.ObservedCall) ---------------------

    def phase(self, name: str) -> None:
        """Phase ``name`` ends now (it began where the previous one ended)."""
        self.marks.append((name, time.time_ns()))

    def shipped(self, value: Any) -> None:
        """Count ``value``'s array bytes as put by the controller."""
        self.put_bytes += payload_bytes(value)

    def timed(self, ranks: int) -> int:
        """The call's ``ranks`` ranks time themselves: 0 for a blocking call (they send their
        timings back with their outputs), else the key they keep them under (:meth:`Recorder.keep`)."""
        return 0 if self.blocking else self.recorder.keep(self, ranks)

    def received(self, outputs: list[Any], ranks: Sequence[int]) -> list[Any]:
        """The outputs without their :data:`TracedOutput` wrappers; their timings kept.

        Marks the ``wait`` and ``fetch`` phases: ``wait`` ends when every output was ready
        (:data:`FETCH`, set during this call), ``fetch`` now.
        """
        now = self.fetched_ns = time.time_ns()
        first = outputs[0] if outputs else None
        if first and first[0] is FETCH_MARK:  # Ray: the first rank's output starts with the mark
            outputs = [first[1:], *outputs[1:]]
        submitted = self.marks[-1][1] if self.marks else self.start_ns
        ready = FETCH.ready_ns if FETCH.ready_ns > submitted else FETCH.marked_ns if FETCH.marked_ns > submitted else now
        self.marks += (("wait", ready), ("fetch", now))
        self._ranks, self._timings = ranks, [traced[1:7] for traced in outputs]
        for rank, traced in zip(ranks, outputs):
            if len(traced) > 7:  # the host handed over timings of traced non-blocking calls with this output
                TRACING.deliver(rank, traced[7], now)
        return [traced[0] for traced in outputs]

    def end(self, result: Any = None) -> Any:
        """End the call (a blocking call's ``concat`` phase with it); a future output becomes
        the start of a flow.  Returns ``result``."""
        if self.blocking:
            self.phase("concat")
        self.end_ns = time.time_ns()
        if not self.blocking and result is not None:
            self.flow_out = self.recorder.hand_out(result)
        self.recorder.add(self)
        return result

    # ----- what the recorder does with it ----------------------------------------------------------

    def consumes(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Link futures among the arguments to the calls that produced them (flow arrows)."""
        if not self.recorder._keep:  # no future handed out yet: nothing to link
            return
        for value in (*args, *kwargs.values()):
            flow = self.recorder.flow_of(value)
            if flow is not None:
                self.flows_in.append(flow)

    def expect(self, ranks: int) -> None:
        """A non-blocking call: ``ranks`` ranks will hand over their timings later (:meth:`arrived`)."""
        self._ranks, self._timings, self._seen, self._expect = [], [], [], ranks

    def arrived(self, rank: int, timing: Sequence[int], seen_ns: int) -> bool:
        """A kept rank timing reached the controller at ``seen_ns`` (its clock bounds folded in now).

        Returns whether every rank's timing is in now.
        """
        self._ranks.append(rank)  # type: ignore[attr-defined]
        self._timings.append(tuple(timing))  # type: ignore[attr-defined]
        self._seen.append(seen_ns)  # type: ignore[union-attr]
        self.recorder.bound_clocks(self.group.pid, [rank], self.submit_start_ns, seen_ns, [RankTiming(*timing)])
        return len(self._ranks) >= self._expect

    @property
    def seen_ns(self) -> list[int]:
        """Per timed rank, when its timing was in the controller's hands."""
        return list(self._seen) if self._seen is not None else [self.fetched_ns] * len(self._ranks)

    @property
    def submit_start_ns(self) -> int:
        """When the submit phase began (the end of the phase before it; 0 without one)."""
        last = self.start_ns
        for phase, at in self.marks:
            if phase == "submit":
                return last
            last = at
        return 0

    @property
    def ranks(self) -> list[RankRecord]:
        """Each timed rank's own account of the call."""
        return [RankRecord(rank, RankTiming(*t)) for rank, t in zip(self._ranks, self._timings)]


class Recorder:
    """Everything traced in one process: groups, calls, clock bounds; :meth:`write` makes the file.

    A :class:`~.observer.CallObserver`: a group whose observer it is (``wg.trace``, or the
    program-wide one in :data:`TRACING`) calls :meth:`begin` once per call.  ``path`` is where
    :meth:`write` goes by default.  Thread-safe: calls from several threads each land on their
    group's controller track.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.origin_ns = time.time_ns()
        self.groups: dict[int, GroupTrack] = {}
        self.calls: list[CallTrace] = []
        #: Traced non-blocking calls whose ranks still hold timings, by ``RankCall.keep`` key.
        self.kept: dict[int, CallTrace] = {}
        self._bounds: dict[tuple[int, int], tuple[int, int]] = {}
        self._folded = 0  # calls whose timings are in _bounds
        self.startups: list[dict[str, Any]] = []
        self._keep: dict[int, tuple[Any, int]] = {}  # id(future) -> (future, flow id)
        self._members: dict[int, Any] = {}  # track pid -> its group (held: id(group) keys self.groups)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    # ----- controller side (rankmesh.tracing.observer.CallObserver) ------------------------------

    def begin(self, group: Any, method: str, blocking: bool, args: tuple[Any, ...] = (),
              kwargs: dict[str, Any] | None = None) -> CallTrace:
        """A call of ``group.method`` starts now; futures among ``args``/``kwargs`` link it to their calls."""
        track = self.group_track(group)
        call = CallTrace(self, next(self._ids), track, method, track.pid, time.time_ns(), blocking)
        call.consumes(args, kwargs or {})
        return call

    def closing(self, group: Any) -> None:
        """``group`` shuts down: collect the timings its ranks keep of traced non-blocking calls first."""
        TRACING.drain(group)

    def group_track(self, group: Any) -> GroupTrack:
        """The track of ``group`` (a WorkerGroup), made on its first traced call with its start-up report."""
        track = self.groups.get(id(group))
        if track is None:
            mesh = group.mesh
            nodes = group.node_labels
            ranks = []
            for rank in range(group.world_size):
                c = mesh.rank_coords(rank)
                ranks.append({"rank": rank, "coords": c.to_dict(), "label": c.label(), "node": nodes[rank]})
            startup = group.trace_startup
            with self._lock:
                name = group.trace_name
                taken = {t.name for t in self.groups.values()}
                if name in taken:
                    name = f"{name}#{len(self.groups)}"
                track = self.groups[id(group)] = GroupTrack(len(self.groups) + 2, name, {k: v for k, v in mesh.sizes.items() if k in MESH_AXES}, ranks,
                                                            group.ranks_run_at_once)
                self._members[track.pid] = group
                if startup is not None and startup not in self.startups:  # roles of one executor share one
                    self.startups.append(startup)
        return track

    def add(self, call: CallTrace) -> None:
        with self._lock:
            self.calls.append(call)

    def keep(self, call: CallTrace, ranks: int) -> int:
        """File non-blocking ``call``, whose ``ranks`` ranks keep their timings; returns the key they keep them under."""
        key = TRACING.keep_key(self)
        call.expect(ranks)
        with self._lock:
            self.kept[key] = call
        return key

    def keeps_on(self, group: Any) -> bool:
        """Whether ranks of ``group`` (or of a group on the same processes) hold timings of this recorder's calls."""
        return any(_same_ranks(self._members[ct.group.pid], group) for ct in list(self.kept.values()))

    def let_go(self, group: Any) -> None:
        """Stop waiting for timings kept on ``group``'s ranks (drained, or they never will come)."""
        with self._lock:
            for key, ct in list(self.kept.items()):
                if _same_ranks(self._members[ct.group.pid], group):
                    del self.kept[key]

    def arrived(self, key: int, rank: int, timing: Sequence[int], seen_ns: int) -> bool:
        """Rank ``rank``'s timing of kept call ``key`` reached the controller; False if the key is not this recorder's."""
        ct = self.kept.get(key)
        if ct is None:
            return False
        if ct.arrived(rank, timing, seen_ns):
            with self._lock:
                self.kept.pop(key, None)
        return True

    def hand_out(self, future: Any) -> int:
        flow = next(self._ids)
        with self._lock:
            self._keep[id(future)] = (future, flow)
        return flow

    def flow_of(self, value: Any) -> int | None:
        kept = self._keep.get(id(value))
        return kept[1] if kept is not None and kept[0] is value else None

    @property
    def clock_bounds(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(group track pid, rank) -> (lower, upper) bounds on the rank's clock offset, over every timed call."""
        with self._lock:
            calls, start = self.calls, self._folded
            self._folded = len(calls)
            for call in calls[start:]:
                if call._timings and call._seen is None:  # kept calls are folded as their timings arrive
                    self.bound_clocks(call.group.pid, call._ranks, call.submit_start_ns, call.fetched_ns,
                                      [RankTiming(*t) for t in call._timings])
            return self._bounds

    def bound_clocks(
        self, pid: int, ranks: Sequence[int], submitted_ns: int, fetched_ns: int, timings: Sequence[RankTiming]
    ) -> None:
        """Tighten the bounds on each rank's clock offset with one call (module docstring)."""
        for rank, t in zip(ranks, timings):
            self.bound_clock(pid, rank, t.end_ns - fetched_ns, t.enter_ns - submitted_ns)

    def bound_clock(self, pid: int, rank: int, lower: int, upper: int) -> None:
        """Tighten one rank's offset bounds to ``lower <= worker clock - controller clock <= upper``."""
        old = self._bounds.get((pid, rank))
        if old is not None:
            lower, upper = max(lower, old[0]), min(upper, old[1])
        self._bounds[(pid, rank)] = (lower, upper)

    def clock_offset_ns(self, pid: int, rank: int) -> int:
        """Estimated ``worker clock - controller clock`` of a rank: the value its bounds allow that
        is nearest zero (module docstring); 0 before any traced call."""
        lower, upper = self.clock_bounds.get((pid, rank), (0, 0))
        if lower > upper:  # bounds that disagree (a clock stepped between calls): their middle
            return (lower + upper) // 2
        return min(max(0, lower), upper)

    def settle(self) -> None:
        """Drain the ranks still holding timings of this recorder's non-blocking calls (before writing).

        What is not handed over then never will be for this trace: the recorder stops waiting.
        """
        owners = {ct.group.pid: self._members[ct.group.pid] for ct in list(self.kept.values())}
        for group in owners.values():
            TRACING.drain(group)
        with self._lock:
            self.kept.clear()

    def write(self, path: str | os.PathLike[str] | None = None) -> str:
        """Write the trace as Chrome trace-event JSON to ``path`` (default: :attr:`path`); returns the path."""
        target = path if path is not None else self.path
        if target is None:
            raise ValueError("Recorder.write() needs a path: this recorder was made without one (Recorder(path))")
        return write_trace(self, target)


def _same_ranks(a: Any, b: Any) -> bool:
    """Whether groups ``a`` and ``b`` run on the same ranks (one group, or roles spawned from one executor)."""
    return a is b or getattr(a, "executor", a) is getattr(b, "executor", b)


class TraceSlot:
    """The process's tracing state: its program-wide recorder, and what every recorder of it shares.

    One per process (:data:`TRACING`), because two things are process-wide by nature:

    * ``recorder``, the program-wide observer (``None``: tracing off) that every group without
      one of its own (``wg.trace``) reads once per call.  It starts unread: the first read makes
      it from ``$RANKMESH_TRACE`` (a recorder written at exit, or ``None``), then it is a plain
      attribute.  :func:`install` replaces it.
    * the bookkeeping of kept timings.  A Ray host keeps the timings of every traced
      non-blocking call that ran there, whichever recorder made it, and hands them all over
      to whoever asks next; so the keys are unique in the process (:meth:`keep_key`) and the
      slot knows which recorders wait for some (:attr:`keepers`, held weakly: a recorder
      nobody holds waits for nothing).  The kept calls themselves are each recorder's
      (:attr:`Recorder.kept`).
    """

    recorder: Recorder | None  # set on first read (__getattr__), then by install()

    def __init__(self) -> None:
        self.env_recorder: Recorder | None = None  # the one made from $RANKMESH_TRACE, if any
        self.keepers: weakref.WeakSet[Recorder] = weakref.WeakSet()
        self._keys = itertools.count(1)
        self._first_read = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        """The first read of ``recorder`` (no value yet): make it from ``$RANKMESH_TRACE``."""
        if name != "recorder":
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        with self._first_read:  # two threads' first calls make one recorder
            if "recorder" not in vars(self):
                path = os.environ.get(TRACE_ENV)
                recorder = self.env_recorder = Recorder(path) if path else None
                if recorder is not None:
                    atexit.register(_write_at_exit, recorder)
                self.recorder = recorder
        return vars(self)["recorder"]

    def keep_key(self, recorder: Recorder) -> int:
        """A key no other kept call of the process has, for a non-blocking call of ``recorder``."""
        self.keepers.add(recorder)
        return next(self._keys)

    def deliver(self, rank: int, entries: Sequence[Sequence[int]], seen_ns: int) -> None:
        """Kept timings of rank ``rank``'s host (``[key, *RankTiming]`` each) reached the controller at ``seen_ns``.

        Each goes to the recorder whose call it is; one whose trace was written already, or
        whose host dropped older entries, is left out.
        """
        keepers = list(self.keepers)
        for key, *timing in entries:
            for recorder in keepers:
                if recorder.arrived(key, rank, timing, seen_ns):
                    break

    def drain(self, group: Any) -> None:
        """Collect the timings ``group``'s ranks keep of traced non-blocking calls (one round, if any are kept).

        ``group.drain_rank_timings()`` answers, per rank, ``(rank, entries, sent_ns, host_ns,
        received_ns)``; the host clock read between sending and receiving bounds the rank's clock
        offset.  Best effort: a group already shut down keeps its timings to itself.
        """
        waiting = [r for r in list(self.keepers) if r.keeps_on(group)]
        if not waiting:
            return
        try:
            answers = group.drain_rank_timings()
        except Exception:  # noqa: BLE001 - a trace is a bonus: never fail the program over it
            logger.warning("could not collect the rank timings of %s's non-blocking calls", getattr(group, "trace_name", group), exc_info=True)
            answers = []
        keepers = list(self.keepers)
        for rank, entries, sent_ns, host_ns, received_ns in answers:
            for key, *_ in entries:
                for recorder in keepers:
                    ct = recorder.kept.get(key)
                    if ct is not None:
                        recorder.bound_clock(ct.group.pid, rank, host_ns - received_ns, host_ns - sent_ns)
            self.deliver(rank, entries, received_ns)
        for recorder in waiting:  # what was not handed over now never will be
            recorder.let_go(group)


def _write_at_exit(recorder: Recorder) -> None:
    try:
        logger.info("rankmesh trace written to %s", recorder.write())
    except Exception:  # pragma: no cover - best effort at exit
        logger.exception("could not write the rankmesh trace to %s", recorder.path)


#: The process's slot; a group without an observer of its own reads ``TRACING.recorder`` per call.
TRACING = TraceSlot()


def deliver(rank: int, entries: Sequence[Sequence[int]], seen_ns: int) -> None:
    """:meth:`TraceSlot.deliver` on the process's slot (what the in-process backend calls as its ranks finish)."""
    TRACING.deliver(rank, entries, seen_ns)


def install(recorder: Recorder | None) -> Recorder | None:
    """Make ``recorder`` the process's program-wide recorder (``None``: tracing off); returns the previous one."""
    previous, TRACING.recorder = TRACING.recorder, recorder
    return previous


def check_trace_path(path: Any, what: str = "trace(path)", error: ErrorType = TraceError) -> str:
    """``path`` checked as a place a trace can be written, before anything is recorded (the one rule for it).

    Missing folders are fine (:func:`~.chrome.write_trace` makes them); a directory, a path under
    a file, or a folder this process may not write raise ``error`` naming ``what``.  Used on
    entering ``trace``/``wg.trace`` and by ``rankmesh demo --trace``, so a bad path fails before
    the work whose trace it was to hold.
    """
    return writable_file(path, what, error, make_folders=True)


@contextmanager
def trace(path: str | os.PathLike[str]) -> Iterator[Recorder]:
    """Record every group call made in the block; write a Chrome trace to ``path`` when it ends.

    Open the file in https://ui.perfetto.dev or ``chrome://tracing``; ``rankmesh trace
    summarize``/``plot`` read it too.  Inside the block this recorder is the program-wide
    one; the one before it (``RANKMESH_TRACE``'s, say) is back when the block ends.  A path no
    trace can be written to raises :class:`~rankmesh.errors.TraceError` on entry, before the block runs.
    """
    path = check_trace_path(path)
    recorder = Recorder(path)
    previous = install(recorder)
    try:
        yield recorder
    finally:
        install(previous)
        write_trace(recorder, path)
