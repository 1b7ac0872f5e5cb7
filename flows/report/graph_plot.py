"""The run's stage graph as one PNG for the run report: which stage fed which, and how each ended.

`draw_stage_graph(records, path)` draws the run's `StageRecord`s (a stage a failed run did not
reach: `pending`) left to right, layered by the LONGEST path from the roots so every edge points
right and a stage sits just after its latest input; within a layer, one barycentre pass orders
nodes by their parents' mean row, which removes most crossings at this size. A box per stage
(coloured by status; name, kind, status, three headline metrics), an arrow per parent with its
roles written on it unless obvious, waypoint rows where an arrow skips layers (so it runs
between boxes), and a dashed stub for a parent absent from the run (a reused artifact).

No graph library (graphviz would need its system binary on every worker); matplotlib is
imported where it draws and used through its object API, as in `plots.py`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flows.report.plots import save_png
from flows.report.tables import StageRecord

if TYPE_CHECKING:  # matplotlib is imported where it draws (see the module docstring)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# The statuses in the words of the run's summary table (flows.report.tables.STATUSES: ran, reused,
# failed), and pending for the stages a failed run did not reach; the legend shows them all.
STATUS_COLOURS = {"ran": "#b7e1b0", "reused": "#b9d3ee", "failed": "#f4a6a6", "pending": "#fff3c4"}
STUB_COLOUR = "#ffffff"
# Roles every reader expects on an edge; anything else (reference, reward_model, evaluated...)
# is written on the arrow.
OBVIOUS_ROLES = frozenset({"base", "policy"})
MAX_METRICS = 3

# Layout in inches (the figure is drawn at DPI). A box is as tall as the most lines any box
# holds (`box_height`: the title, then kind, status and up to three metrics); rows are that
# plus a gap apart, layers a box and a gap. The figure ends MARGIN beyond what is drawn.
BOX_W, BOX_PAD, LINE_H = 2.3, 0.6, 0.13  # BOX_PAD: a box's title and padding; LINE_H: a line
COL_PITCH, ROW_GAP, MARGIN, LEGEND_H = 3.3, 0.4, 0.3, 0.3
MIN_WIDTH, DPI = 5.0, 100  # MIN_WIDTH: the legend's one row of five entries


# Inputs the image leaves out: every stage reads the base, and evaluate/export also read their
# policy's parent and held-out source; drawn, they hide the chain. A stage whose only input is
# the base keeps that edge.
IMPLIED_ROLES = ("base", "parent", "heldout")


def drawn_links(roles: Mapping[str, str]) -> dict[str, str]:
    """The inputs of a stage the image draws as edges: role -> parent stage name."""
    kept = {r: n for r, n in roles.items() if r not in IMPLIED_ROLES}
    return kept or {r: n for r, n in roles.items() if r == "base"}


def shown_status(record: StageRecord) -> str:
    """A stage stopped by its quality gate completed, but the run failed there: drawn failed."""
    return "failed" if record.error else record.status


def missing_parents(nodes: Sequence[StageRecord]) -> list[str]:
    """Parents named by some node's inputs but absent from `nodes`, in first-seen order."""
    names = {n.stage for n in nodes}
    out: list[str] = []
    for n in nodes:
        for parent in drawn_links(n.roles).values():
            if parent not in names and parent not in out:
                out.append(parent)
    return out


def _check(nodes: Sequence[StageRecord]) -> None:
    if not nodes:
        raise ValueError("stage graph: no nodes to draw")
    seen: set[str] = set()
    for n in nodes:
        if n.stage in seen:
            raise ValueError(f"stage graph: node {n.stage!r} appears twice")
        seen.add(n.stage)
        if shown_status(n) not in STATUS_COLOURS:
            known = ", ".join(STATUS_COLOURS)
            raise ValueError(
                f"stage graph: node {n.stage!r} has status {n.status!r}; known: {known}"
            )


def _parents(nodes: Sequence[StageRecord]) -> dict[str, list[str]]:
    """node name -> its distinct parents (stubs included, as roots), in input order."""
    out: dict[str, list[str]] = {stub: [] for stub in missing_parents(nodes)}
    for n in nodes:
        out[n.stage] = list(dict.fromkeys(drawn_links(n.roles).values()))
    return out


def layer_of(nodes: Sequence[StageRecord]) -> dict[str, int]:
    """Layer of every node and stub: the longest path from a root. ValueError on a cycle."""
    _check(nodes)
    parents = _parents(nodes)
    children: dict[str, list[str]] = {name: [] for name in parents}
    for child, ps in parents.items():
        for p in ps:
            children[p].append(child)
    # Kahn's algorithm: a node is placed once all its parents are; what is never placed is on
    # a cycle or downstream of one.
    waiting = {name: len(ps) for name, ps in parents.items()}
    layer = {name: 0 for name, k in waiting.items() if k == 0}
    ready = list(layer)
    while ready:
        name = ready.pop()
        for child in children[name]:
            layer[child] = max(layer.get(child, 0), layer[name] + 1)
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    stuck = [name for name in parents if name not in layer or waiting[name] > 0]
    if stuck:
        raise ValueError(f"stage graph has a cycle through {', '.join(sorted(stuck))}")
    # A stub is drawn just before its earliest child, not in layer 0: its edge then spans one
    # gap instead of crossing the whole graph.
    for stub in missing_parents(nodes):
        layer[stub] = min(layer[c] for c in children[stub]) - 1
    return layer


# A waypoint of an edge that skips layers: (parent, child, layer). It takes a row in each layer
# the edge crosses, so the edge runs between boxes instead of through them (the "dummy nodes"
# of Sugiyama-style layered drawing).
Waypoint = tuple[str, str, int]


def _columns(nodes: Sequence[StageRecord]) -> list[list[str | Waypoint]]:
    """Nodes, stubs and waypoints per layer, each layer in drawing order (top to bottom)."""
    layer = layer_of(nodes)
    parents = _parents(nodes)  # stubs first, then input order
    columns: list[list[str | Waypoint]] = [[] for _ in range(max(layer.values()) + 1)]
    # What each slot hangs from, for ordering: a node's parents, with an edge that skips
    # layers replaced by its waypoint in the layer just before the node.
    above: dict[str | Waypoint, list[str | Waypoint]] = {}
    for name, ps in parents.items():
        columns[layer[name]].append(name)
        above[name] = []
        for p in ps:
            prev: str | Waypoint = p
            for k in range(layer[p] + 1, layer[name]):
                wp = (p, name, k)
                columns[k].append(wp)
                above[wp] = [prev]
                prev = wp
            above[name].append(prev)
    # One barycentre pass, left to right: rows are centred per layer, as drawn (row i of n at
    # i - (n - 1) / 2), and a slot sorts by the mean row of what it hangs from, which sits in
    # the previous layer and is already placed. A stub (nothing above) goes to the top.
    row: dict[str | Waypoint, float] = {}
    for k, col in enumerate(columns):
        if k:
            mean = {s: sum(row[p] for p in above[s]) / len(above[s]) for s in col if above[s]}
            col.sort(key=lambda s: mean.get(s, -math.inf))  # stable: ties keep the input order
        for i, slot in enumerate(col):
            row[slot] = i - (len(col) - 1) / 2
    return columns


def layers(nodes: Sequence[StageRecord]) -> list[list[str]]:
    """Node names (stubs included) per layer, left to right, each layer top to bottom."""
    return [[s for s in col if isinstance(s, str)] for col in _columns(nodes)]


def _short(value: float) -> str:
    """A metric in at most ~7 characters: 0.812, 12.3, 1,234, 1.2e+07, nan."""
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    if v == int(v) and abs(v) < 1e6:
        return f"{int(v):,}"
    if 100 <= abs(v) < 1e6:
        return f"{v:,.0f}"
    if abs(v) >= 1e6 or abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.3g}"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _box_text(node: StageRecord) -> tuple[str, str]:
    """(title line, body lines) of a box."""
    title = _clip(node.stage, 24)
    lines = []
    if node.kind and node.kind != node.stage:
        lines.append(_clip(node.kind, 28))
    lines.append(shown_status(node))
    numbers = [(k, v) for k, v in node.summary.headline.items() if isinstance(v, int | float)]
    for key, value in numbers[:MAX_METRICS]:
        lines.append(f"{_clip(key, 18)} {_short(value)}")
    return title, "\n".join(lines)


def _edge_path(points: Sequence[tuple[float, float]]) -> tuple[list, list[int]]:
    """(vertices, codes) of a smooth edge through `points`, horizontal at each point (square on
    the box, straight through a waypoint's slot)."""
    from matplotlib.path import Path as MplPath

    verts, codes = [points[0]], [MplPath.MOVETO]
    for (xa, ya), (xb, yb) in zip(points[:-1], points[1:], strict=True):
        half = (xb - xa) / 2
        verts += [(xa + half, ya), (xb - half, yb), (xb, yb)]
        codes += [MplPath.CURVE4] * 3
    return verts, codes


@dataclass(frozen=True)
class GraphLayout:
    """What `draw_stage_graph` draws, in inches from the figure's bottom-left corner."""

    width: float
    height: float
    box_h: float
    centre: dict[str | Waypoint, tuple[float, float]]
    columns: list[list[str | Waypoint]]
    stubs: frozenset[str]
    legend: tuple[str, ...]


def box_height(nodes: Sequence[StageRecord]) -> float:
    """The height of every box: room for the most body lines any box has (a stub has one)."""
    lines = max(len(_box_text(n)[1].splitlines()) for n in nodes)
    return BOX_PAD + LINE_H * lines


def graph_layout(nodes: Sequence[StageRecord]) -> GraphLayout:
    """Layer k at x = k COL_PITCH, rows centred, `box_height` + ROW_GAP apart. The figure is
    sized to what is drawn (a waypoint row counts only its edge), MARGIN around, legend below."""
    columns = _columns(nodes)
    stubs = frozenset(missing_parents(nodes))
    box_h = box_height(nodes)
    pitch = box_h + ROW_GAP
    graph_w = (len(columns) - 1) * COL_PITCH + BOX_W
    width = max(MIN_WIDTH, 2 * MARGIN + graph_w)
    rows: dict[str | Waypoint, tuple[float, float]] = {}
    for k, col in enumerate(columns):
        x = (width - graph_w) / 2 + BOX_W / 2 + k * COL_PITCH
        for i, slot in enumerate(col):
            rows[slot] = (x, ((len(col) - 1) / 2 - i) * pitch)
    half = {slot: box_h / 2 if isinstance(slot, str) else 0.0 for slot in rows}
    top = max(y + half[slot] for slot, (_, y) in rows.items())
    bottom = min(y - half[slot] for slot, (_, y) in rows.items())
    lift = LEGEND_H + MARGIN - bottom
    return GraphLayout(
        width=width,
        height=LEGEND_H + 2 * MARGIN + top - bottom,
        box_h=box_h,
        centre={slot: (x, y + lift) for slot, (x, y) in rows.items()},
        columns=columns,
        stubs=stubs,
        legend=(*STATUS_COLOURS, *(["not in run"] if stubs else [])),
    )


def draw_stage_graph(nodes: Sequence[StageRecord], path: str | os.PathLike[str]) -> Path:
    """The stage graph of `nodes` as the PNG `path`. ValueError for no nodes, a duplicate
    name, an unknown status or a cycle."""
    return save_png(stage_graph_figure(nodes), Path(path))


def stage_graph_figure(nodes: Sequence[StageRecord]) -> Figure:
    """The figure `draw_stage_graph` saves (tests read its texts and legend)."""
    layout = graph_layout(nodes)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(layout.width, layout.height), dpi=DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, layout.width)
    ax.set_ylim(0, layout.height)
    ax.set_axis_off()
    by_name = {n.stage: n for n in nodes}
    for name, xy in layout.centre.items():
        if isinstance(name, str):  # a waypoint is drawn as part of its edge
            node = None if name in layout.stubs else by_name[name]
            _draw_box(ax, xy, name, node, layout.box_h)
    _draw_edges(ax, nodes, layout.columns, layout.centre, set(layout.stubs))
    _draw_legend(ax, layout.legend)
    return fig


def _draw_box(
    ax: Axes, xy: tuple[float, float], name: str, node: StageRecord | None, box_h: float
) -> None:
    """The box of stage `name` centred at `xy`; `node` None: the dashed stub of a parent."""
    from matplotlib.patches import FancyBboxPatch

    x, y = xy
    stub = node is None
    fill = STUB_COLOUR if node is None else STATUS_COLOURS[shown_status(node)]
    line = {"edgecolor": "#777777" if stub else "#333333", "linestyle": "--" if stub else "-"}
    corner = (x - BOX_W / 2, y - box_h / 2)
    style = "round,pad=0,rounding_size=0.08"
    ax.add_patch(
        FancyBboxPatch(corner, BOX_W, box_h, boxstyle=style, facecolor=fill, linewidth=1.0, **line)
    )
    title, body = (_clip(name, 24), "not in this run") if node is None else _box_text(node)
    top = y + box_h / 2 - 0.1
    ax.text(x, top, title, ha="center", va="top", fontsize=9, fontweight="bold")
    ax.text(x, top - 0.22, body, ha="center", va="top", fontsize=7.5, linespacing=1.25)


def _draw_edges(
    ax: Axes,
    nodes: Sequence[StageRecord],
    columns: Sequence[Sequence[str | Waypoint]],
    centre: Mapping[str | Waypoint, tuple[float, float]],
    stubs: set[str],
) -> None:
    """One edge per (parent, child) through its waypoints; its roles written on it (on the
    last waypoint, or halfway) unless all are obvious."""
    for child in nodes:
        roles: dict[str, list[str]] = {}
        for role, parent in drawn_links(child.roles).items():
            roles.setdefault(parent, []).append(role)
        for parent, rs in roles.items():
            waypoints = [s for col in columns for s in col if s[:2] == (parent, child.stage)]
            points = _edge_points(centre, parent, child.stage, waypoints)
            _draw_arrow(ax, points, dashed=parent in stubs)
            if not set(rs) <= OBVIOUS_ROLES:
                if waypoints:
                    at = centre[waypoints[-1]]
                else:
                    at = ((points[0][0] + points[1][0]) / 2, (points[0][1] + points[1][1]) / 2)
                _draw_roles(ax, at, rs)


def _edge_points(
    centre: Mapping[str | Waypoint, tuple[float, float]],
    parent: str,
    child: str,
    waypoints: Sequence[Waypoint],
) -> list[tuple[float, float]]:
    (x0, y0), (x1, y1) = centre[parent], centre[child]
    points = [(x0 + BOX_W / 2, y0)]
    for wp in waypoints:
        xw, yw = centre[wp]
        points += [(xw - BOX_W / 2, yw), (xw + BOX_W / 2, yw)]
    points.append((x1 - BOX_W / 2, y1))
    return points


def _draw_arrow(ax: Axes, points: Sequence[tuple[float, float]], dashed: bool) -> None:
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.path import Path as MplPath

    verts, codes = _edge_path(points)
    style = {"linestyle": "--" if dashed else "-", "color": "#555555", "linewidth": 1.0}
    ax.add_patch(
        FancyArrowPatch(path=MplPath(verts, codes), arrowstyle="-|>", mutation_scale=12, **style)
    )


def _draw_roles(ax: Axes, at: tuple[float, float], roles: Sequence[str]) -> None:
    label = {"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1}
    ax.text(
        *at, ", ".join(roles), ha="center", va="center", fontsize=7, color="#333333", bbox=label
    )


def _draw_legend(ax: Axes, labels: Sequence[str]) -> None:
    """One row below the graph: a swatch per status, and the stub's when one is drawn."""
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=STATUS_COLOURS[s], edgecolor="#333333", label=s)
        if s in STATUS_COLOURS
        else Patch(facecolor=STUB_COLOUR, edgecolor="#777777", linestyle="--", label=s)
        for s in labels
    ]
    where = {"loc": "lower center", "bbox_to_anchor": (0.5, 0.0), "fontsize": 7.5, "frameon": False}
    ax.legend(handles=handles, ncol=len(handles), handlelength=1.2, columnspacing=1.0, **where)
