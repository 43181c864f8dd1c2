"""Reading a trace back: per method, call times, phases, the slowest rank and replica skew.

Works on the file alone (:func:`load_trace`), so a trace from another machine summarizes the
same.  "Slowest rank" of a call is, where its ranks run at the same time (each its own
process: the group's ``at_once`` in the trace), the rank whose worker method ended last, counted
from the call's start (the rank clocks are aligned to the controller's when the trace is
written): a rank whose input arrives late (a slow link to its node, a busy store) holds the call
back as surely as one that computes slowly, and is named the same way.  Where they run one after
another (in-process), a rank's end says only its turn: there it is the rank whose worker method
ran longest.  "Replica skew" is, per call, the spread
between the dp replicas' worker-method times (a replica's time is its slowest rank's), the
figure that says whether one replica holds the others back.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from rankmesh.errors import RankMeshError


@dataclass
class CallRecord:
    """One call read back from a trace (times in microseconds)."""

    id: int
    group: str
    method: str
    start_us: float
    dur_us: float
    phases: dict[str, float] = field(default_factory=dict)
    phase_bytes: dict[str, int] = field(default_factory=dict)  # array bytes of the phases that move data
    method_us: dict[int, float] = field(default_factory=dict)  # rank -> worker method time
    end_us: dict[int, float] = field(default_factory=dict)  # rank -> when its worker method ended, from the call's start
    bytes_moved: int = 0


#: Calls (with rank timings) a method needs before the summary names one rank its straggler.
STRAGGLER_MIN_CALLS = 3


@dataclass
class MethodSummary:
    """Every call of one group method."""

    group: str
    method: str
    calls: int
    median_ms: float
    p95_ms: float
    phase_ms: dict[str, float]  # median per controller phase
    slowest: list[int]  # the rank that ended last in each call with rank timings, in call order
    slowest_counts: dict[int, int]
    skew_ms: float | None  # median spread between dp replicas
    bytes_per_s: float | None
    rank_ms: dict[int, float]  # median worker-method time per rank
    phase_bytes: dict[str, float] = field(default_factory=dict)  # median array bytes per phase that moves data (put, fetch)

    @property
    def straggler(self) -> int | None:
        """The rank slowest more often than any other, over at least :data:`STRAGGLER_MIN_CALLS`
        calls with rank timings (``None``: fewer calls, no rank timings, or a tie).  One call's
        slowest rank is as often noise (a page fault, the scheduler) as a slow rank."""
        ranked = sorted(self.slowest_counts.values(), reverse=True)
        if len(self.slowest) < STRAGGLER_MIN_CALLS or not ranked or (len(ranked) > 1 and ranked[0] == ranked[1]):
            return None
        return max(self.slowest_counts, key=self.slowest_counts.__getitem__)


@dataclass
class TraceSummary:
    """The summary of a trace file: one :class:`MethodSummary` per (group, method)."""

    path: str
    methods: list[MethodSummary]
    groups: dict[str, Any]

    def format(self) -> str:
        lines = [f"trace {self.path}: {sum(m.calls for m in self.methods)} calls, {len(self.groups)} group(s)"]
        for m in self.methods:
            lines.append(f"\n{m.group}.{m.method}: {m.calls} call(s), median {m.median_ms:.2f} ms, p95 {m.p95_ms:.2f} ms")
            if m.phase_ms:
                parts = [f"{k} {v:.2f}" + (f" [{_size(m.phase_bytes[k])}]" if m.phase_bytes.get(k) else "")
                         for k, v in m.phase_ms.items()]
                lines.append("  phases (median ms, [bytes]): " + ", ".join(parts))
            if m.rank_ms:
                fast = min(m.rank_ms.values())
                worst = max(m.rank_ms, key=m.rank_ms.__getitem__)
                lines.append(
                    f"  worker method per rank (median ms): fastest {fast:.2f}, slowest {m.rank_ms[worst]:.2f} (rank {worst})"
                )
            if m.slowest_counts:
                ranked = sorted(m.slowest_counts.items(), key=lambda kv: (-kv[1], kv[0]))
                counts = ", ".join(f"rank {r} x{n}" for r, n in ranked[:4])
                if len(m.slowest) < STRAGGLER_MIN_CALLS:
                    verdict = f"too few calls to name a straggler ({len(m.slowest)} of the {STRAGGLER_MIN_CALLS} needed)"
                elif m.straggler is None:
                    verdict = "no single straggler"
                else:
                    verdict = f"straggler: rank {m.straggler} (slowest in {m.slowest_counts[m.straggler]} of {len(m.slowest)} calls)"
                lines.append(f"  slowest rank per call: {counts}; {verdict}")
            if m.skew_ms is not None:
                lines.append(f"  skew between dp replicas (median): {m.skew_ms:.2f} ms")
            if m.bytes_per_s is not None:
                rate = m.bytes_per_s
                text = f"{rate / 1e6:.1f} MB/s" if rate >= 1e6 else f"{rate / 1e3:.1f} kB/s"
                lines.append(f"  data moved: {text} of call time")
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The trace document at ``path``; a clear error when it is not a rankmesh trace."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise RankMeshError(f"no trace file at {path}; record one with RANKMESH_TRACE={path} or rankmesh.trace(...)") from None
    except IsADirectoryError:
        raise RankMeshError(f"{path}: is a directory, not a trace file (give the .json file a trace wrote)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RankMeshError(f"{path}: cannot read the trace ({exc})") from None
    except json.JSONDecodeError as exc:
        raise RankMeshError(f"{path} is not JSON ({exc}); is it a trace written by rankmesh?") from None
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise RankMeshError(f"{path} has no traceEvents: not a Chrome trace-event file")
    return doc


def spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Matched ``B``/``E`` pairs as ``{pid, tid, name, cat, ts, dur, args}``, per track in order."""
    open_: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    out = []
    for e in events:
        if e.get("ph") == "B":
            open_[(e["pid"], e["tid"])].append(e)
        elif e.get("ph") == "E":
            stack = open_[(e["pid"], e["tid"])]
            if stack:
                b = stack.pop()
                out.append({**b, "dur": e["ts"] - b["ts"], "args": {**b.get("args", {}), **e.get("args", {})}})
    return out


def calls_of(doc: dict[str, Any]) -> list[CallRecord]:
    """Every call of the trace, with its controller phases and per-rank worker times."""
    calls: dict[int, CallRecord] = {}
    all_spans = spans(doc["traceEvents"])
    for s in all_spans:
        if s.get("cat") == "call":
            a = s["args"]
            calls[a["call"]] = CallRecord(a["call"], a["group"], s["name"], s["ts"], s["dur"], bytes_moved=a.get("put_bytes", 0))
    by_track_call: dict[tuple[int, int], int] = {}
    for s in sorted(all_spans, key=lambda s: (s["ts"], s.get("cat") != "call")):
        a, cat = s["args"], s.get("cat")
        if cat == "call":
            by_track_call[(s["pid"], s["tid"])] = a["call"]
        elif cat == "phase":
            owner = calls.get(by_track_call.get((s["pid"], s["tid"]), -1))
            if owner is not None:
                owner.phases[s["name"]] = owner.phases.get(s["name"], 0.0) + s["dur"]
                if "bytes" in a:
                    owner.phase_bytes[s["name"]] = owner.phase_bytes.get(s["name"], 0) + a["bytes"]
        elif cat in ("method", "rank") and a.get("call") in calls:
            call = calls[a["call"]]
            if cat == "method":
                call.method_us[a["rank"]] = s["dur"]
                call.end_us[a["rank"]] = s["ts"] + s["dur"] - call.start_us
            elif s["name"] == "return":
                call.bytes_moved += a.get("bytes", 0)
    return sorted(calls.values(), key=lambda c: c.start_us)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]


def summarize(path: str | os.PathLike[str]) -> TraceSummary:
    """The :class:`TraceSummary` of the trace file at ``path``."""
    doc = load_trace(path)
    groups = doc.get("otherData", {}).get("rankmesh", {}).get("groups", {})
    dp_of = {g["name"]: {r["rank"]: r["coords"].get("dp", 0) for r in g["ranks"]} for g in groups.values()}
    at_once = {g["name"]: g.get("at_once", True) for g in groups.values()}
    by_method: dict[tuple[str, str], list[CallRecord]] = defaultdict(list)
    for call in calls_of(doc):
        by_method[(call.group, call.method)].append(call)
    methods = []
    for (group, method), calls in by_method.items():
        durs = [c.dur_us / 1000 for c in calls]
        phase_names = [p for c in calls for p in c.phases]
        phases = {p: statistics.median(c.phases.get(p, 0.0) for c in calls) / 1000 for p in dict.fromkeys(phase_names)}
        moving = dict.fromkeys(p for c in calls for p in c.phase_bytes)
        phase_bytes = {p: statistics.median(c.phase_bytes.get(p, 0) for c in calls) for p in moving}
        timed = [c for c in calls if c.method_us]
        ended = "end_us" if at_once.get(group, True) else "method_us"
        slowest = [max(getattr(c, ended), key=getattr(c, ended).__getitem__) for c in timed]
        per_rank: dict[int, list[float]] = defaultdict(list)
        skews = []
        for c in timed:
            replicas: dict[int, float] = defaultdict(float)
            for rank, us in c.method_us.items():
                per_rank[rank].append(us / 1000)
                replica = dp_of.get(group, {}).get(rank, 0)
                replicas[replica] = max(replicas[replica], us / 1000)
            if len(replicas) > 1:
                skews.append(max(replicas.values()) - min(replicas.values()))
        total_s = sum(c.dur_us for c in calls) / 1e6
        moved = sum(c.bytes_moved for c in calls)
        methods.append(
            MethodSummary(
                group,
                method,
                len(calls),
                statistics.median(durs),
                _p95(durs),
                phases,
                slowest,
                dict(Counter(slowest)),
                statistics.median(skews) if skews else None,
                moved / total_s if moved and total_s > 0 else None,
                {r: statistics.median(v) for r, v in sorted(per_rank.items())},
                phase_bytes,
            )
        )
    return TraceSummary(os.fspath(path), methods, groups)
