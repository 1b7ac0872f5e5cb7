"""Training curves drawn from each stage's metrics.jsonl, as PNG images for the run report.

One image per stage that has training steps, `curves-<stage>.png`, with a panel per quantity:
loss (train, and held-out where the stage logged `eval_loss`) and, for the online RL stages,
the reward-model score and the KL to the SFT policy (rollout means, and held-out).

Pure library code, no Prefect. matplotlib is imported inside `plot_curves` and used through its
object API (`Figure` renders with Agg), never pyplot: no window can open, no global figure
registry grows in a long-lived flow process, and importing this module stays cheap.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Each panel is 4.5 x 3.5 inches at 100 dpi: a one-panel image is 450 x 350 pixels, and an image
# of n panels is n times as wide (tests check the size against these constants).
PANEL_INCHES = (4.5, 3.5)
DPI = 100


@dataclass(frozen=True)
class Series:
    """One line: `field` of the `kind` records (train or eval), plotted against their step."""

    kind: str
    field: str
    label: str


@dataclass(frozen=True)
class Panel:
    name: str
    ylabel: str
    series: tuple[Series, ...]


# Field names as the stages write them: sft/reward/dpo log `loss` per step and `eval_loss` on
# held-out data; ppo/grpo log `score_mean` and `kl` (mean sequence KL to the reference, which is
# the SFT policy) per rollout, and `eval_reward`/`eval_kl` on held-out prompts.
PANELS = (
    Panel(
        "loss",
        "loss",
        (Series("train", "loss", "train loss"), Series("eval", "eval_loss", "held-out loss")),
    ),
    Panel(
        "reward",
        "reward-model score",
        (
            Series("train", "score_mean", "rollout score (mean)"),
            Series("eval", "eval_reward", "held-out reward"),
        ),
    ),
    Panel(
        "kl",
        "KL to SFT policy (nats/response)",
        (Series("train", "kl", "rollout KL"), Series("eval", "eval_kl", "held-out KL")),
    ),
)


@dataclass(frozen=True)
class CurvePlot:
    """What `plot_curves` drew for one stage: the image, its panels and the fields plotted."""

    stage: str
    path: Path
    panels: tuple[str, ...]
    series: tuple[str, ...]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, by the rules of `posttrain.telemetry.metrics.read_metrics`:
    a torn last line (the writer was killed mid-line) is dropped, an unreadable line before it
    raises. Repeated here because that module imports torch at import time, and the flow
    process that draws the curves never loads torch (tests/test_cli.py)."""
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows: list[dict[str, Any]] = []
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n}: not a JSON record ({exc.msg})") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _finite(value: Any) -> float | None:
    # bool is an int subclass but never a curve value; NaN/inf (a diverged step) would break the
    # axis limits, so such a point is left out rather than drawn.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def series_points(
    records: Sequence[dict[str, Any]], kind: str, field: str
) -> tuple[list[float], list[float]]:
    """(steps, values) of one field, sorted by step, finite values only. A step logged twice
    keeps its last value: the later record supersedes the earlier one, and a line drawn through
    both would double back."""
    by_step: dict[float, float] = {}
    for r in records:
        if r.get("kind") != kind:
            continue
        step, value = _finite(r.get("step")), _finite(r.get(field))
        if step is not None and value is not None:
            by_step[step] = value
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _file_name(stage: str) -> str:
    # Stage names are identifiers today; anything else must not escape the output folder.
    return f"curves-{re.sub(r'[^A-Za-z0-9_.-]', '_', stage)}.png"


def plot_stage(stage: str, records: Sequence[dict[str, Any]], out_dir: Path) -> CurvePlot | None:
    """Draw `curves-<stage>.png` into `out_dir`; None (and no file) when the stage has no
    training step or no finite value to draw."""
    if not any(r.get("kind") == "train" for r in records):
        return None  # ingest, evaluate, export: nothing was trained, a curve would mislead
    drawn: list[tuple[Panel, list[tuple[Series, list[float], list[float]]]]] = []
    for panel in PANELS:
        lines = [(s, *series_points(records, s.kind, s.field)) for s in panel.series]
        lines = [(s, xs, ys) for s, xs, ys in lines if xs]
        if lines:
            drawn.append((panel, lines))
    if not drawn:
        return None

    from matplotlib.figure import Figure

    width, height = PANEL_INCHES
    fig = Figure(figsize=(width * len(drawn), height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(drawn), squeeze=False)[0]
    for ax, (panel, lines) in zip(axes, drawn, strict=True):
        for s, xs, ys in lines:
            # Held-out points are few (start, every eval_every, end): markers keep a lone point
            # visible, where a line of one point would draw nothing.
            marker = "o" if s.kind == "eval" or len(xs) == 1 else None
            ax.plot(xs, ys, label=s.label, marker=marker, markersize=3, linewidth=1.2)
        ax.set_title(f"{stage}: {panel.name}")
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / _file_name(stage)
    # Written beside and renamed, so a report never links a half-written image.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=DPI)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return CurvePlot(
        stage=stage,
        path=path,
        panels=tuple(p.name for p, _ in drawn),
        series=tuple(s.field for _, lines in drawn for s, _, _ in lines),
    )


def plot_curves(stages: Sequence[tuple[str, Path]], out_dir: Path) -> list[CurvePlot]:
    """Draw the curves of each (stage name, artifact folder) from its `metrics.jsonl` into
    `out_dir`, in the given order; stages without training steps get no image. Works the same for
    cached or reused stages, whose metrics.jsonl is still in their (immutable) artifact folder."""
    plots = []
    for stage, folder in stages:
        plot = plot_stage(stage, read_records(Path(folder) / "metrics.jsonl"), Path(out_dir))
        if plot is not None:
            plots.append(plot)
    return plots
