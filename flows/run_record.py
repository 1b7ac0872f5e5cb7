"""The run's record: `<workspace>/runs/<run-id>/` (the resolved recipe, `lineage.json`,
`report.md` and its images) and the flow-level Prefect artifacts (report, metrics table), made
from the stages' records so it says what every stage did, the reused ones included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.logging import get_run_logger

from flows.report.images import cache_dir, curves, stage_graph
from flows.report.plots import CurvePlot
from flows.report.tables import (
    RunResult,
    StageRecord,
    curves_markdown,
    export_model_path,
    lineage,
    markdown_report,
    metrics_table,
)
from flows.stage.launch import current_flow_run_id
from flows.stage.output import artifact_key
from flows.trackers import Trackers
from posttrain.plan.planner import RunPlan
from posttrain.secrets import redact, redact_obj
from posttrain.workspace.promotion import Decision, comparison_markdown


@dataclass
class Images:
    """The report's images: curves per stage and the stage graph (None: not drawn)."""

    plots: list[CurvePlot]
    graph: Path | None

    def paths(self) -> list[Path]:
        return [p.path for p in self.plots] + ([self.graph] if self.graph is not None else [])


def record_run(
    run_plan: RunPlan,
    run_id: str,
    records: list[StageRecord],
    promotion: Decision | None = None,
    trackers: Trackers | None = None,
    failed: bool = False,
) -> RunResult:
    """Write the run folder and Prefect artifacts, hand the files to the `trackers` (whose links
    end the report); the run's result. `failed`: the run stops at a failure."""
    recipe = run_plan.recipe
    run_dir = Path(recipe.run.workspace) / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    export_path = export_model_path(records)
    args = (export_path, str(run_dir), run_plan.not_selected)
    report = markdown_report(recipe.run.name, run_id, records, *args)
    if promotion is not None:
        report += "\n## Promotion\n\n" + "\n".join(comparison_markdown(promotion)) + "\n"
    images = draw_images(run_plan, records, run_dir)
    # Nothing that looks like a credential (e.g. in a stage's error message) is written into
    # the run folder or the Prefect UI; the recipe itself was refused at validation if it had one.
    on_disk, in_ui = (redact(text) for text in with_images(report, images))
    (run_dir / "recipe.resolved.yaml").write_text(
        yaml.safe_dump(redact_obj(recipe.model_dump(mode="json")), sort_keys=False)
    )
    meta = run_meta(run_id, recipe.run.name, export_path) | {"not_selected": run_plan.not_selected}
    (run_dir / "lineage.json").write_text(json.dumps(redact_obj(lineage(meta, records)), indent=2))
    tracked = tracking_markdown(trackers)  # a tracker URI may carry a credential: redacted
    (run_dir / "report.md").write_text(on_disk + tracked)
    result = RunResult(run_id, run_dir, list(records), export_path, run_plan.not_selected)
    result.promotion, result.images, result.failed = promotion, images.paths(), failed
    if trackers is not None:
        trackers.finish(result)
        after = tracking_markdown(trackers)
        if after != tracked:  # a tracker failed taking the files: the report says so
            tracked = after
            (run_dir / "report.md").write_text(on_disk + tracked)
    key = artifact_key(recipe.run.name)
    create_markdown_artifact(in_ui + tracked, key=f"{key}-report", description=f"run {run_id}")
    table = redact_obj(metrics_table(records))
    create_table_artifact(table, key=f"{key}-metrics", description="Per-stage metrics")
    return result


def run_meta(run_id: str, run_name: str, export_path: str | None) -> dict[str, Any]:
    """The head of `lineage.json`."""
    created = datetime.now(UTC).isoformat(timespec="seconds")
    meta = {"run_id": run_id, "run_name": run_name, "flow_run_id": current_flow_run_id()}
    return meta | {"created_at": created, "export_path": export_path}


def draw_images(run_plan: RunPlan, records: list[StageRecord], run_dir: Path) -> Images:
    """Curves and the stage graph, from the image cache when drawn before from the same inputs.
    A plotting failure is logged and the run record written without the image."""
    cache = cache_dir(run_plan.recipe.run.workspace)
    plots: list[CurvePlot] = []
    try:
        stages = [(r.stage, Path(r.uri)) for r in records if r.uri]
        plots, _ = curves(stages, run_dir, cache)
    except Exception as exc:
        get_run_logger().warning("training curves not drawn: %s: %s", type(exc).__name__, exc)
    graph = None
    try:
        graph, _ = stage_graph(graph_records(run_plan, records), run_dir / "graph.png", cache)
    except Exception as exc:
        get_run_logger().warning("stage graph not drawn: %s: %s", type(exc).__name__, exc)
    return Images(plots, graph)


def with_images(report: str, images: Images) -> tuple[str, str]:
    """(report.md's text, the Prefect artifact's: the UI cannot fetch files, it gets paths)."""
    on_disk, in_ui = report, report
    if images.graph is not None:
        on_disk += f"\n## Stage graph\n\n![stage graph]({images.graph.name})\n"
        in_ui += f"\n## Stage graph\n\n- stage graph: `{images.graph}`\n"
    if images.plots:
        on_disk += "\n" + "\n".join(curves_markdown(images.plots)) + "\n"
        in_ui += "\n" + "\n".join(curves_markdown(images.plots, inline=False)) + "\n"
    return on_disk, in_ui


def graph_records(run_plan: RunPlan, records: list[StageRecord]) -> list[StageRecord]:
    """Each record, and the stages a failed run did not reach as pending."""
    pending = [
        StageRecord(s.name, s.fingerprint, "pending", 0.0, kind=s.kind, roles=dict(s.roles))
        for s in run_plan.pending({r.stage for r in records})
    ]
    return [*records, *pending]


def tracking_markdown(trackers: Trackers | None) -> str:
    """The report's section on the experiment trackers: where to look, what failed."""
    if trackers is None or not trackers.workers:
        return ""
    return redact("\n## Tracking\n\n" + "\n".join(trackers.report_lines()) + "\n")
