"""The stage graph image for the run report: layering, validation, and the PNG it writes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from flows.report.graph_plot import (
    BOX_PAD,
    BOX_W,
    COL_PITCH,
    DPI,
    LEGEND_H,
    LINE_H,
    MARGIN,
    MIN_WIDTH,
    ROW_GAP,
    STATUS_COLOURS,
    _short,
    box_height,
    draw_stage_graph,
    graph_layout,
    layer_of,
    layers,
    missing_parents,
    stage_graph_figure,
)
from flows.report.tables import STATUSES, StageRecord
from posttrain.store.summary import Summary

REPO = Path(__file__).resolve().parents[1]


def node(name: str, status: str = "ran", kind: str = "", **roles: str) -> StageRecord:
    return StageRecord(name, "f" * 16, status, 1.0, kind=kind or name, roles=roles)


def diamond() -> list[StageRecord]:
    # reward ‖ sft from one base, joined by dpo; listed out of order on purpose.
    return [
        node("dpo", policy="sft", reference="sft", reward_model="reward"),
        node("reward", base="ingest"),
        node("ingest", status="reused"),
        node("sft", base="ingest"),
    ]


def png_size(nodes: list[StageRecord]) -> tuple[int, int]:
    """(height, width) in pixels the image of `nodes` should have, from its layout."""
    layout = graph_layout(nodes)
    return round(layout.height * DPI), round(layout.width * DPI)


def full_height(rows_of_boxes: int, box_h: float) -> float:
    """The height of a graph whose tallest layer is `rows_of_boxes` boxes (no waypoint rows)."""
    return LEGEND_H + 2 * MARGIN + (rows_of_boxes - 1) * (box_h + ROW_GAP) + box_h


def colour_pixels(path: Path, hex_colour: str) -> int:
    """Pixels of `path` within 2/255 of `hex_colour` in every channel."""
    img = imread(path)[..., :3]  # float RGB in [0, 1]
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img - rgb) <= 2 / 255).all(axis=-1).sum())


def test_chain_layers_follow_the_edges_not_the_list_order() -> None:
    chain = [
        node("grpo", policy="dpo", reference="sft"),
        node("dpo", policy="sft", reference="sft"),
        node("sft", base="ingest"),
        node("ingest"),
    ]
    assert layers(chain) == [["ingest"], ["sft"], ["dpo"], ["grpo"]]


def test_diamond_layers_and_longest_path() -> None:
    assert layers(diamond()) == [["ingest"], ["reward", "sft"], ["dpo"]]
    # evaluate reads both dpo (layer 2) and sft (layer 1): it goes after the LATER one.
    graph = [*diamond(), node("evaluate", evaluated="dpo", reference="sft")]
    assert layer_of(graph) == {"ingest": 0, "reward": 1, "sft": 1, "dpo": 2, "evaluate": 3}


def test_a_layer_is_ordered_by_its_parents_rows() -> None:
    # b2 is listed first but hangs from a2, the lower of the two parents: it is drawn lower.
    graph = [
        node("root"),
        node("a1", base="root"),
        node("a2", base="root"),
        node("b2", policy="a2"),
        node("b1", policy="a1"),
    ]
    assert layers(graph) == [["root"], ["a1", "a2"], ["b1", "b2"]]


@pytest.mark.parametrize(
    "graph",
    [
        [node("a", policy="b"), node("b", policy="a")],
        [
            node("root"),
            node("a", base="root", policy="c"),
            node("b", policy="a"),
            node("c", policy="b"),
        ],  # fmt: skip
        [node("a", policy="a")],
    ],
    ids=["two", "three-behind-a-root", "self"],
)
def test_a_cycle_raises(graph: list[StageRecord], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cycle through a"):
        layers(graph)
    with pytest.raises(ValueError, match="cycle"):
        draw_stage_graph(graph, tmp_path / "g.png")
    assert not (tmp_path / "g.png").exists()


def test_bad_input_raises_naming_the_node() -> None:
    with pytest.raises(ValueError, match="no nodes"):
        layers([])
    with pytest.raises(ValueError, match="'sft' appears twice"):
        layers([node("sft"), node("sft")])
    with pytest.raises(ValueError, match=r"'sft' has status 'done'; known: ran, reused"):
        layers([node("sft", status="done")])


def test_png_is_written_sized_by_the_layout_and_coloured_by_status(tmp_path: Path) -> None:
    graph = [
        *diamond(),
        StageRecord(
            "evaluate",
            "e" * 16,
            "pending",
            0.0,
            kind="evaluate",
            roles={"evaluated": "dpo", "reward_model": "reward"},
            summary=Summary(
                headline={
                    "win_rate": 0.625,
                    "dpo_accuracy": 0.8125,
                    "tokens_per_s": 5123.4,
                    "extra": 1.0,
                }
            ),
        ),
    ]
    path = draw_stage_graph(graph, tmp_path / "report" / "graph.png")
    assert path == tmp_path / "report" / "graph.png"
    assert path.stat().st_size > 10_000
    # reward -> evaluate skips layer 2, so it takes a row there: the tallest layer has 2 rows.
    img = imread(path)
    assert img.shape[:2] == png_size(graph)
    assert sorted(p.name for p in path.parent.iterdir()) == ["graph.png"]  # no temp file left

    # The box of a stage is filled with its status colour: turning dpo from ran to failed
    # moves about one box of pixels (BOX_W x BOX_H inches) from green to red.
    box = BOX_W * box_height(graph) * DPI * DPI
    ran, failed = (
        colour_pixels(path, STATUS_COLOURS["ran"]),
        colour_pixels(path, STATUS_COLOURS["failed"]),
    )
    graph[0] = node("dpo", status="failed", policy="sft", reference="sft", reward_model="reward")
    draw_stage_graph(graph, path)
    assert colour_pixels(path, STATUS_COLOURS["failed"]) - failed > 0.8 * box
    assert ran - colour_pixels(path, STATUS_COLOURS["ran"]) > 0.8 * box


def test_missing_parent_is_a_stub_just_before_its_child(tmp_path: Path) -> None:
    graph = [
        node("ingest"),
        node("sft", base="ingest"),
        node("dpo", policy="sft"),
        node("evaluate", evaluated="dpo", reference="sft_from_last_week"),
    ]
    assert missing_parents(graph) == ["sft_from_last_week"]
    assert layers(graph) == [["ingest"], ["sft"], ["sft_from_last_week", "dpo"], ["evaluate"]]
    path = draw_stage_graph(graph, tmp_path / "graph.png")
    assert imread(path).shape[:2] == png_size(graph)
    assert graph_layout(graph).legend == ("ran", "reused", "failed", "pending", "not in run")


def test_fifteen_stages_with_repeated_kinds(tmp_path: Path) -> None:
    # Three sft stages feeding three dpo variants each judged by one evaluate: kinds repeat,
    # names do not.
    graph = [node("ingest", status="reused"), node("reward", base="ingest")]
    for i in range(3):
        graph.append(node(f"sft_{i}", kind="sft", base="ingest"))
        graph.append(node(f"dpo_{i}", kind="dpo", policy=f"sft_{i}", reference=f"sft_{i}"))
        graph.append(
            node(f"eval_{i}", kind="evaluate", evaluated=f"dpo_{i}", reward_model="reward")
        )
    graph += [node("gate", status="pending", a="eval_0", b="eval_1", c="eval_2")]
    graph += [node("export", status="pending", policy="gate")]
    graph += [node("card", status="pending", model="export"), node("push", status="failed")]
    assert len(graph) == 15
    cols = layers(graph)
    assert cols[1] == ["reward", "sft_0", "sft_1", "sft_2"]
    # reward -> eval_i skips the dpo layer: three waypoints there, so that layer has 6 rows.
    layout = graph_layout(graph)
    assert len(layout.columns) == len(cols) and max(len(c) for c in layout.columns) == 6
    path = draw_stage_graph(graph, tmp_path / "graph.png")
    assert imread(path).shape[:2] == png_size(graph)


def test_the_graph_speaks_the_tables_words_and_its_legend_has_every_status() -> None:
    # The run's summary table says ran / reused / failed (flows.report.tables.STATUSES); the graph
    # adds pending for the stages a failed run did not reach. Nothing else (no "cached").
    assert tuple(STATUS_COLOURS) == (*STATUSES, "pending")
    graph = [node("ingest", status="reused"), node("sft", status="ran", base="ingest")]
    fig = stage_graph_figure(graph)
    (ax,) = fig.axes
    texts = [t.get_text() for t in ax.texts]
    assert "reused" in texts[texts.index("ingest") + 1].splitlines()
    # Every status in the legend, used in this graph or not.
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [*STATUSES, "pending"]


def test_the_figure_is_sized_to_what_it_draws(tmp_path: Path) -> None:
    # Boxes are as tall as their text: one body line (a pending stage) makes a short box.
    chain = [node("ingest", status="pending"), node("sft", status="pending", base="ingest")]
    assert box_height(chain) == BOX_PAD + LINE_H
    layout = graph_layout(chain)
    assert layout.height == pytest.approx(full_height(1, layout.box_h))
    assert layout.width == max(MIN_WIDTH, 2 * MARGIN + COL_PITCH + BOX_W)
    # grpo -> export skips the evaluate layer: that layer's second row is only an edge. The
    # figure ends MARGIN below that edge, not below a box nobody drew.
    graph = [
        node("ingest"),
        node("sft", policy="ingest"),
        node("grpo", policy="sft"),
        node("evaluate", policy="grpo"),
        node("export", policy="grpo", evaluation="evaluate"),
    ]
    layout = graph_layout(graph)
    assert [len(c) for c in layout.columns] == [1, 1, 1, 2, 1]
    tall = full_height(2, layout.box_h)
    assert layout.height == pytest.approx(tall - layout.box_h / 2)
    boxes = [xy for slot, xy in layout.centre.items() if isinstance(slot, str)]
    edges = [xy for slot, xy in layout.centre.items() if not isinstance(slot, str)]
    top = max(y for _, y in boxes) + layout.box_h / 2
    bottom = min(y for _, y in edges)
    assert top == pytest.approx(layout.height - MARGIN)
    assert bottom == pytest.approx(LEGEND_H + MARGIN)
    path = draw_stage_graph(graph, tmp_path / "graph.png")
    assert imread(path).shape[:2] == png_size(graph)


@pytest.mark.parametrize(
    ("value", "text"),
    [(0.8125, "0.812"), (12.34, "12.3"), (5123.4, "5,123"), (3.0, "3"), (2e7, "2.0e+07"),
     (0.0004, "4.0e-04"), (float("nan"), "nan"), (-0.25, "-0.25")],
)  # fmt: skip
def test_headline_numbers_are_short(value: float, text: str) -> None:
    assert _short(value) == text


def test_importing_graph_plot_does_not_load_matplotlib() -> None:
    # The flow process imports report code eagerly; it should pay for matplotlib only when
    # it draws.
    code = (
        "import sys, flows.report.graph_plot; "
        "heavy = [m for m in ('torch', 'matplotlib') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
