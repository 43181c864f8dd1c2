"""Draw a layout: ranks as boxes grouped by node, coloured by dp replica, tp groups outlined.

A picture makes the two mistakes that cost most visible at a glance: a tp group split over two
nodes (drawn as a red dashed line) and collect ranks that are not where you expected (starred).
matplotlib is imported lazily and only through its object API (``Figure``), so drawing never
switches the pyplot backend of a notebook that imported rankmesh.
"""

from __future__ import annotations

import logging
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rankmesh.errors import LayoutError
from rankmesh.layout import Layout, LayoutRole
from rankmesh.mesh import RankMesh

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes

log = logging.getLogger(__name__)

FORMATS = ("png", "svg", "pdf")
BOX_W, BOX_H, GAP = 1.0, 0.8, 0.2
NODE_PAD, NODE_GAP, LABEL_H = 0.25, 0.6, 0.5
NODES_PER_ROW = 4
LARGE_WORLD = 1024


@dataclass(frozen=True)
class _NodeBox:
    """Geometry of one node of a role panel, in data units."""

    x: float
    y: float  # top edge
    cols: int
    rows: int

    @property
    def width(self) -> float:
        return 2 * NODE_PAD + self.cols * BOX_W + (self.cols - 1) * GAP

    @property
    def height(self) -> float:
        return 2 * NODE_PAD + self.rows * BOX_H + (self.rows - 1) * GAP

    def cell(self, local: int) -> tuple[int, int]:
        return divmod(local, self.cols)

    def corner(self, row: int, col: int) -> tuple[float, float]:
        """Lower-left corner of the rank box at (row, col)."""
        x = self.x + NODE_PAD + col * (BOX_W + GAP)
        y = self.y - NODE_PAD - (row + 1) * BOX_H - row * GAP
        return x, y


def _columns(count: int) -> int:
    return count if count <= 4 else 4 if count <= 16 else 8


def _node_boxes(counts: Sequence[int]) -> tuple[list[_NodeBox], float, float]:
    """Node rectangles laid out left to right, NODES_PER_ROW per row; returns boxes, width, height."""
    boxes: list[_NodeBox] = []
    x = y = 0.0
    row_height = width = 0.0
    for i, count in enumerate(counts):
        if i and i % NODES_PER_ROW == 0:
            x, y = 0.0, y - row_height - NODE_GAP - LABEL_H
            row_height = 0.0
        cols = _columns(count)
        box = _NodeBox(x, y - LABEL_H, cols, math.ceil(count / cols))
        boxes.append(box)
        x += box.width + NODE_GAP
        width = max(width, x - NODE_GAP)
        row_height = max(row_height, box.height)
    return boxes, width, -(y - LABEL_H - row_height)


def _dp_colour(index: int, dp: int):
    from matplotlib import colormaps

    if dp <= 10:
        return colormaps["tab10"](index)
    if dp <= 20:
        return colormaps["tab20"](index)
    return colormaps["viridis"](index / max(dp - 1, 1))


def _mesh_label(mesh: RankMesh) -> str:
    s = mesh.sizes
    parts = [f"{a}{s[a]}" for a in ("tp", "cp", "ep", "dp", "pp") if s[a] > 1] or ["1 rank"]
    if s["ep"] > 1 and s["etp"] != s["tp"]:
        parts.append(f"etp{s['etp']}")
    return "·".join(parts)


def _draw_role(ax: "Axes", role: LayoutRole, names: Sequence[str] = ()) -> bool:
    """Draw one role's panel; returns whether some tp group crosses a node."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    mesh, placement = role.mesh(), role.placement()
    boxes, width, height = _node_boxes(role.pool.process_on_nodes)
    table = mesh.coord_table()
    collect = set(mesh.collect_ranks())
    dp = mesh.size("dp")
    detail = mesh.world_size <= 64
    centres: dict[int, tuple[float, float]] = {}
    cells: dict[int, tuple[int, int, int]] = {}

    for node, box in enumerate(boxes):
        ax.add_patch(
            FancyBboxPatch(
                (box.x, box.y - box.height), box.width, box.height,
                boxstyle="round,pad=0.02,rounding_size=0.15", facecolor="#f3f3f3", edgecolor="#888888", lw=1.0,
            )
        )
        ax.text(box.x + 0.05, box.y + 0.12, f"node {role.pool.nodes[node]}", fontsize=9, va="bottom", color="#333333")

    for rank in range(mesh.world_size):
        place = placement.place(rank)
        box = boxes[place.node]
        row, col = box.cell(place.local_rank)
        x, y = box.corner(row, col)
        cells[rank] = (place.node, row, col)
        centres[rank] = (x + BOX_W / 2, y + BOX_H / 2)
        ax.add_patch(Rectangle((x, y), BOX_W, BOX_H, facecolor=_dp_colour(int(table["dp"][rank]), dp), edgecolor="white", lw=0.8, alpha=0.9))
        label = f"{rank}"
        if detail:
            coords = mesh.rank_coords(rank).label()
            label += f"\n{coords}" if coords else ""
        ax.text(x + BOX_W / 2, y + BOX_H / 2, label, ha="center", va="center", fontsize=7 if detail else 5, color="black")
        if rank in collect:
            ax.plot(x + BOX_W - 0.12, y + BOX_H - 0.12, marker="*", ms=9, color="gold", mec="black", mew=0.6)

    crossing = False
    if mesh.size("tp") > 1:
        for group in mesh.groups("tp"):
            crossing |= _outline_group(ax, group, boxes, cells, centres)

    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-height - 0.3, 0.3)
    ax.set_aspect("equal")
    ax.set_anchor("W")
    ax.axis("off")
    pool = role.pool
    ax.set_title(
        f"{' + '.join(names or [role.name])}: {_mesh_label(mesh)} — pool {pool.name}, {mesh.world_size} ranks on {len(pool.nodes)} node(s)",
        fontsize=10, loc="left",
    )
    return crossing


def _outline_group(ax: "Axes", group: list[int], boxes, cells, centres) -> bool:
    """A rectangle round a tp group that fills a block of one node; else a dashed line through it."""
    from matplotlib.patches import Rectangle

    nodes = {cells[r][0] for r in group}
    spots = {(cells[r][1], cells[r][2]) for r in group}
    rows = [s[0] for s in spots]
    cols = [s[1] for s in spots]
    block = {(r, c) for r in range(min(rows), max(rows) + 1) for c in range(min(cols), max(cols) + 1)}
    if len(nodes) == 1 and spots == block:
        box = boxes[nodes.pop()]
        x0, y0 = box.corner(max(rows), min(cols))
        x1, y1 = box.corner(min(rows), max(cols))
        ax.add_patch(
            Rectangle((x0 - 0.06, y0 - 0.06), x1 - x0 + BOX_W + 0.12, y1 - y0 + BOX_H + 0.12, fill=False, edgecolor="black", lw=2.0)
        )
        return False
    crosses = len(nodes) > 1
    xs, ys = zip(*(centres[r] for r in group))
    ax.plot(xs, ys, ls="--", lw=1.6, color="red" if crosses else "black", alpha=0.8)
    return crosses


def _panels(layout: Layout, roles: Sequence[str]) -> list[list[str]]:
    """One panel per role, except that colocated roles with the same mesh share one panel."""
    for name in roles:
        layout.role(name)  # unknown names fail here, with the known ones listed
    group_of = {name: group for group in layout.colocation_groups() for name in group}
    panels: list[list[str]] = []
    for name in roles:
        mesh = layout.role(name).mesh()
        for panel in panels:
            if panel[0] in group_of[name] and layout.role(panel[0]).mesh() == mesh:
                panel.append(name)
                break
        else:
            panels.append([name])
    return panels


def draw_layout(layout: Layout, path: str | os.PathLike[str], roles: Sequence[str] | None = None) -> Path:
    """Draw the given roles (default: all) of ``layout``, one panel each, to a PNG/SVG/PDF file."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise LayoutError(f"{path}: cannot draw to {path.suffix or 'a file without suffix'!r}; use .png, .svg or .pdf")
    panels = _panels(layout, roles if roles is not None else list(layout.roles))
    selected = [layout.role(names[0]) for names in panels]
    meshes = [role.mesh() for role in selected]
    if max(m.world_size for m in meshes) > LARGE_WORLD:
        log.warning("drawing more than %d ranks: the picture will be dense", LARGE_WORLD)

    sizes = [_node_boxes(role.pool.process_on_nodes)[1:] for role in selected]
    width = max(w for w, _ in sizes)
    heights = [h + 0.8 for _, h in sizes]
    scale = 0.75
    fig = Figure(figsize=(max(width * scale + 3.2, 7.0), sum(heights) * scale + 1.2), layout="constrained")
    grid = fig.add_gridspec(len(selected), 1, height_ratios=heights)
    crossing = False
    for i, (role, names) in enumerate(zip(selected, panels)):
        crossing |= _draw_role(fig.add_subplot(grid[i, 0]), role, names)

    dp = max(m.size("dp") for m in meshes)
    handles: list = [Patch(facecolor=_dp_colour(d, dp), label=f"dp replica {d}") for d in range(min(dp, 8))]
    if dp > 8:
        handles.append(Patch(facecolor="white", label=f"… {dp} replicas"))
    handles.append(Patch(facecolor="none", edgecolor="black", lw=2.0, label="tp group"))
    handles.append(Line2D([], [], marker="*", ls="", ms=10, color="gold", mec="black", label="collect rank"))
    if crossing:
        handles.append(Line2D([], [], ls="--", color="red", label="tp group across nodes"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=True)
    title = f"layout {layout.name}"
    if layout.description:
        title += "\n" + textwrap.fill(layout.description, width=max(60, int(width * scale * 12)))
    fig.suptitle(title, fontsize=11, x=0.02, ha="left")
    fig.savefig(path, format=fmt, dpi=110, bbox_inches="tight")
    log.info("drew %s to %s", layout.name, path)
    return path
