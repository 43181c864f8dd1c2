"""Picture of a trace: ranks laid out by mesh coordinates, coloured by worker-method time, and phases per call.

One row of panels per worker group.  Left: the group's ranks as boxes, a pipeline stage per row
and, along it, dp replicas side by side with their tp (and cp) ranks inside, as ``layout draw``
groups them; each box is coloured by the rank's median worker-method time over the group's
calls, on one colour scale for the whole figure (the colour bar under the boxes; each panel's
title prints its own range), so a straggler is the one bright box.  Right: one horizontal bar
per call (latest :data:`MAX_CALLS`), split into the controller's phases, with a thin black bar
inside ``wait`` for the slowest rank's own method: how much of the wait the ranks' work
explains.  The legend sits beside the bars.

Every group's bars share one time axis (ms), as the boxes share one colour scale: the same
length is the same time in every panel, so which group holds a step back reads at a glance.
The axis ends at the longest call that is within :data:`OFF_SCALE` times its own group's median
call.  A longer call (a first call that compiles, loads weights or builds process groups: 5 s
against 50 ms for the rest) would otherwise squash every other bar into a sliver; it is drawn
cut at the axis end, with its true length written over the cut, and its panel's title counts
the cut calls.  matplotlib is imported only when drawing, through its object API
(``Figure``), so drawing never switches a notebook's backend.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from pathlib import Path
from types import MappingProxyType
from typing import Any

from rankmesh.errors import RankMeshError
from rankmesh.tracing.recorder import PHASES
from rankmesh.tracing.summary import CallRecord, calls_of, load_trace

MAX_CALLS = 40
PHASE_COLOURS = MappingProxyType({"split": "#8dd3c7", "put": "#80b1d3", "submit": "#bebada", "wait": "#fb8072",
                                  "fetch": "#b3de69", "concat": "#fdb462"})
#: A call longer than this many times its group's median call is cut at the end of the time
#: axis.  A warm-up call runs 25-100x the steady ones (2.5 s against 100 ms, 5 s against 50 ms);
#: a group's ordinary spread (a 5 ms and a 175 ms method, a teardown at 9x the median) stays on
#: the scale.
OFF_SCALE = 10
#: Room past the longest call on the scale, as a share of it: the cut bars reach into it, so a
#: cut call never looks like the longest uncut one.
AXIS_MARGIN = 0.08


def _cell(coords: dict[str, int], mesh: dict[str, int]) -> tuple[int, int]:
    """(column, row) of a rank: row = pp stage; column = dp replica block, then cp, then tp."""
    tp, cp = mesh.get("tp", 1), mesh.get("cp", 1)
    inner = coords.get("cp", 0) * tp + coords.get("tp", 0)
    return coords.get("dp", 0) * (tp * cp + 1) + inner, coords.get("pp", 0)


def _median_method_ms(calls: list[Any]) -> dict[int, float]:
    """Per rank, the median of its worker-method time (ms) over ``calls``."""
    per_rank: dict[int, list[float]] = defaultdict(list)
    for c in calls:
        for rank, us in c.method_us.items():
            per_rank[rank].append(us / 1000)
    return {r: statistics.median(v) for r, v in per_rank.items()}


def _length_ms(call: CallRecord) -> float:
    """The length of a call's bar: its controller phases, end to end (ms)."""
    return sum(call.phases.get(p, 0.0) for p in PHASES) / 1000


def _time_axis_end(shown: dict[str, list[CallRecord]]) -> float:
    """The end (ms) of the time axis every group's bars share: the longest call within
    :data:`OFF_SCALE` times its group's median call, plus :data:`AXIS_MARGIN`.  The median is
    each group's own, so a group whose every call is slow sets the scale rather than being cut."""
    end = 0.0
    for calls in shown.values():
        lengths = [ms for ms in map(_length_ms, calls) if ms > 0]
        if lengths:
            limit = OFF_SCALE * statistics.median(lengths)
            end = max(end, max(ms for ms in lengths if ms <= limit))
    return max(end, 1e-3) * (1 + AXIS_MARGIN)


def _draw_calls(ax: Any, calls: list[CallRecord], end: float) -> int:
    """One bar per call, phases left to right, cut at ``end`` (ms); returns how many were cut."""
    cut = 0
    for i, c in enumerate(calls):
        left = 0.0
        for phase in PHASES:
            dur = c.phases.get(phase, 0.0) / 1000
            if dur > 0 and left < end:
                ax.barh(i, min(dur, end - left), left=left, color=PHASE_COLOURS[phase])
                if phase == "wait" and c.method_us:
                    # How much of the wait the slowest rank's own method explains (the rest:
                    # getting the call to the ranks and the outputs back).
                    ax.barh(i, min(max(c.method_us.values()) / 1000, dur, end - left), left=left, height=0.25, color="black")
            left += dur
        if left > end:  # the label covers the cut end of the bar: the break mark and the true length
            cut += 1
            ax.text(end, i, f" ≫ {left:,.0f} ms ", ha="right", va="center", fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0})
    return cut


def plot_trace(trace_path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Draw the trace at ``trace_path`` to ``out`` (.png, .svg or .pdf); returns the output path."""
    import matplotlib  # noqa: PLC0415 - matplotlib is heavy and optional
    from matplotlib import cm, colors  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.patches import Patch, Rectangle  # noqa: PLC0415

    doc = load_trace(trace_path)
    groups = doc.get("otherData", {}).get("rankmesh", {}).get("groups", {})
    calls = calls_of(doc)
    if not groups or not calls:
        raise RankMeshError(f"{os.fspath(trace_path)} has no rankmesh group calls to draw")
    by_group: dict[str, list[CallRecord]] = defaultdict(list)
    for c in calls:
        by_group[c.group].append(c)
    names = [g["name"] for g in groups.values() if g["name"] in by_group]
    medians = {name: _median_method_ms(by_group[name]) for name in names}
    # One colour scale for the whole figure: the same colour means the same time in every panel.
    every = [ms for m in medians.values() for ms in m.values()]
    norm = colors.Normalize(vmin=min(every, default=0.0), vmax=max(max(every, default=1.0), 1e-6))
    cmap = matplotlib.colormaps["viridis"]
    shown = {name: by_group[name][-MAX_CALLS:] for name in names}
    end = _time_axis_end(shown)
    fig = Figure(figsize=(13, 3.2 * len(names) + 1.2), layout="constrained")
    axes = fig.subplots(len(names), 2, squeeze=False, width_ratios=[1, 1.3])
    for (ax_mesh, ax_calls), name in zip(axes, names):
        group = next(g for g in groups.values() if g["name"] == name)
        median = medians[name]
        width = height = 0
        for info in group["ranks"]:
            col, row = _cell(info["coords"], group["mesh"])
            ms = median.get(info["rank"])
            face = "#dddddd" if ms is None else cmap(norm(ms))
            ax_mesh.add_patch(Rectangle((col, -row), 0.92, 0.85, facecolor=face, edgecolor="black", linewidth=0.6))
            text = f"r{info['rank']}" + ("" if ms is None else f"\n{ms:.1f} ms")
            dark = ms is not None and norm(ms) < 0.6
            ax_mesh.text(col + 0.46, -row + 0.42, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
            width, height = max(width, col + 1), max(height, row + 1)
        ax_mesh.set_xlim(-0.1, width + 0.1)
        ax_mesh.set_ylim(-height + 0.9, 0.95)
        ax_mesh.set_aspect("equal")
        ax_mesh.set_xticks([])
        ax_mesh.set_yticks([-r + 0.42 for r in range(height)], [f"pp{r}" for r in range(height)])
        sizes = " ".join(f"{k}{v}" for k, v in group["mesh"].items() if v > 1) or "1 rank"
        spread = f"{min(median.values()):.1f}–{max(median.values()):.1f} ms" if median else "no rank timings"
        ax_mesh.set_title(f"{name} · {sizes}: worker method, median {spread}\n(dp replicas left to right)", fontsize=9)
        cut = _draw_calls(ax_calls, shown[name], end)
        ax_calls.set_xlim(0, end)
        ax_calls.set_yticks(range(len(shown[name])), [f"{c.method} #{c.id}" for c in shown[name]], fontsize=7)
        ax_calls.invert_yaxis()
        ax_calls.set_xlabel("controller time per call, ms (one scale for every group)")
        note = f"\n{cut} of {len(shown[name])} calls over {OFF_SCALE}x the group's median: cut, true length written" if cut else ""
        ax_calls.set_title(f"{name}: phases of each call{note}", fontsize=9)
        # Every phase, drawn or not (a cut bar may stop before its last phases); beside the bars, never over them.
        legend = [Patch(color=PHASE_COLOURS[p], label=p) for p in PHASES]
        if any(c.method_us for c in shown[name]):
            legend.append(Patch(color="black", label="slowest rank's method"))
        ax_calls.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    # Under the boxes, not beside them: its length is the column's width, so the label fits
    # however few groups (and so however short a figure) there are.
    bar = fig.colorbar(cm.ScalarMappable(norm=norm, cmap=cmap), ax=list(axes[:, 0]), location="bottom",
                       shrink=0.8, aspect=40)
    bar.set_label("worker method, median ms (one scale for every group)", fontsize=9)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
