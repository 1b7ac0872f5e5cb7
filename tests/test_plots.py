"""Training curves for the run report: PNGs drawn from hand-written metrics.jsonl files."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from flows.report.images import curves
from flows.report.plots import (
    DPI,
    PANEL_INCHES,
    CurvePlot,
    curve_figure,
    curve_spec,
    series_points,
)
from flows.report.tables import curves_markdown
from posttrain.telemetry.records import read_metrics


def plot_curves(stages: list[tuple[str, Path]], out: Path) -> list[CurvePlot]:
    """The report's curves (`flows.report.images.curves`), through a cache beside `out`."""
    return curves(stages, out, out.parent / f"{out.name}-cache")[0]


REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_metrics(folder: Path, records: list[dict[str, Any]], torn: str = "") -> Path:
    """metrics.jsonl as MetricsWriter writes it (json.dumps: NaN as a bare `NaN` token), plus an
    optional torn last line, as left by a writer killed mid-line."""
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + torn
    (folder / "metrics.jsonl").write_text(text)
    return folder


def _sft_records() -> list[dict[str, Any]]:
    return [
        {"kind": "start", "total_steps": 5, "world_size": 1},
        {"kind": "eval", "step": 0, "eval_loss": 4.0},
        {"kind": "train", "step": 1, "loss": 3.5, "lr": 0.01, "tokens_per_s": 900.0},
        {"kind": "train", "step": 2, "loss": float("nan"), "lr": 0.01, "tokens_per_s": 900.0},
        {"kind": "train", "step": 3, "loss": 2.5, "lr": 0.01, "tokens_per_s": 900.0},
        {"kind": "train", "step": 4, "loss": float("inf"), "lr": 0.01, "tokens_per_s": 900.0},
        {"kind": "train", "step": 5, "loss": 1.5, "lr": 0.01, "tokens_per_s": 900.0},
        {"kind": "eval", "step": 5, "eval_loss": 2.0},
        {"kind": "end", "step": 5, "mem_rss_gib": 0.5},
    ]


def _rl_records() -> list[dict[str, Any]]:
    # Field names as the online-RL stage writes them (posttrain/rl/setup.py, metrics.py,
    # heldout.py): the start record names the KL's estimator and the reference's stage.
    rows: list[dict[str, Any]] = [
        {"kind": "start", "total_steps": 4, "kl_estimator": "k1", "reference": "sft"}
    ]
    for step in range(1, 5):
        rows.append(
            {
                "kind": "train",
                "step": step,
                "loss": 0.1 * step,
                "score_mean": float(step),
                "score_std": 1.0,
                "kl": 0.5 * step,
                "kl_coef": 0.05,
            }
        )
    rows += [
        {"kind": "eval", "step": 4, "sft_reward": 0.2, "sft_prompts": 16.0},
        {"kind": "eval", "step": 4, "eval_reward": 3.0, "eval_kl": 1.5, "eval_reward_gain": 2.8},
        {"kind": "end", "step": 4},
    ]
    return rows


def _assert_png(path: Path, panels: int) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    width, height = PANEL_INCHES
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == (round(width * DPI * panels), round(height * DPI))
        img.load()  # decodes every pixel: a truncated file fails here


def test_sft_curves_skip_nan_and_torn_line_and_stages_without_training(tmp_path: Path) -> None:
    sft = _write_metrics(tmp_path / "sft", _sft_records(), torn='{"kind": "train", "step": 6, "lo')
    ingest = _write_metrics(tmp_path / "ingest", [{"kind": "start"}, {"kind": "end"}])
    evaluate = tmp_path / "evaluate"
    evaluate.mkdir()
    (evaluate / "metrics.jsonl").write_text("")  # empty file
    export = tmp_path / "export"  # no metrics.jsonl at all
    out = tmp_path / "run"

    plots = plot_curves(
        [("ingest", ingest), ("sft", sft), ("evaluate", evaluate), ("export", export)], out
    )

    assert [p.stage for p in plots] == ["sft"]
    (plot,) = plots
    assert plot.path == out / "curves-sft.png"
    assert plot.panels == ("loss",)
    assert plot.series == ("loss", "eval_loss")
    _assert_png(plot.path, panels=1)
    # Only the one image: no file for stages without training steps, no temp file left behind.
    assert sorted(p.name for p in out.iterdir()) == ["curves-sft.png"]


def test_points_are_finite_sorted_and_the_torn_line_is_dropped(tmp_path: Path) -> None:
    folder = _write_metrics(tmp_path, _sft_records(), torn='{"kind": "train", "step": 6, "lo')
    records = read_metrics(folder / "metrics.jsonl")
    assert len(records) == len(_sft_records())
    assert series_points(records, "train", "loss") == ([1.0, 3.0, 5.0], [3.5, 2.5, 1.5])
    assert series_points(records, "eval", "eval_loss") == ([0.0, 5.0], [4.0, 2.0])
    assert series_points(records, "train", "score_mean") == ([], [])
    # A step logged twice keeps its last value, and points come out in step order.
    rows = [
        {"kind": "train", "step": 2, "loss": 9.0},
        {"kind": "train", "step": 1, "loss": 1.0},
        {"kind": "train", "step": 2, "loss": 2.0},
        {"kind": "train", "step": "3", "loss": 3.0},  # not a number: left out
        {"kind": "train", "step": 4, "loss": True},
    ]
    assert series_points(rows, "train", "loss") == ([1.0, 2.0], [1.0, 2.0])


def test_online_rl_stage_gets_reward_and_kl_panels(tmp_path: Path) -> None:
    ppo = _write_metrics(tmp_path / "ppo", _rl_records())
    (plot,) = plot_curves([("ppo", ppo)], tmp_path / "run")
    assert plot.panels == ("loss", "reward", "kl")
    assert plot.series == ("loss", "score_mean", "eval_reward", "kl", "eval_kl")
    _assert_png(plot.path, panels=3)


def _grpo_records(
    roles: str, functions: tuple[str, ...], evals: tuple[int, ...] = (3,)
) -> list[dict[str, Any]]:
    """A GRPO stage's records as posttrain.rl writes them: the start record names the scoring
    roles, the reward functions, the KL's estimator and the reference's stage (a DPO policy
    here: SFT -> DPO -> GRPO); each step and held-out record (at `evals`) carries each
    function's mean (`reward_fn_<label>`, `eval_reward_fn_<label>`) beside the combined
    `score_mean`."""
    start = {"kind": "start", "total_steps": 3, "roles": roles}
    start |= {"reward_functions": ",".join(functions), "kl_estimator": "k3", "reference": "dpo"}
    rows: list[dict[str, Any]] = [start]
    for step in (1, 2, 3):
        per = {f"reward_fn_{f}": 0.1 * step * (i + 1) for i, f in enumerate(functions)}
        rows.append(
            {"kind": "train", "step": step, "loss": 0.0, "score_mean": 0.3 * step, "kl": 0.01} | per
        )
    per = {f"eval_reward_fn_{f}": 0.5 for f in functions}
    for step in evals:
        rows += [{"kind": "eval", "step": step, "eval_reward": 0.8, "eval_kl": 0.02} | per]
    return rows


def _legend(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_grpo_with_reward_functions_says_so_and_draws_one_curve_per_function(
    tmp_path: Path,
) -> None:
    records = _grpo_records("policy,reference", ("exact_match", "format"))
    spec = curve_spec("grpo", records)
    assert [p.name for p in spec] == ["loss", "reward", "reward functions", "kl"]
    reward, functions = spec[1], spec[2]
    # No reward model scored these rollouts: the axis says what was plotted.
    assert reward.ylabel == "reward (reward functions, weighted sum)"
    assert [line.series.label for line in reward.lines] == ["rollout mean", "held-out mean"]
    assert [(line.series.field, line.values) for line in functions.lines] == [
        ("reward_fn_exact_match", (0.1, 0.2, 0.30000000000000004)),
        ("eval_reward_fn_exact_match", (0.5,)),
        ("reward_fn_format", (0.2, 0.4, 0.6000000000000001)),
        ("eval_reward_fn_format", (0.5,)),
    ]
    fig = curve_figure(spec)
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes][1:3] == [
        "reward (reward functions, weighted sum)",
        "each function's mean reward",
    ]
    assert _legend(axes[2]) == [
        "exact_match (rollout)",
        "exact_match (held-out)",
        "format (rollout)",
        "format (held-out)",
    ]
    # Three steps: the ticks are whole steps, never 1.5 or 2.5.
    fig.canvas.draw()  # type: ignore[attr-defined]
    for ax in axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
    (plot,) = plot_curves([("grpo", _write_metrics(tmp_path / "grpo", records))], tmp_path / "run")
    assert plot.panels == ("loss", "reward", "reward functions", "kl")
    _assert_png(plot.path, panels=4)


def test_the_kl_panel_names_the_reference_s_stage_and_the_estimator() -> None:
    spec = curve_spec("grpo", _grpo_records("policy,reference,reward", ()))
    kl = spec[-1]
    assert (kl.name, kl.title, kl.ylabel) == (
        "kl",
        "grpo: KL to dpo (k3)",
        "KL to dpo (k3, nats/response)",
    )
    ax = curve_figure(spec).axes[-1]
    assert ax.get_title() == "grpo: KL to dpo (k3)"
    assert ax.get_ylabel() == "KL to dpo (k3, nats/response)"
    # Records without those fields (a stage that did not write them) say only what is known.
    bare = [r for r in _rl_records() if r["kind"] != "start"]
    assert (curve_spec("ppo", bare)[-1].title, curve_spec("ppo", bare)[-1].ylabel) == (
        "ppo: KL to the reference",
        "KL to the reference (nats/response)",
    )


@pytest.mark.parametrize(("evals", "linestyle"), [((0, 3), "None"), ((0, 1, 2, 3), ":")])
def test_held_out_series_are_points_at_every_evaluation(
    evals: tuple[int, ...], linestyle: str
) -> None:
    """Two evaluations (start and end) are two points, not a line that reads as a trend; with
    eval_every, a point at each evaluation, three or more joined by a dotted line."""
    spec = curve_spec("grpo", _grpo_records("policy,reference", ("exact",), evals))
    fig = curve_figure(spec)
    held_out = 0
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if "held-out" in label:
                held_out += 1
                assert tuple(line.get_xdata()) == evals, label
                assert line.get_marker() not in ("None", "", None), label
                assert line.get_linestyle() == linestyle, label
            else:  # a training curve: a line through every step, no markers
                assert line.get_linestyle() == "-" and line.get_marker() == "None", label
    assert held_out == 3  # the reward, the function's and the KL held-out series


@pytest.mark.parametrize(
    ("roles", "functions", "label", "panels"),
    [
        ("policy,reference,reward,value", (), "reward-model score", ["loss", "reward", "kl"]),
        (
            "policy,reference,reward",
            ("exact_match",),
            "reward (reward model + functions, weighted sum)",
            ["loss", "reward", "reward functions", "kl"],
        ),
    ],
    ids=["reward-model", "both"],
)
def test_the_reward_axis_names_what_scored_the_rollouts(
    roles: str, functions: tuple[str, ...], label: str, panels: list[str]
) -> None:
    spec = curve_spec("rl", _grpo_records(roles, functions))
    assert [p.name for p in spec] == panels
    assert spec[1].ylabel == label


def test_dpo_gets_accuracy_and_margin_curves(tmp_path: Path) -> None:
    # Field names as the dpo stage writes them (tests/test_preference_stages.py runs it).
    rows: list[dict[str, Any]] = [{"kind": "start", "total_steps": 4}]
    rows += [
        {"kind": "eval", "step": 0, "eval_accuracy": 0.0, "eval_margin": 0.0, "eval_loss": 0.69}
    ]
    for step in range(1, 5):
        rows.append(
            {"kind": "train", "step": step, "loss": 0.7 - 0.05 * step, "accuracy": 0.25 * step}
            | {"margin": 0.1 * step, "chosen_reward": 0.05 * step, "rejected_reward": 0.0}
        )
    rows += [
        {"kind": "eval", "step": 4, "eval_accuracy": 0.8, "eval_margin": 0.4, "eval_loss": 0.5}
    ]
    spec = curve_spec("dpo", rows)
    assert [(p.name, p.ylabel) for p in spec] == [
        ("loss", "loss"),
        ("accuracy", "pairs ranked right (fraction)"),
        ("margin", "reward margin (chosen - rejected)"),
    ]
    assert [[line.series.field for line in p.lines] for p in spec] == [
        ["loss", "eval_loss"],
        ["accuracy", "eval_accuracy"],
        ["margin", "eval_margin"],
    ]
    assert _legend(curve_figure(spec).axes[1]) == ["train batch accuracy", "held-out accuracy"]
    (plot,) = plot_curves([("dpo", _write_metrics(tmp_path / "dpo", rows))], tmp_path / "run")
    assert plot.series == (
        "loss",
        "eval_loss",
        "accuracy",
        "eval_accuracy",
        "margin",
        "eval_margin",
    )
    _assert_png(plot.path, panels=3)


def test_a_stage_whose_values_are_all_nan_gets_no_image(tmp_path: Path) -> None:
    rows = [{"kind": "train", "step": s, "loss": math.nan} for s in (1, 2, 3)]
    folder = _write_metrics(tmp_path / "sft", rows)
    assert plot_curves([("sft", folder)], tmp_path / "run") == []
    assert not (tmp_path / "run").exists()


def test_curves_section_links_exactly_the_drawn_images(tmp_path: Path) -> None:
    sft = _write_metrics(tmp_path / "sft", _sft_records())
    ppo = _write_metrics(tmp_path / "ppo", _rl_records())
    ingest = _write_metrics(tmp_path / "ingest", [{"kind": "start"}])
    out = tmp_path / "run"
    plots = plot_curves([("ingest", ingest), ("sft", sft), ("ppo", ppo)], out)

    lines = curves_markdown(plots)
    assert lines[0] == "## Curves"
    links = re.findall(r"!\[([^\]]*)\]\(([^)]*)\)", "\n".join(lines))
    assert links == [("sft loss", "curves-sft.png"), ("ppo loss, reward, kl", "curves-ppo.png")]
    # Relative to report.md, which is written into the same folder as the images.
    assert sorted(target for _, target in links) == sorted(p.name for p in out.iterdir())

    listed = curves_markdown(plots, inline=False)
    assert listed[2:] == [f"- sft loss: `{out / 'curves-sft.png'}`",
                          f"- ppo loss, reward, kl: `{out / 'curves-ppo.png'}`"]  # fmt: skip
    assert curves_markdown([]) == []


def test_importing_plots_loads_neither_torch_nor_matplotlib() -> None:
    # flows/post_train.py imports this module: the flow process must stay light until it draws.
    code = (
        "import sys, flows.report.plots; "
        "heavy = [m for m in ('torch', 'matplotlib') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
