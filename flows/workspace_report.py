"""What `posttrain runs` and `posttrain clean` print: plain-text tables for the terminal.

The listing and the plan are `posttrain.workspace.runs` and `posttrain.workspace.clean`; this
module only words them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flows.report.tables import format_duration, text_table
from posttrain.workspace.clean import DAMAGED, FAILED, TRASH, UNREFERENCED, CleanPlan
from posttrain.workspace.runs import RunInfo, compact_headline
from posttrain.workspace.trash import Outcome

TOTALS = (
    (FAILED, "failed attempts"),
    (DAMAGED, "damaged checkpoints"),
    (UNREFERENCED, "unreferenced artifacts"),
    (TRASH, "left in .trash"),
)
WHY_WIDTH = 110  # a reason is cut to this, so that a row fits a wide terminal


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _started(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _duration(run: RunInfo) -> str:
    if run.duration_s is None:
        return "-"
    return (">" if run.duration_at_least else "") + format_duration(run.duration_s)


def runs_lines(runs: Sequence[RunInfo]) -> list[str]:
    """The runs table, then one line per failed or interrupted run saying why."""
    promoted = {True: "yes", False: "no", None: "-"}
    rows = [
        (r.run_id, r.name, r.status, _started(r.started), _duration(r))
        + (compact_headline(r.headline, r.gate_metrics), promoted.get(r.promoted, "-"))
        for r in runs
    ]
    header = ("run", "recipe", "status", "started", "duration", "headline", "promoted")
    lines = text_table(rows, header).splitlines()
    return lines + [
        f"{r.run_id}: {r.error}" for r in runs if r.error and r.status in ("failed", "interrupted")
    ]


def _cut(text: str) -> str:
    return text if len(text) <= WHY_WIDTH else text[: WHY_WIDTH - 3] + "..."


def clean_lines(plan: CleanPlan, outcome: Outcome | None) -> list[str]:
    """The plan (or what was deleted): one row per candidate, totals per category, what was
    kept although it looked deletable, and the verdict line."""
    ws = plan.workspace
    done = None if outcome is None else {id(c) for c in outcome.deleted}
    lines = [f"workspace {ws}" + (" (dry run: nothing is deleted)" if done is None else "")]
    if plan.candidates:
        rows = [
            (
                c.category if done is None or id(c) in done else f"{c.category} (kept)",
                human(c.bytes),
            )
            + (str(c.path.relative_to(ws)), _cut(c.why))
            for c in plan.candidates
        ]
        lines += ["", *text_table(rows, ("what", "size", "path", "why")).splitlines(), ""]
    for category, label in TOTALS:
        n = sum(c.category == category for c in plan.candidates)
        lines.append(f"{label + ':':<24}{n:>3}  {human(plan.total(category)):>10}")
    notes = plan.kept + ([] if outcome is None else outcome.skipped)
    if notes:
        lines += ["", "left alone:", *(f"  {n}" for n in notes)]
    lines.append("")
    if outcome is None:
        would = f"would free {human(plan.total())}; run with --yes to delete"
        lines.append(would if plan.candidates else "nothing to delete")
    else:
        lines.append(f"freed {human(outcome.freed)} ({len(outcome.deleted)} deleted)")
    return lines
