"""Training curves drawn from each stage's metrics.jsonl, as PNG images for the run report.

One image per stage that has training steps, `curves-<stage>.png`, a panel per quantity the
stage logged. `curve_spec` decides what is drawn (tests read it), `curve_figure` draws it.
matplotlib is imported where it draws and used through its object API (`Figure` renders with
Agg), never pyplot: no window can open, no global figure registry grows in a long-lived flow
process, and importing this module stays cheap.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is imported where it draws (see the module docstring)
    from matplotlib.figure import Figure

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
    title: str = ""  # after the stage's name; empty: the panel's name


# Field names as the stages write them: every training stage logs `loss` per step and most
# `eval_loss` on held-out data; the pairwise stages (reward, dpo) log `accuracy` and `margin`
# per step (share of pairs ranked right, chosen minus rejected reward: the reward model's
# score, or DPO's implicit beta-scaled log-ratio) and `eval_accuracy`/`eval_margin`; ppo/grpo
# log `score_mean` (the rollout's mean reward), `reward_fn_<label>` per reward function and
# `kl` (mean sequence KL to the reference by the recipe's `kl.estimator`) per rollout, and
# `eval_reward`, `eval_reward_fn_<label>` and `eval_kl` on held-out prompts. The reward and KL
# panels are built per stage (`_reward_panels`, `kl_panel`): their labels say what the reward
# is, and which stage the KL is to by which estimator.
def _panel(
    name: str, ylabel: str, train: str, train_label: str, held_out: str, held_out_label: str
) -> Panel:
    return Panel(
        name,
        ylabel,
        (Series("train", train, train_label), Series("eval", held_out, held_out_label)),
    )


LOSS = _panel("loss", "loss", "loss", "train loss", "eval_loss", "held-out loss")
ACCURACY = _panel(
    "accuracy",
    "pairs ranked right (fraction)",
    "accuracy",
    "train batch accuracy",
    "eval_accuracy",
    "held-out accuracy",
)
MARGIN = _panel(
    "margin",
    "reward margin (chosen - rejected)",
    "margin",
    "train batch margin",
    "eval_margin",
    "held-out margin",
)
FUNCTION_PREFIX = "reward_fn_"


def _start(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The stage's (last) `start` record: what a launch said about itself."""
    return next((r for r in reversed(records) if r.get("kind") == "start"), {})


def kl_panel(records: Sequence[dict[str, Any]]) -> Panel:
    """The KL panel of an RL stage, labelled from its `start` record: the reference's stage
    and the recipe's estimator (`reference`, `kl_estimator`), e.g. "KL to dpo (k3)"."""
    start = _start(records)
    to = f"KL to {start['reference']}" if start.get("reference") else "KL to the reference"
    series = (Series("train", "kl", "rollout KL"), Series("eval", "eval_kl", "held-out KL"))
    if estimator := start.get("kl_estimator"):
        return Panel("kl", f"{to} ({estimator}, nats/response)", series, f"{to} ({estimator})")
    return Panel("kl", f"{to} (nats/response)", series, to)


def reward_source(records: Sequence[dict[str, Any]]) -> str:
    """What an RL stage's reward is (the y-label of its reward panel), from its `start` record
    or else its per-function fields."""
    start = _start(records)
    roles = str(start.get("roles", "")).split(",")
    funcs = bool(start.get("reward_functions")) or any(
        k.startswith(FUNCTION_PREFIX) for r in records if r.get("kind") == "train" for k in r
    )
    model = "reward" in roles
    if model and funcs:
        return "reward (reward model + functions, weighted sum)"
    if model:
        return "reward-model score"
    if funcs:
        return "reward (reward functions, weighted sum)"
    return "reward"


def _reward_panels(records: Sequence[dict[str, Any]]) -> tuple[Panel, ...]:
    """The combined reward the policy was trained on, and one curve per reward function."""
    source = reward_source(records)
    combined = _panel(
        "reward", source, "score_mean", "rollout mean", "eval_reward", "held-out mean"
    )
    trained = [k for r in records if r.get("kind") == "train" for k in r]
    series = []
    for x in dict.fromkeys(
        k.removeprefix(FUNCTION_PREFIX) for k in trained if k.startswith(FUNCTION_PREFIX)
    ):
        series.append(Series("train", FUNCTION_PREFIX + x, f"{x} (rollout)"))
        series.append(Series("eval", f"eval_{FUNCTION_PREFIX}{x}", f"{x} (held-out)"))
    per_function = Panel("reward functions", "each function's mean reward", tuple(series))
    return (combined, per_function)


@dataclass(frozen=True)
class Line:
    """A series with its points, as drawn."""

    series: Series
    steps: tuple[float, ...]
    values: tuple[float, ...]

    @property
    def marker(self) -> str | None:
        # A marker at every held-out evaluation (start, every eval_every, end), and on a lone
        # point, which a line alone would not draw.
        return "o" if self.series.kind == "eval" or len(self.steps) == 1 else None

    @property
    def linestyle(self) -> str:
        # Held-out evaluations are points: two (start and end) joined by a line would read as
        # a trend between them. Three or more get a dotted line through them, to follow.
        if self.series.kind == "eval":
            return ":" if len(self.steps) >= 3 else "none"
        return "-"


@dataclass(frozen=True)
class PanelSpec:
    """One panel as it will be drawn; x is the step, with integer ticks only."""

    name: str
    title: str
    ylabel: str
    lines: tuple[Line, ...]
    xlabel: str = "step"


@dataclass(frozen=True)
class CurvePlot:
    """What `plot_curves` drew for one stage."""

    stage: str
    path: Path
    panels: tuple[str, ...]
    series: tuple[str, ...]


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
    """(steps, values) of one field, sorted by step, finite values only; a step logged twice
    keeps its last value (a line through both would double back)."""
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


def curve_spec(stage: str, records: Sequence[dict[str, Any]]) -> tuple[PanelSpec, ...]:
    """The panels `plot_stage` draws: each quantity logged with a finite point, in a fixed
    order; none for a stage with no training step (a curve would mislead)."""
    if not any(r.get("kind") == "train" for r in records):
        return ()
    specs = []
    for panel in (LOSS, ACCURACY, MARGIN, *_reward_panels(records), kl_panel(records)):
        lines = [
            Line(s, *map(tuple, series_points(records, s.kind, s.field))) for s in panel.series
        ]
        lines = [line for line in lines if line.steps]
        if lines:
            specs.append(
                PanelSpec(
                    panel.name, f"{stage}: {panel.title or panel.name}", panel.ylabel, tuple(lines)
                )
            )
    return tuple(specs)


def curve_figure(panels: Sequence[PanelSpec]) -> Figure:
    """The figure of `panels`, side by side (not saved; tests read its axes)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    width, height = PANEL_INCHES
    fig = Figure(figsize=(width * len(panels), height), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=True):
        for line in panel.lines:
            style = {"marker": line.marker, "linestyle": line.linestyle, "linewidth": 1.2}
            style["markersize"] = 5 if line.series.kind == "eval" else 3
            ax.plot(line.steps, line.values, label=line.series.label, **style)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def plot_stage(stage: str, records: Sequence[dict[str, Any]], out_dir: Path) -> CurvePlot | None:
    """Draw `curves-<stage>.png` into `out_dir`; None (and no file) when there is nothing."""
    panels = curve_spec(stage, records)
    if not panels:
        return None
    path = save_png(curve_figure(panels), out_dir / _file_name(stage))
    return CurvePlot(
        stage=stage,
        path=path,
        panels=tuple(p.name for p in panels),
        series=tuple(line.series.field for p in panels for line in p.lines),
    )


def write_beside(dest: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` beside `dest`, renamed to it (parent folders created): a report never links
    half an image, a concurrent run never reads half a file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def save_png(fig: Figure, dest: Path) -> Path:
    return write_beside(dest, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))
