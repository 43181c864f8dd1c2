"""Tracing group calls: the file is valid trace-event JSON, it names a slowed rank, it costs nothing off.

The format checks are written from the trace-event format document (Google's "Trace Event
Format"), not from rankmesh's writer: required keys per phase type, B/E pairs matched per
thread in file order, timestamps never going back on a track, flow ends with a start.  The
slowed rank is chosen by the test (``trace_workers.SLOW_RANK``); the summary must find it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from rankmesh.backends.local import LocalWorkerGroup
from rankmesh.cli import main as cli_main
from rankmesh.data import DataProto, DataProtoFuture
from rankmesh.mesh import RankMesh
from rankmesh.tracing import TRACE_ENV, TRACING, summarize, trace

from .trace_workers import SLOW_RANK, SLOW_S, TracedWorker

SRC = Path(__file__).resolve().parents[1] / "src"


def check_trace_event_format(doc: dict) -> dict[tuple[int, int], str]:
    """Assert ``doc`` follows the trace-event format; returns the thread names by (pid, tid)."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    names: dict[tuple[int, int], str] = {}
    stacks: dict[tuple[int, int], list[str]] = defaultdict(list)
    last_ts: dict[tuple[int, int], float] = {}
    flow_starts, flow_ends = set(), set()
    for e in doc["traceEvents"]:
        ph = e["ph"]
        assert isinstance(e["name"], str) and isinstance(e["pid"], int), e
        if ph == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            if e["name"] == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            continue
        assert ph in ("B", "E", "s", "f"), e
        track = (e["pid"], e["tid"])
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert e["ts"] >= last_ts.get(track, 0.0), f"time goes back on track {track}: {e}"
        last_ts[track] = e["ts"]
        if ph == "B":
            stacks[track].append(e["name"])
        elif ph == "E":
            assert stacks[track], f"E without B on {track}: {e}"
            assert stacks[track].pop() == e["name"], f"E does not match the open B on {track}: {e}"
        elif ph == "s":
            flow_starts.add(e["id"])
        else:
            assert e.get("bp") == "e" and stacks[track], f"flow end outside a slice: {e}"
            flow_ends.add(e["id"])
    assert not any(stacks.values()), f"unclosed slices: { {k: v for k, v in stacks.items() if v} }"
    assert flow_ends <= flow_starts, "a flow ends that never started"
    for track in last_ts:
        assert track in names, f"track {track} has no thread_name"
    return names


def spans_of(doc: dict) -> list[dict]:
    out, open_ = [], defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "B":
            open_[(e["pid"], e["tid"])].append(e)
        elif e["ph"] == "E":
            b = open_[(e["pid"], e["tid"])].pop()
            out.append({**b, "end": e["ts"]})
    return out


def batch(rows: int = 8) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)})


def test_off_by_default_and_outputs_unchanged_when_on(tmp_path):
    assert TRACING.recorder is None
    wg = LocalWorkerGroup(TracedWorker, RankMesh(tp=2, pp=2, dp=2), init_kwargs={"slow_rank": -1})
    data = batch()
    plain = wg.compute(data)
    with trace(tmp_path / "t.json"):
        traced = wg.compute(data)
        future = wg.produce(data)
        assert isinstance(future, DataProtoFuture)
        fetched = future.get()
        assert wg.noop() == [None] * 8
    assert TRACING.recorder is None
    assert isinstance(traced, DataProto) and isinstance(fetched, DataProto)  # no timing wrapper left
    assert torch.equal(traced.batch["x"], data.batch["x"]) and torch.equal(plain.batch["x"], data.batch["x"])
    assert torch.equal(fetched.batch["x"], data.batch["x"])


def test_local_trace_names_the_slowed_rank(tmp_path):
    path = tmp_path / "local.json"
    wg = LocalWorkerGroup(TracedWorker, RankMesh(tp=2, pp=2, dp=2))
    with trace(path):
        for _ in range(3):
            wg.compute(batch())
    doc = json.loads(path.read_text())
    names = check_trace_event_format(doc)
    # megatron order tp-cp-ep-dp-pp on tp2 pp2 dp2: rank 5 = tp 1, dp 0, pp 1 (5 = 1 + 2*0 + 4*1).
    assert "rank 5 · tp1 dp0 pp1 · local" in names.values()
    summary = summarize(path)
    (m,) = summary.methods
    assert (m.method, m.calls, m.straggler) == ("compute", 3, SLOW_RANK)
    assert m.slowest == [SLOW_RANK] * 3
    assert m.rank_ms[SLOW_RANK] >= SLOW_S * 1000 * 0.9
    assert m.skew_ms is not None and m.skew_ms >= SLOW_S * 1000 * 0.8  # rank 5 is in replica dp0
    assert "straggler: rank 5" in summary.format()


def test_group_trace_records_that_group_alone(tmp_path):
    path = tmp_path / "group.json"
    traced = LocalWorkerGroup(TracedWorker, RankMesh(tp=2, pp=2, dp=2))
    other = LocalWorkerGroup(TracedWorker, RankMesh(dp=2), init_kwargs={"slow_rank": -1})
    with traced.trace(path) as recorder:
        assert TRACING.recorder is None  # nothing program-wide was installed
        traced.compute(batch())
        other.compute(batch())
    assert TRACING.recorder is None and recorder is not None
    doc = json.loads(path.read_text())
    names = check_trace_event_format(doc)
    assert "rank 5 · tp1 dp0 pp1 · local" in names.values()
    ranks = [n for n in names.values() if n.startswith("rank ")]
    assert len(ranks) == 8  # the 8 ranks of the traced group; the 2-rank group left no track
    (m,) = summarize(path).methods
    # One call names its slowest rank, but no straggler: that takes STRAGGLER_MIN_CALLS calls.
    assert (m.method, m.calls, m.slowest, m.straggler) == ("compute", 1, [SLOW_RANK], None)
    assert "too few calls to name a straggler (1 of the 3 needed)" in summarize(path).format()
    traced.compute(batch())  # after the block: recorded nowhere, and the file is unchanged
    assert json.loads(path.read_text()) == doc


def test_trace_env_variable_records_a_whole_program(tmp_path):
    """``RANKMESH_TRACE`` records the program's calls and writes at exit; building a group reads
    nothing (the program-wide slot is still unread then: its first call reads the variable)."""
    path = tmp_path / "env.json"
    script = textwrap.dedent(
        """
        import torch
        from rankmesh.backends.local import LocalWorkerGroup
        from rankmesh.data import DataProto
        from rankmesh.tracing import TRACING
        from tests.trace_workers import TracedWorker
        wg = LocalWorkerGroup(TracedWorker, world_size=2, init_kwargs={"slow_rank": -1})
        assert "recorder" not in vars(TRACING), "building a group installed a recorder"
        wg.consume(DataProto.from_dict({"x": torch.zeros(4, 2)}))
        assert TRACING.recorder is TRACING.env_recorder is not None
        """
    )
    env = {**os.environ, TRACE_ENV: str(path), "PYTHONPATH": f"{SRC}{os.pathsep}{SRC.parent}"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=SRC.parent, timeout=120)
    doc = json.loads(path.read_text())
    check_trace_event_format(doc)
    assert [c.method for c in summarize(path).methods] == ["consume"]


def _tracing_functions_run(call) -> set[str]:
    """Names (``file:function``) of every function under ``rankmesh/tracing`` that ``call()`` runs."""
    import rankmesh.tracing

    folder = Path(rankmesh.tracing.__file__).resolve().parent
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if Path(code.co_filename).resolve().parent == folder:
                ran.add(f"{Path(code.co_filename).name}:{code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return ran


def test_an_untraced_call_runs_no_tracing_code(tmp_path):
    """Off, a call reads its observer once and runs no function of ``rankmesh.tracing``
    (blocking, non-blocking, future fetched); the same probe sees the recorder run when on."""
    wg = LocalWorkerGroup(TracedWorker, RankMesh(tp=2, dp=2), init_kwargs={"slow_rank": -1})
    data = batch()

    def calls():
        wg.compute(data)
        wg.produce(data).get()
        wg.noop()

    calls()  # warm: the first call in a process reads RANKMESH_TRACE (unset here)
    assert TRACING.recorder is None
    assert _tracing_functions_run(calls) == set()
    with trace(tmp_path / "on.json"):
        ran = _tracing_functions_run(calls)
    assert {"recorder.py:begin", "recorder.py:phase", "recorder.py:received", "recorder.py:end"} <= ran


def test_recorder_is_the_observer_the_group_calls(tmp_path):
    from rankmesh.tracing import CallObserver, ObservedCall, Recorder

    recorder = Recorder(tmp_path / "r.json")
    assert isinstance(recorder, CallObserver)
    wg = LocalWorkerGroup(TracedWorker, world_size=2, init_kwargs={"slow_rank": -1})
    assert isinstance(recorder.begin(wg, "noop", True, (), {}), ObservedCall)


def bad_trace_paths(tmp_path: Path) -> dict[str, Path]:
    """Paths no trace can be written to, by the fragment their error must hold."""
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    return {"is a directory": tmp_path, "is a file, not a directory": tmp_path / "notes.txt" / "t.json"}


def test_a_bad_trace_path_is_refused_before_the_block_runs(tmp_path):
    from rankmesh.errors import TraceError

    wg = LocalWorkerGroup(TracedWorker, RankMesh(dp=2), init_kwargs={"slow_rank": -1})
    for fragment, path in bad_trace_paths(tmp_path).items():
        for tracing in (trace, wg.trace):
            ran = []
            with pytest.raises(TraceError) as info:
                with tracing(path):
                    ran.append(wg.noop())
            assert ran == [] and TRACING.recorder is None and wg._observer is None, (tracing, path)
            assert f"trace(path) {str(path)!r}" in str(info.value) and fragment in str(info.value), str(info.value)
    # A folder that does not exist yet is not a bad path: the trace makes it, as it always did.
    with trace(tmp_path / "new" / "deeper" / "t.json"):
        wg.noop()
    assert json.loads((tmp_path / "new" / "deeper" / "t.json").read_text())["traceEvents"]


def test_demo_trace_path_is_checked_before_the_demo_starts(tmp_path, capsys):
    """``rankmesh demo --trace PATH`` takes trace()'s check before anything starts (exit 2, one line)."""
    import argparse
    import time

    from rankmesh.demo_cli import add_arguments, checked_config
    from rankmesh.errors import UsageError

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for fragment, path in bad_trace_paths(tmp_path).items():
        with pytest.raises(UsageError, match=f"--trace {str(path)!r}.*{fragment}"):
            checked_config(parser.parse_args(["--trace", str(path)]))
        started = time.perf_counter()
        assert cli_main(["demo", "--trace", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("rankmesh demo: error: --trace") and fragment in err and "\n" not in err, err
        assert time.perf_counter() - started < 5  # no Ray start-up before the verdict
    with pytest.raises(UsageError, match="--json .*is a directory"):  # the other file the demo writes at the end
        checked_config(parser.parse_args(["--json", str(tmp_path)]))


def test_cli_summarize_and_plot(tmp_path, capsys):
    path = tmp_path / "cli.json"
    wg = LocalWorkerGroup(TracedWorker, RankMesh(tp=2, pp=2, dp=2))
    with trace(path):
        for _ in range(3):  # a straggler is named after STRAGGLER_MIN_CALLS calls
            wg.compute(batch())
    assert cli_main(["trace", "summarize", str(path)]) == 0
    assert "straggler: rank 5 (slowest in 3 of 3 calls)" in capsys.readouterr().out
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["straggler"] == SLOW_RANK
    png = tmp_path / "out.png"
    assert cli_main(["trace", "plot", str(path), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["trace", "summarize", str(tmp_path / "missing.json")]) == 2
    assert "no trace file" in capsys.readouterr().err


# ----- Ray: real worker processes, clocks measured, futures between groups ---------------------


@pytest.fixture(scope="module")
def ray_groups(ray_session):
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    trainer = RayWorkerGroup(
        RayResourcePool([8], use_gpu=False), RayClassWithInitArgs(TracedWorker), mesh=RankMesh(tp=2, pp=2, dp=2), name_prefix="trainer"
    )
    gen = RayWorkerGroup(
        RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(TracedWorker, slow_rank=-1), name_prefix="gen"
    )
    yield trainer, gen
    trainer.shutdown()
    gen.shutdown()


def test_ray_trace_is_valid_aligned_and_names_the_slowed_rank(ray_groups, tmp_path):
    trainer, gen = ray_groups
    path = tmp_path / "ray.json"
    data = batch(16)
    with trace(path) as rec:
        for _ in range(3):
            out = trainer.compute(data)
        future = gen.produce(data)  # non-blocking: a DataProtoFuture handed to the trainer
        trainer.consume(future)
    assert torch.equal(out.batch["x"], data.batch["x"])
    doc = json.loads(path.read_text())
    names = check_trace_event_format(doc)
    assert "rank 5 · tp1 dp0 pp1 · node 0" in names.values()
    assert names[(1, rec.groups[id(trainer)].pid)] == "trainer calls"
    # Every rank's worker-method span lies inside its call's window on the controller's clock.
    spans = spans_of(doc)
    calls = {s["args"]["call"]: s for s in spans if s.get("cat") == "call"}
    methods = [s for s in spans if s.get("cat") == "method"]
    assert len(methods) == 3 * 8 + 2 + 8  # compute x3, produce (gen's 2 ranks), consume
    for s in methods:
        call = calls[s["args"]["call"]]
        if s["name"] != "produce":  # non-blocking: its ranks run after it returned the future
            assert call["ts"] <= s["ts"] <= s["end"] <= call["end"], (s, call)
    # Offsets were measured (bounded from both sides), one per traced rank: trainer's 8, gen's 2.
    assert len(doc["otherData"]["rankmesh"]["clock_offsets_us"]) == 8 + 2
    # One flow arrow: from gen.produce to trainer.consume.
    flows = [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]
    assert sorted(e["ph"] for e in flows) == ["f", "s"]
    start, end = sorted(flows, key=lambda e: e["ph"], reverse=True)
    assert calls_by_ts(spans, start)["name"] == "produce" and calls_by_ts(spans, end)["name"] == "consume"
    received = [s for s in spans if s["name"] == "receive" and s["args"]["method"] == "compute"]
    assert {s["args"]["bytes"] for s in received} == {data.batch["x"].nbytes // 2}  # one dp half each
    m = next(m for m in summarize(path).methods if m.method == "compute")
    assert m.straggler == SLOW_RANK and m.slowest == [SLOW_RANK] * 3


def test_ray_non_blocking_chain_has_rank_spans_of_both_groups(ray_groups, tmp_path):
    """``gen.produce(blocking=False)`` -> ``trainer.consume(future)``: both calls' ranks are timed.

    The producer's ranks run after its controller slice ended (it returned the future); on the
    controller's clock each lies after the call was submitted and before the consumer, which
    needed its output, returned.  Then a blocking call on gen hands over a second non-blocking
    call's timings with its own output (no drain round).
    """
    trainer, gen = ray_groups
    path = tmp_path / "chain.json"
    data = batch(16)
    with trace(path) as rec:
        future = gen.produce(data)
        assert isinstance(future, DataProtoFuture)
        out = trainer.consume(future)
        gen.produce(data).get()
        assert gen.nap(0.0) == [0, 1]
        kept = [c for c in rec.calls if c.method == "produce"]
        # Both produce calls' timings came back with nap's outputs, before the trace is written.
        assert [sorted(r.rank for r in c.ranks) for c in kept] == [[0, 1], [0, 1]]
    assert torch.equal(out.batch["x"], data.batch["x"])
    doc = json.loads(path.read_text())
    check_trace_event_format(doc)
    spans = spans_of(doc)
    calls = sorted((s for s in spans if s.get("cat") == "call"), key=lambda s: s["ts"])
    assert [c["name"] for c in calls] == ["produce", "consume", "produce", "nap"]
    produce, consume = calls[0], calls[1]
    submitted = phases_of(spans, produce)["submit"]["ts"]
    gen_pid = rec.groups[id(gen)].pid
    made = [s for s in spans if s.get("cat") == "method" and s["args"]["call"] == produce["args"]["call"]]
    assert sorted((s["pid"], s["args"]["rank"]) for s in made) == [(gen_pid, 0), (gen_pid, 1)]
    for s in made:
        assert produce["end"] <= consume["end"] and submitted <= s["ts"] <= s["end"] <= consume["end"], (s, produce, consume)
    used = [s for s in spans if s.get("cat") == "method" and s["args"]["call"] == consume["args"]["call"]]
    assert len(used) == 8
    for s in used:
        assert consume["ts"] <= s["ts"] <= s["end"] <= consume["end"], (s, consume)
    # Each rank's receive holds its share's bytes: gen's dp halves; the trainer's ranks receive a future.
    gen_bytes = [s["args"]["bytes"] for s in spans if s["name"] == "receive" and s["args"]["call"] == produce["args"]["call"]]
    assert gen_bytes == [data.batch["x"].nbytes // 2] * 2
    # The flow arrow still links produce to consume.
    (end,) = [e for e in doc["traceEvents"] if e["ph"] == "f"]
    (start,) = [e for e in doc["traceEvents"] if e["ph"] == "s" and e["id"] == end["id"]]
    assert calls_by_ts(spans, start) == produce and calls_by_ts(spans, end) == consume
    m = next(m for m in summarize(path).methods if m.method == "produce")
    assert m.calls == 2 and sorted(m.rank_ms) == [0, 1]


def test_ray_kept_timings_reach_the_recorder_that_made_the_call(ray_groups, tmp_path):
    """A host hands every kept timing to whoever asks next: here a blocking call that another
    recorder (the group's own, ``wg.trace``) observes.  Each timing still lands in the call of
    the recorder that made it, and the other recorder's trace has only its own call."""
    _, gen = ray_groups
    data = batch(16)
    with trace(tmp_path / "program.json") as program:
        gen.produce(data).get()  # the program-wide recorder's call; its ranks keep the timings
        (produce,) = program.kept.values()
        with gen.trace(tmp_path / "group.json") as own:
            assert gen.nap(0.0) == [0, 1]  # hands them over with its outputs
        assert program.kept == {} and sorted(r.rank for r in produce.ranks) == [0, 1]
        assert [c.method for c in own.calls] == ["nap"] and own.kept == {}
    assert [m.method for m in summarize(tmp_path / "group.json").methods] == ["nap"]
    assert sorted(summarize(tmp_path / "program.json").methods[0].rank_ms) == [0, 1]


def test_ray_shutdown_drains_kept_timings_through_the_groups_recorder(ray_session, tmp_path):
    """A non-blocking traced call's ranks keep their timings; ``shutdown`` asks the group's own
    recorder (``wg.trace``) to collect them, and they land in that recorder's call alone: the
    program-wide recorder recording at the same time waits for nothing.  The trace keeps the
    group's start-up report (asked for on its first traced call)."""
    from rankmesh.backends.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    group = RayWorkerGroup(
        RayResourcePool([2], use_gpu=False), RayClassWithInitArgs(TracedWorker, slow_rank=-1), name_prefix="kept"
    )
    data = batch(16)
    path, program_path = tmp_path / "kept.json", tmp_path / "program.json"
    try:
        with trace(program_path) as program, group.trace(path) as rec:
            out = group.produce(data).get()  # outputs fetched; the timings stay on the ranks
            (call,) = rec.kept.values()
            assert call.method == "produce" and call.ranks == []
            assert program.kept == {} and program.calls == []
            group.shutdown()
            assert rec.kept == {} and sorted(r.rank for r in call.ranks) == [0, 1]
    finally:
        if not group.closed:
            group.shutdown()
    assert torch.equal(out.batch["x"], data.batch["x"])
    doc = json.loads(path.read_text())
    check_trace_event_format(doc)
    spans = spans_of(doc)
    (produce,) = [s for s in spans if s.get("cat") == "call"]
    made = [s for s in spans if s.get("cat") == "method" and s["args"]["call"] == produce["args"]["call"]]
    assert sorted(s["args"]["rank"] for s in made) == [0, 1]
    assert len(doc["otherData"]["rankmesh"]["clock_offsets_us"]) == 2  # bounded by the drain round
    (startup,) = doc["otherData"]["rankmesh"]["startups"]
    assert startup["group"] == "kept" and len(startup["ranks"]) == 2
    assert json.loads(program_path.read_text())["otherData"]["rankmesh"]["startups"] == []


def phases_of(spans: list[dict], call: dict) -> dict[str, dict]:
    """The controller phase slices inside ``call``, by name."""
    return {
        s["name"]: s for s in spans
        if s.get("cat") == "phase" and (s["pid"], s["tid"]) == (call["pid"], call["tid"]) and call["ts"] <= s["ts"] <= call["end"]
    }


@pytest.mark.parametrize("control", ["auto", "ray"])
def test_ray_fetch_phase_starts_when_the_last_rank_is_done(ray_groups, tmp_path, control):
    """``wait`` lasts until the slowed rank is done, ``fetch`` follows it, with the bytes fetched.

    Rank 0 (whose output carries the fetch mark) answers at once and rank 5 sleeps: if the
    mark were read when rank 0's output arrived, ``wait`` would be shorter than rank 5's sleep.
    Checked with a short sleep (one wait) and one past the polling slice (sliced wait), with
    ``nap`` (inline arguments) taking the call session (``auto``) or one Ray task per rank.
    """
    from rankmesh.backends.ray.waiting import POLL_INTERVAL

    trainer, _ = ray_groups
    path = tmp_path / "fetch.json"
    data = batch(16)
    naps = (SLOW_S, POLL_INTERVAL + 0.3)
    trainer.set_control(control)
    try:
        with trace(path):
            out = trainer.compute(data)
            for seconds in naps:
                assert trainer.nap(seconds) == list(range(8))
        assert trainer.transport_info()[5]["control"] == ("session" if control == "auto" else "ray")
    finally:
        trainer.set_control("auto")
    assert torch.equal(out.batch["x"], data.batch["x"])
    doc = json.loads(path.read_text())
    check_trace_event_format(doc)
    spans = spans_of(doc)
    calls = sorted((s for s in spans if s.get("cat") == "call"), key=lambda s: s["ts"])
    assert [c["name"] for c in calls] == ["compute", "nap", "nap"]
    for call, slept in zip(calls, (SLOW_S, *naps)):
        phases = phases_of(spans, call)
        assert list(phases) == ["split", "put", "submit", "wait", "fetch", "concat"], phases
        wait, fetch = phases["wait"], phases["fetch"]
        # The slowed rank started its sleep after submit began, so wait covers the rest of it.
        submit_us = phases["submit"]["end"] - phases["submit"]["ts"]
        assert wait["end"] - wait["ts"] >= slept * 1e6 - submit_us, (call["name"], wait, submit_us)
        assert wait["end"] == fetch["ts"] <= fetch["end"] <= phases["concat"]["ts"]
    # compute collects tp0 of the last stage in each dp replica: the whole batch comes back once.
    compute = phases_of(spans, calls[0])
    assert compute["fetch"]["args"]["bytes"] == data.batch["x"].nbytes
    assert compute["put"]["args"]["bytes"] == data.batch["x"].nbytes
    m = next(m for m in summarize(path).methods if m.method == "compute")
    assert list(m.phase_ms) == ["split", "put", "submit", "wait", "fetch", "concat"]
    assert m.phase_bytes == {"put": data.batch["x"].nbytes, "fetch": data.batch["x"].nbytes}
    assert "fetch" in summarize(path).format()
    # The picture draws every phase (each has its colour), fetch included.
    png = tmp_path / "fetch.png"
    assert cli_main(["trace", "plot", str(path), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def calls_by_ts(spans: list[dict], event: dict) -> dict:
    """The call slice on ``event``'s track that contains it."""
    (call,) = [
        s for s in spans
        if s.get("cat") == "call" and (s["pid"], s["tid"]) == (event["pid"], event["tid"]) and s["ts"] <= event["ts"] <= s["end"]
    ]
    return call


def test_startup_report_has_every_stage_per_rank_in_order(ray_groups):
    trainer, _ = ray_groups
    report = trainer.startup_report()
    assert report is not None and len(report.ranks) == 8
    assert report.controller["placed"] >= 0
    for stages in report.ranks:
        assert 0 <= stages["started"] <= stages["imported"] <= stages["initialized"], stages
    # Every rank runs on this machine: one clock, so the measured offsets are round-trip noise.
    assert all(abs(o) < 1.0 for o in report.clock_offsets_s)
    text = report.format()
    assert "initialized" in text and "(rank " in text
