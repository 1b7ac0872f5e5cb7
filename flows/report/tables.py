"""Run reports built from per-stage records: pure functions, no Prefect, no I/O.

The flow collects one `StageRecord` per planned stage and hands them here for the markdown report
(Prefect artifact and `runs/<run-id>/report.md`), the per-stage metrics table, the lineage graph
(`lineage.json`) and the CLI's summary table, so the same numbers appear everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.report.failures import failures_markdown
from flows.report.health_summary import absent_reason, health_line
from flows.report.plots import CurvePlot
from posttrain.store.summary import Summary
from posttrain.workspace.promotion import Decision

# ran: the stage process was launched and completed. reused: a complete artifact with this
# fingerprint was in the workspace (made by an earlier run, or by hand), so nothing ran.
# failed: the stage process failed or was killed. The same words everywhere: the terminal, the
# report, the stage graph, the Prefect task state (Reused) and the trackers.
STATUSES = ("ran", "reused", "failed")


@dataclass
class StageRecord:
    """What one stage contributed to a run."""

    stage: str
    fingerprint: str
    status: str
    duration_s: float
    uri: str = ""
    sha256: str = ""
    parents: list[str] = field(default_factory=list)
    # Its summary; `recovery` only when this run launched it (a reused artifact's is history).
    summary: Summary = field(default_factory=Summary)
    error: str = ""
    # The stage's kind (its name, unless the recipe named it) and which stage played which of
    # its input roles (posttrain.runtime.spec.PlannedStage.roles).
    kind: str = ""
    roles: dict[str, str] = field(default_factory=dict)
    # What this launch's ranks went through (flows.report.health_summary): data wait,
    # memory headroom, MFU, throttling, network errors, each with its worst moment.
    health: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    """What the flow returns and `posttrain run` prints: the stages' records, the run folder,
    images and export, the stages left out, the promotion; `failed`: recorded at a failure."""

    run_id: str
    run_dir: Path
    stages: list[StageRecord]
    export_path: str | None = None
    not_selected: list[str] = field(default_factory=list)
    promotion: Decision | None = None
    images: list[Path] = field(default_factory=list)
    failed: bool = False


def format_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def format_value(value: Any) -> str:
    """Compact numbers for tables: 4 significant digits, integers as integers."""
    if not isinstance(value, float) or math.isnan(value) or math.isinf(value):
        return str(value)  # bool, None and int included
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def headline_text(headline: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in headline.items())


def _md_cell(text: str) -> str:
    # A pipe inside a cell would split it; newlines would end the row.
    return text.replace("|", "\\|").replace("\n", " ")


def _md_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(map(_md_cell, cells)) + " |"


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]], *intro: str) -> list[str]:
    """A markdown table after `intro` (a section's heading and notes), each its own paragraph."""
    head = [line for text in intro for line in ("", text)]
    return [*head, "", _md_row(header), "|" + "---|" * len(header), *map(_md_row, rows)]


def markdown_report(
    run_name: str,
    run_id: str,
    records: Sequence[StageRecord],
    export_path: str | None = None,
    run_dir: str | None = None,
    not_selected: Sequence[str] = (),
) -> str:
    """The run report: one row per stage, the sections, then the lineage. `not_selected`: the
    stages the run left out (`--until`/`--only`), named once."""
    # A stage with an error either failed or completed below a quality gate and stopped the run.
    failed = [r for r in records if r.status == "failed" or r.error]
    if not failed:
        outcome = "**completed**"
    elif failed[0].status == "failed":
        outcome = f"**failed** at stage `{failed[0].stage}`"
    else:
        outcome = f"**stopped** by the quality gate of stage `{failed[0].stage}`"
    rows = [
        (
            r.stage,
            r.status,
            format_duration(r.duration_s),
            headline_text(r.summary.headline) or "-",
            f"`{r.uri}`" if r.uri else "-",
        )
        for r in records
    ]
    header = ("stage", "status", "duration", "key metrics", "artifact")
    lines = _md_table(
        header, rows, f"# posttrain run `{run_name}`", f"Run id `{run_id}`: {outcome}."
    )[1:]
    if not_selected:
        lines += ["", not_selected_text(not_selected)]
    if export_path:
        lines += ["", f"Exported model: `{export_path}`"]
    if run_dir:
        lines += ["", f"Run folder: `{run_dir}`"]
    for r in failed:
        title = "stopped the run" if r.status != "failed" else "failed"
        lines += ["", f"## `{r.stage}` {title}", "", "```", r.error.strip(), "```"]
    if recovered := recovery_lines(records):
        lines += ["", "## Recovered", "", *(f"- {_md_cell(line)}" for line in recovered)]
    lines += memory_markdown(records)
    lines += sre_markdown(records)
    lines += chain_markdown(records)
    lines += kl_markdown(records)
    lines += teacher_markdown(records)
    lines += failures_markdown(
        [(r.stage, (r.summary.model_extra or {}).get("verifier")) for r in records]
    )
    by_fp = {r.fingerprint: r.stage for r in records}
    lines += ["", "## Lineage", ""]
    for r in records:
        inputs = ", ".join(f"{by_fp.get(p, '?')}@{p}" for p in r.parents) or "none"
        sha = f" sha256 {r.sha256[:12]}" if r.sha256 else ""
        lines.append(f"- `{r.stage}@{r.fingerprint}`{sha} <- {inputs}")
    return "\n".join(lines) + "\n"


def not_selected_text(names: Sequence[str]) -> str:
    """The stages a run left out (`--until`/`--only`): not in its table, named here once."""
    return f"Not selected (left out of this run): {', '.join(names)}."


def recovery_lines(records: Sequence[StageRecord]) -> list[str]:
    """One line per stage that recovered from an earlier attempt (what happened, where it
    resumed, which checkpoints it rejected)."""
    out = []
    for r in records:
        rec = r.summary.recovery
        if rec is None:
            continue
        parts = [rec.earlier_attempt] if rec.earlier_attempt else []
        for bad in rec.rejected_checkpoints:
            parts.append(f"rejected damaged checkpoint {bad}")
        step = rec.resumed_from_step
        parts.append(f"resumed from step {step}" if step else "started from step 0")
        out.append(f"{r.stage}: " + "; ".join(parts))
    return out


def health_lines(records: Sequence[StageRecord]) -> list[str]:
    """One line per stage that trained in this run: `sft: data-wait 3% (worst ...), ...`."""
    return [f"{r.stage}: {line}" for r in records if (line := health_line(r.health))]


def _moment(figure: dict[str, Any] | None, fmt: str, at: str = "step") -> str:
    if not figure:
        return "-"
    worst = f"{figure['worst']:{fmt}}"
    return f"{figure['median']:{fmt}} (worst {worst} at {at} {figure['worst_step']:.0f})"


def sre_markdown(records: Sequence[StageRecord]) -> list[str]:
    """The "## SRE" section: each trained stage's health figures and their worst moments."""
    rows = [r for r in records if r.health.get("step_time")]
    if not rows:
        return []
    header = ("stage", "step time (s)", "data-wait share", "MFU", "reserved/allocated")
    header += ("peak RSS (GiB)", "GPU", "non-finite updates")
    cells = [
        (
            r.stage,
            _moment(r.health.get("step_time"), ".3g"),
            _moment(r.health.get("data_wait"), ".1%"),
            _moment(r.health.get("mfu"), ".1%"),
            _moment(r.health.get("reserved_over_allocated"), ".2f"),
            _peak(r.health.get("peak_rss_gib")),
            _gpu_cell(r.health),
            format_value(r.health.get("nonfinite_updates", 0)),
        )
        for r in rows
    ]
    lines = _md_table(
        header, cells, "## SRE", "Median over the stage's steps, with its worst moment."
    )
    return lines + [f"- {_md_cell(line)}" for line in health_lines(rows)]


def _peak(figure: dict[str, Any] | None) -> str:
    """A peak only grows: its value, and the step it was reached."""
    return f"{figure['worst']:.2f} (at step {figure['worst_step']:.0f})" if figure else "-"


def _gpu_cell(h: dict[str, Any]) -> str:
    gpu = h.get("gpu")
    if gpu is None:
        return f"not read: {absent_reason(h)}" if h.get("sources") else "-"
    parts = [f"power {gpu['power_min_w']:.0f}-{gpu['power_mean_w']:.0f} W (min-mean)"]
    if gpu.get("power_limit_w"):
        parts[-1] += f" of {gpu['power_limit_w']:.0f} W"
    if gpu.get("temperature_max_c") is not None:
        parts.append(f"max {gpu['temperature_max_c']:.0f} C")
    throttled = ", ".join(
        f"{k} from {v:.0f} s" for k, v in (gpu.get("throttle_first_s") or {}).items()
    )
    parts.append(f"throttled: {throttled}" if throttled else "no throttling seen")
    return "; ".join(parts)


def memory_markdown(records: Sequence[StageRecord]) -> list[str]:
    """The "## Memory" section: each training stage's pre-flight estimate beside its peak."""
    rows = [(r.stage, r.summary.memory) for r in records if r.summary.memory is not None]
    if not rows:
        return []
    header = ("stage", "estimate (GiB)", "measured peak (GiB)", "measured as")
    header += ("estimate / measured", "capacity (GiB)")
    cells = [
        (stage, *map(format_value, (m.estimate_gib, m.measured_peak_gib)), m.measured)
        + tuple(map(format_value, (m.estimate_over_measured, m.capacity_gib)))
        for stage, m in rows
    ]
    return _md_table(header, cells, "## Memory")


def curves_markdown(plots: Sequence[CurvePlot], inline: bool = True) -> list[str]:
    """The "## Curves" section: one image per plotted stage, linked beside report.md (`inline`),
    else named by its full path (the Prefect UI cannot fetch files from the run folder)."""
    if not plots:
        return []
    lines = ["## Curves", ""]
    for p in plots:
        alt = f"{p.stage} {', '.join(p.panels)}"
        lines.append(f"![{alt}]({p.path.name})" if inline else f"- {alt}: `{p.path}`")
        if inline:
            lines.append("")
    return lines[:-1] if inline else lines


def metrics_table(records: Sequence[StageRecord]) -> list[dict[str, Any]]:
    """Long format (stage, metric, value): stages report different metrics, so a wide table
    would be mostly empty columns."""
    return [
        {"stage": r.stage, "metric": k, "value": v}
        for r in records
        for k, v in [("duration_s", round(r.duration_s, 2)), *r.summary.headline.items()]
    ]


def lineage(run_meta: dict[str, Any], records: Sequence[StageRecord]) -> dict[str, Any]:
    """`lineage.json`: every artifact the run used or made, and which fed which."""
    fields = ("stage", "fingerprint", "parents", "uri", "sha256", "status")
    return {**run_meta, "artifacts": [{k: getattr(r, k) for k in fields} for r in records]}


def text_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """Left-aligned plain-text table for the terminal."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*(str(c) for c in row)) for row in rows]
    return "\n".join(line.rstrip() for line in out)


def summary_table(records: Sequence[StageRecord]) -> str:
    """CLI summary: stage | status | duration | headline metrics."""
    rows = [
        (r.stage, r.status, format_duration(r.duration_s), headline_text(r.summary.headline) or "-")
        for r in records
    ]
    return text_table(rows, ("stage", "status", "duration", "headline metrics"))


def chain_markdown(records: Sequence[StageRecord]) -> list[str]:
    """`evaluate.policies` side by side: what each link of the chain gained over its parent."""
    ev = next((r for r in records if r.summary.policies), None)
    if ev is None:
        return []
    rows = ev.summary.policies
    cells = []
    for name, row in rows.items():
        parent = rows.get(row.get("parent"), {})
        figures = []  # each figure, then this policy's gain over its parent
        for key in ("loss", "exact_match"):
            figures.append(format_value(row[key]) if key in row else "-")
            has_both = key in row and key in parent
            figures.append(f"{row[key] - parent[key]:+.4g}" if has_both else "-")
        win = format_value(row["win_rate_vs_parent"]) if "win_rate_vs_parent" in row else "-"
        cells.append((name, str(row.get("kind", "")), str(row.get("parent", "")), *figures, win))
    header = ("policy", "kind", "from", "held-out loss", "loss gain", "exact match")
    header += ("exact-match gain", "win-rate vs parent")
    note = (
        "Each policy against the one it started from (held-out loss: lower is better; the "
        "gain columns are this policy minus its parent; win-rate judged by the reward model)."
    )
    return _md_table(header, cells, "## Along the chain", note)


def kl_markdown(records: Sequence[StageRecord]) -> list[str]:
    """The "## KL to the reference" section: each online-RL stage's held-out KL, with the
    estimator it was measured (and gated) by and the stage its reference is."""
    lines = []
    for r in records:
        estimator = (r.summary.model_extra or {}).get("kl_estimator")
        if estimator is None or "eval_kl" not in r.summary.headline:
            continue
        to = f"stage `{r.roles['reference']}`" if "reference" in r.roles else "its reference"
        lines.append(
            f"- `{r.stage}`: KL ({estimator}) to the reference, {to}: "
            f"{format_value(r.summary.headline['eval_kl'])} nats per held-out response"
        )
    if not lines:
        return []
    note = (
        "Mean over held-out prompts of each response's summed per-token estimate: k1 (the "
        "log-ratio) can read negative on a sample, k2 and k3 never do."
    )
    return ["", "## KL to the reference", "", note, "", *lines]


def teacher_markdown(records: Sequence[StageRecord]) -> list[str]:
    """A distilled policy's line: its start, end and teacher on held-out exact match, and the
    share of the gap closed; nothing without a teacher."""
    taught = (r for r in records if "teacher" in r.roles)
    ev = next((r for r in taught if "exact_match_teacher" in r.summary.headline), None)
    if ev is None:
        return []
    h = ev.summary.headline
    start = "parent" if "exact_match_parent" in h else "base"
    gap = h.get("teacher_gap_closed")
    closed = f"closed {format_value(gap)} of the gap" if gap is not None else "no gap to close"
    line = (
        f"Distilled from `{ev.roles['teacher']}` (base `{ev.roles.get('teacher_base', '?')}`): "
        f"greedy exact match {start} {format_value(h[f'exact_match_{start}'])} -> "
        f"`{ev.roles.get('policy', '?')}` {format_value(h['exact_match_tuned'])}, teacher "
        f"{format_value(h['exact_match_teacher'])}: {closed}"
    )
    if "pass@1_teacher" in h:
        line += f"; pass@1 {format_value(h['pass@1'])}, teacher {format_value(h['pass@1_teacher'])}"
    return ["", "## Teacher", "", line + "."]


def export_model_path(records: list[StageRecord]) -> str | None:
    """The merged model the export stage wrote (`<export artifact>/model`)."""
    done = [r for r in records if r.stage == "export" and r.status != "failed" and r.uri]
    return str(Path(done[-1].uri) / "model") if done else None
