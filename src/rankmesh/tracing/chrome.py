"""The Chrome trace-event JSON a recorder writes: what Perfetto and ``chrome://tracing`` open.

The file is the trace-event format's object form (``{"traceEvents": [...], ...}``), duration
events as matched ``B``/``E`` pairs, metadata (``M``) naming the tracks, flow events (``s``/``f``)
for futures handed between groups:

* process 1, ``controller``: one thread per worker group; each call is a slice named after the
  method, with one child slice per controller phase (split, put, submit, wait, fetch, concat;
  ``put`` and ``fetch`` carry the array bytes the controller shipped and got back);
* one process per worker group (``name · tp2 pp2 dp2``), one thread per rank named with its
  coordinates and node (``rank 5 · tp1 pp1 dp0 · node 0``): per call, ``receive`` (submitted
  until the worker method starts), the worker method, ``return`` (until the controller has
  the output), with array bytes in the arguments.  A non-blocking call's outputs go into a
  future, not to the controller: its ``return`` is an instant (bytes only), and its rank spans
  lie after its controller slice, between its submit and the time its timings were drained.

Times are microseconds since the recorder started, on the controller's clock (worker times
shifted by the measured offset, see :mod:`.recorder`).  ``otherData.rankmesh`` keeps what the
summary and the plot need besides the events: each group's mesh and rank coordinates, the
clock offsets, start-up reports.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the recorder writes itself through this module (Recorder.write)
    from .recorder import CallTrace, Recorder

CONTROLLER_PID = 1
FORMAT_VERSION = 1


def _meta(pid: int, tid: int | None, name: str, value: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"ph": "M", "pid": pid, "name": name, "args": {"name" if "name" in name else "sort_index": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _span(pid: int, tid: int, name: str, cat: str, start_us: float, end_us: float, args: dict[str, Any] | None = None):
    begin = {"ph": "B", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": start_us}
    if args:
        begin["args"] = args
    return [begin, {"ph": "E", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": max(end_us, start_us)}]


def _call_events(rec: Recorder, call: CallTrace, busy: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    """The call's events; ``busy[(pid, rank)]``: when the rank's previous call ended on its track
    (a rank runs its calls in order, so one submitted while it is busy is received after)."""
    us = lambda ns: round((ns - rec.origin_ns) / 1000, 3)  # noqa: E731 - one conversion, used everywhere
    track, events = call.group, []
    end = call.end_ns if call.end_ns is not None else (call.marks[-1][1] if call.marks else call.start_ns)
    args = {"call": call.id, "group": track.name, "blocking": call.blocking, "put_bytes": call.put_bytes}
    events.append({"ph": "B", "pid": CONTROLLER_PID, "tid": call.thread, "name": call.method, "cat": "call",
                   "ts": us(call.start_ns), "args": args})
    for flow in call.flows_in:
        events.append({"ph": "f", "bp": "e", "id": flow, "pid": CONTROLLER_PID, "tid": call.thread,
                       "name": "future", "cat": "future", "ts": us(call.start_ns)})
    last = call.start_ns
    for phase, at in call.marks:
        if phase == "put":
            extra: dict[str, Any] | None = {"bytes": call.put_bytes}
        elif phase == "fetch":
            extra = {"bytes": sum(r.timing.bytes_out for r in call.ranks)}
        else:
            extra = None
        events += _span(CONTROLLER_PID, call.thread, phase, "phase", us(last), us(at), extra)
        last = at
    if call.flow_out is not None:
        events.append({"ph": "s", "id": call.flow_out, "pid": CONTROLLER_PID, "tid": call.thread,
                       "name": "future", "cat": "future", "ts": us(max(call.start_ns, end - 1000))})
    events.append({"ph": "E", "pid": CONTROLLER_PID, "tid": call.thread, "name": call.method, "cat": "call", "ts": us(end)})
    fetched = dict(call.marks).get("wait", end)
    for r, seen in zip(call.ranks, call.seen_ns):
        t, offset = r.timing, rec.clock_offset_ns(track.pid, r.rank)
        limit = us(fetched if call.blocking else seen)
        begin = min(max(us(call.submit_start_ns), busy.get((track.pid, r.rank), 0.0)), limit)
        start = min(max(us(t.start_ns - offset), begin), limit)
        stop = min(max(us(t.end_ns - offset), start), limit)
        returned = limit if call.blocking else stop
        info = {"call": call.id, "method": call.method, "rank": r.rank}
        events += _span(track.pid, r.rank, "receive", "rank", begin, start, {**info, "bytes": t.bytes_in})
        events += _span(track.pid, r.rank, call.method, "method", start, stop, info)
        events += _span(track.pid, r.rank, "return", "rank", stop, returned, {**info, "bytes": t.bytes_out})
        busy[(track.pid, r.rank)] = returned
    return events


def trace_document(rec: Recorder) -> dict[str, Any]:
    """The whole trace as a JSON-ready dict (what :func:`write_trace` writes)."""
    events = [_meta(CONTROLLER_PID, None, "process_name", "controller"), _meta(CONTROLLER_PID, None, "process_sort_index", 0)]
    groups = sorted(rec.groups.values(), key=lambda g: g.pid)
    for g in groups:
        sizes = " ".join(f"{k}{v}" for k, v in g.mesh.items() if v > 1) or "1 rank"
        events.append(_meta(CONTROLLER_PID, g.pid, "thread_name", f"{g.name} calls"))
        events.append(_meta(g.pid, None, "process_name", f"{g.name} · {sizes}"))
        events.append(_meta(g.pid, None, "process_sort_index", g.pid))
        for info in g.ranks:
            events.append(_meta(g.pid, info["rank"], "thread_name", g.rank_label(info["rank"])))
            events.append(_meta(g.pid, info["rank"], "thread_sort_index", info["rank"]))
    timed: list[dict[str, Any]] = []
    busy: dict[tuple[int, int], float] = {}
    for call in sorted(rec.calls, key=lambda c: c.start_ns):
        timed += _call_events(rec, call, busy)
    # Stable sort: events of one track were made in time order, ties keep nesting order.
    timed.sort(key=lambda e: e["ts"])
    offsets = {f"{g.name}/{r}": rec.clock_offset_ns(pid, r) / 1000 for (pid, r) in rec.clock_bounds for g in groups if g.pid == pid}
    other = {
        "version": FORMAT_VERSION,
        "groups": {str(g.pid): {"name": g.name, "mesh": g.mesh, "ranks": g.ranks, "at_once": g.at_once} for g in groups},
        "clock_offsets_us": offsets,
        "startups": rec.startups,
    }
    return {"traceEvents": events + timed, "displayTimeUnit": "ms", "otherData": {"rankmesh": other}}


def write_trace(rec: Recorder, path: str | os.PathLike[str]) -> str:
    """Write ``rec`` as Chrome trace-event JSON to ``path``; returns the path."""
    path = os.fspath(path)
    rec.settle()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace_document(rec), f)
    return path
