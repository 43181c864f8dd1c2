"""The trace picture: one labelled time scale for every group, slow first calls cut, nothing clipped.

The traces here are written by hand in the trace-event form ``rankmesh.tracing.chrome`` writes
(no group runs, no Ray), so every expected value follows from the call lengths below, not from
the plot: a call of ``T`` ms has phases that add up to ``T`` and ranks whose method ran
``METHOD_SHARE * T``.  The figure is the one :func:`plot_trace` saves, read back from
``Figure.savefig``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from rankmesh.tracing.plot import plot_trace  # noqa: E402

#: Each phase's share of a call's length (they add up to 1).
PHASE_SHARES = {"split": 0.02, "put": 0.04, "submit": 0.04, "wait": 0.84, "fetch": 0.04, "concat": 0.02}
#: Each rank's worker-method time as a share of its call's length.
METHOD_SHARE = 0.7

#: Reference calls spread over 5-175 ms, an actor whose first call (2,500 ms) warms up.
REF_MS = [5.0, 20.0, 45.0, 80.0, 120.0, 175.0]
ACTOR_MS = [2500.0, 100.0, 90.0, 110.0, 100.0, 95.0, 105.0]


def _coords(tp: int, dp: int, pp: int) -> dict[str, int]:
    return {"tp": tp, "cp": 0, "ep": 0, "dp": dp, "pp": pp}


def write_trace(path: Path, groups: dict[str, tuple[dict[str, int], str, list[float]]]) -> Path:
    """A trace of ``{name: (mesh sizes, method, call lengths in ms)}``, calls one after another."""
    events: list[dict] = []
    meta: dict[str, dict] = {}
    now, call_id = 0.0, 0
    for pid, (name, (mesh, method, lengths)) in enumerate(groups.items(), start=2):
        tp, dp, pp = mesh.get("tp", 1), mesh.get("dp", 1), mesh.get("pp", 1)
        ranks = [{"rank": r, "coords": _coords(r % tp, (r // tp) % dp, r // (tp * dp)), "label": "", "node": "node 0"}
                 for r in range(tp * dp * pp)]
        meta[str(pid)] = {"name": name, "mesh": mesh, "ranks": ranks}
        for ms in lengths:
            call_id += 1
            start, us = now, ms * 1000
            events.append({"ph": "B", "pid": 1, "tid": pid, "name": method, "cat": "call", "ts": start,
                           "args": {"call": call_id, "group": name}})
            t = start
            for phase, share in PHASE_SHARES.items():
                events.append({"ph": "B", "pid": 1, "tid": pid, "name": phase, "cat": "phase", "ts": t})
                t += share * us
                events.append({"ph": "E", "pid": 1, "tid": pid, "name": phase, "cat": "phase", "ts": t})
            events.append({"ph": "E", "pid": 1, "tid": pid, "name": method, "cat": "call", "ts": start + us})
            for r in range(len(ranks)):
                args = {"call": call_id, "method": method, "rank": r}
                events.append({"ph": "B", "pid": pid, "tid": r, "name": method, "cat": "method", "ts": start, "args": args})
                events.append({"ph": "E", "pid": pid, "tid": r, "name": method, "cat": "method", "ts": start + METHOD_SHARE * us})
            now = start + us + 1000
    events.sort(key=lambda e: e["ts"])  # stable: a track's events stay in nesting order
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"rankmesh": {"groups": meta}}}))
    return path


def drawn(monkeypatch, tmp_path: Path, groups: dict) -> Figure:
    """The figure :func:`plot_trace` saves for a trace of ``groups``, laid out and drawn."""
    saved: list[Figure] = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    plot_trace(write_trace(tmp_path / "t.json", groups), tmp_path / "t.png")
    (fig,) = saved
    fig.draw(FigureCanvasAgg(fig).get_renderer())
    return fig


def phase_panels(fig: Figure) -> dict[str, object]:
    """The phases-of-each-call panel of each group, by group name."""
    return {ax.get_title().split(":")[0]: ax for ax in fig.axes if "phases of each call" in ax.get_title()}


def test_every_group_shares_one_labelled_time_scale(monkeypatch, tmp_path):
    fig = drawn(monkeypatch, tmp_path, {
        "ref": ({"tp": 2, "dp": 2, "pp": 2}, "compute_ref_log_prob", REF_MS),
        "actor": ({"tp": 2, "dp": 2, "pp": 2}, "update_actor", ACTOR_MS),
    })
    panels = phase_panels(fig)
    assert set(panels) == {"ref", "actor"}
    limits = {name: ax.get_xlim() for name, ax in panels.items()}
    assert limits["ref"] == limits["actor"], limits
    left, right = limits["ref"]
    assert left == 0
    # ref's longest call (175 ms) is inside the scale; actor's 2,500 ms warm-up is not what sets it.
    assert max(REF_MS) <= right < ACTOR_MS[0], right
    for name, ax in panels.items():
        assert "ms" in ax.get_xlabel(), (name, ax.get_xlabel())
        assert any(t.get_text() for t in ax.get_xticklabels()), f"{name}: the scale has no numbers"


def test_a_slow_first_call_does_not_flatten_the_others(monkeypatch, tmp_path):
    lengths = [5000.0] + [50.0] * 9  # a 100x first call, then nine alike
    fig = drawn(monkeypatch, tmp_path, {"actor": ({"tp": 1, "dp": 2, "pp": 1}, "update_actor", lengths)})
    (ax,) = phase_panels(fig).values()
    left, right = ax.get_xlim()
    median = statistics.median(lengths)  # 50 ms
    assert median / (right - left) >= 0.5, f"the median call fills {median / (right - left):.1%} of the axis"
    # The first call is drawn to the end of the axis, and says how long it really took.
    assert any("5,000 ms" in t.get_text() for t in ax.texts), [t.get_text() for t in ax.texts]
    first_row = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2) < 1e-9]
    assert max(p.get_x() + p.get_width() for p in first_row) == pytest.approx(right)


@pytest.mark.parametrize("tp", [1, 2])
def test_colour_bar_label_is_inside_the_figure_for_a_small_group(monkeypatch, tmp_path, tp):
    fig = drawn(monkeypatch, tmp_path, {"ref": ({"tp": tp, "dp": 1, "pp": 1}, "compute_ref_log_prob", REF_MS)})
    renderer = fig.canvas.get_renderer()
    labels = [a.get_label() for ax in fig.axes for a in (ax.xaxis, ax.yaxis) if a.get_label().get_text().startswith("worker method")]
    assert len(labels) == 1, [ax.get_label() for ax in fig.axes]
    box, page = labels[0].get_window_extent(renderer), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, (box, page)
