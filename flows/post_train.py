"""The Prefect flow `post-train`: orders the planned stages and records the run.

The flow body only wires: plan, then for each stage write its spec and launch it through the one
generic task (flows/stage_task.py). Everything a stage does happens in its own process. The run
report is made here, at flow level, because a cached task does not re-create its artifacts.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from prefect import Task, flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.schemas.objects import FlowRun, State
from prefect.context import FlowRunContext
from prefect.logging import get_run_logger

from flows import drawn
from flows.devices import device_set_name, ensure_device_limit, hold_devices
from flows.events import BASE_EVENT, publish_base
from flows.gate import promote
from flows.report import (
    StageRecord,
    curves_markdown,
    export_model_path,
    lineage,
    markdown_report,
    metrics_table,
)
from flows.schedule import device_slots, run_stages
from flows.served import check_served, is_served_run
from flows.stage_output import artifact_key
from flows.stage_procs import kill_flow_run_processes
from flows.stage_task import launch, stage_task_for
from flows.trackers import StageFeed, Trackers, open_trackers
from posttrain.artifacts import ArtifactRef, read_manifest
from posttrain.config.loader import resolve
from posttrain.config.reach import reward_roots
from posttrain.config.schema import Recipe
from posttrain.kinds import KINDS
from posttrain.planner import PlannedStage, plan, write_spec
from posttrain.promotion import Decision, comparison_markdown
from posttrain.secrets import redact, redact_obj
from posttrain.telemetry.graph_plot import GraphNode
from posttrain.telemetry.plots import CurvePlot


def _flow_run_name() -> str:
    ctx = FlowRunContext.get()
    recipe = (ctx.parameters or {}).get("recipe") if ctx else None
    if isinstance(recipe, Recipe):
        name = recipe.run.name
    elif isinstance(recipe, dict):
        name = str((recipe.get("run") or {}).get("name", "posttrain-run"))
    else:
        name = "posttrain-run"
    return f"{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


def _new_run_id() -> str:
    ctx = FlowRunContext.get()
    suffix = ctx.flow_run.id.hex[:8] if ctx and ctx.flow_run else "local"
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{suffix}"


def stage_record(
    stage: PlannedStage, status: str, ref: ArtifactRef, duration_s: float
) -> StageRecord:
    summary = (read_manifest(ref.path) or {}).get("summary") or {}
    headline = summary.get("headline") if isinstance(summary, dict) else None
    memory = summary.get("memory") if isinstance(summary, dict) else None
    recovery = summary.get("recovery") if isinstance(summary, dict) else None
    policies = summary.get("policies") if isinstance(summary, dict) else None
    return StageRecord(
        stage=stage.name,
        fingerprint=ref.fingerprint,
        status=status,
        duration_s=duration_s,
        uri=ref.uri,
        sha256=ref.sha256,
        parents=list(ref.parents),
        headline=headline if isinstance(headline, dict) else {},
        memory=memory if isinstance(memory, dict) else {},
        # Only what this run's launch recovered from: a reused artifact's is history.
        recovery=recovery if isinstance(recovery, dict) and status == "ran" else {},
        kind=stage.kind,
        roles=dict(stage.roles),
        policies=policies if isinstance(policies, dict) else {},
    )


def record_run(
    recipe: Recipe,
    run_id: str,
    records: list[StageRecord],
    promotion: Decision | None = None,
    quiet: bool = False,
    trackers: Trackers | None = None,
) -> dict[str, Any]:
    """Write `<workspace>/runs/<run-id>/` and the flow-level Prefect artifacts, and hand the
    run's files to the experiment trackers (`trackers`), whose links end the report.

    `quiet`: used while a failure propagates, so a problem here cannot hide the stage's error.
    """
    try:
        return _record_run(recipe, run_id, records, promotion, trackers, failed=quiet)
    except Exception as exc:
        if not quiet:
            raise
        get_run_logger().error("could not write the run record: %s", exc)
        return {}


def _record_run(
    recipe: Recipe,
    run_id: str,
    records: list[StageRecord],
    promotion: Decision | None,
    trackers: Trackers | None = None,
    failed: bool = False,
) -> dict[str, Any]:
    run_dir = Path(recipe.run.workspace) / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    export_path = export_model_path(records)
    ctx = FlowRunContext.get()
    meta = {
        "run_id": run_id,
        "run_name": recipe.run.name,
        "flow_run_id": str(ctx.flow_run.id) if ctx and ctx.flow_run else None,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "export_path": export_path,
    }
    report = markdown_report(recipe.run.name, run_id, records, export_path, str(run_dir))
    if promotion is not None:
        report += "\n## Promotion\n\n" + "\n".join(comparison_markdown(promotion)) + "\n"
    # Curves are decoration: a plotting failure (matplotlib missing, a corrupt metrics file) is
    # logged and the run record is written without them.
    # Both are copied from the workspace's image cache when drawn before from the same inputs
    # (flows.drawn): a cached re-run draws nothing.
    plots: list[CurvePlot] = []
    images = drawn.cache_dir(recipe.run.workspace)
    try:
        stages = [(r.stage, Path(r.uri)) for r in records if r.uri]
        plots, _ = drawn.curves(stages, run_dir, images)
    except Exception as exc:
        get_run_logger().warning("training curves not drawn: %s: %s", type(exc).__name__, exc)
    graph_png: Path | None = None
    try:
        nodes = graph_nodes(recipe, records)
        graph_png, _ = drawn.stage_graph(nodes, run_dir / "graph.png", images)
    except Exception as exc:
        get_run_logger().warning("stage graph not drawn: %s: %s", type(exc).__name__, exc)
    artifact_report = report
    if graph_png is not None:  # the Prefect UI cannot fetch files: it gets the path
        report += f"\n## Stage graph\n\n![stage graph]({graph_png.name})\n"
        artifact_report += f"\n## Stage graph\n\n- stage graph: `{graph_png}`\n"
    if plots:
        report += "\n" + "\n".join(curves_markdown(plots)) + "\n"
        artifact_report += "\n" + "\n".join(curves_markdown(plots, inline=False)) + "\n"
    # Nothing that looks like a credential (e.g. in a stage's error message) is written into
    # the run folder or the Prefect UI; the recipe itself was refused at validation if it had one.
    report, artifact_report = redact(report), redact(artifact_report)
    (run_dir / "recipe.resolved.yaml").write_text(
        yaml.safe_dump(redact_obj(recipe.model_dump(mode="json")), sort_keys=False)
    )
    (run_dir / "lineage.json").write_text(json.dumps(redact_obj(lineage(meta, records)), indent=2))
    tracked = redact(tracking_markdown(trackers))  # a tracker URI may carry a credential
    (run_dir / "report.md").write_text(report + tracked)
    if trackers is not None:
        images = [p.path for p in plots] + ([graph_png] if graph_png is not None else [])
        finish_tracking(trackers, run_dir, records, promotion, export_path, images, failed)
        after = redact(tracking_markdown(trackers))
        if after != tracked:  # a tracker failed taking the files: the report says so
            tracked = after
            (run_dir / "report.md").write_text(report + tracked)
    artifact_report += tracked
    key = artifact_key(recipe.run.name)
    create_markdown_artifact(
        artifact_report, key=f"{key}-report", description=f"posttrain run {run_id}"
    )
    create_table_artifact(
        redact_obj(metrics_table(records)),
        key=f"{key}-metrics",
        description="Per-stage key metrics",
    )
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "stages": [
            {
                "stage": r.stage,
                "status": r.status,
                "duration_s": round(r.duration_s, 2),
                "uri": r.uri,
                "headline": r.headline,
                "recovery": r.recovery,
            }
            for r in records
        ],
        "export_path": export_path,
        "promotion": None
        if promotion is None
        else {"promoted": promotion.promoted, "reason": promotion.reason},
    }


# Inputs the graph image leaves out: every stage reads the base, and evaluate/export also read
# their policy's parent and held-out source; drawn, they hide the chain. A stage whose only
# input is the base keeps that edge.
IMPLIED_ROLES = ("base", "parent", "heldout")


def _drawn(roles: dict[str, str]) -> dict[str, str]:
    kept = {r: n for r, n in roles.items() if r not in IMPLIED_ROLES}
    return kept or {r: n for r, n in roles.items() if r == "base"}


def graph_nodes(recipe: Recipe, records: list[StageRecord]) -> list[GraphNode]:
    """The run's stages for the graph image: each record with its status, inputs and headline,
    and the stages the run did not reach (after a failure) as pending."""
    nodes = [
        GraphNode(
            r.stage,
            r.kind or r.stage,
            "cached" if r.reused_result else ("failed" if r.error else r.status),
            _drawn(r.roles),
            {k: v for k, v in r.headline.items() if isinstance(v, int | float)},
        )
        for r in records
    ]
    seen = {n.name for n in nodes}
    graph = recipe.graph()
    first = [k.name for k in KINDS.values() if k.placement == "first"]
    last = [k.name for k in KINDS.values() if k.placement == "last"]
    for name in [*first, *graph.names(), *last]:
        if name not in seen:
            links = _drawn(dict(graph.get(name).links)) if name in graph else {}
            kind = graph.get(name).kind.name if name in graph else name
            nodes.append(GraphNode(name, kind, "pending", links, {}))
            seen.add(name)
    return nodes


class QualityGateFailed(RuntimeError):
    """A stage completed but its result is below a quality bar the recipe sets."""


def check_gate(ref: ArtifactRef, record: StageRecord) -> None:
    """Stop the pipeline when a stage's summary reports a failed gate (e.g. reward accuracy
    below reward.min_accuracy): its artifact stays valid, nothing downstream runs on it."""
    summary = (read_manifest(ref.path) or {}).get("summary") or {}
    gate = summary.get("gate") if isinstance(summary, dict) else None
    if isinstance(gate, dict) and gate.get("passed") is False:
        record.error = f"quality gate: {gate.get('message', 'failed')}"
        raise QualityGateFailed(f"{ref.stage}: {gate.get('message', 'quality gate failed')}")


def tracking_markdown(trackers: Trackers | None) -> str:
    """The report's section on the experiment trackers: where to look, what failed."""
    if trackers is None or not trackers.workers:
        return ""
    return "\n## Tracking\n\n" + "\n".join(trackers.report_lines()) + "\n"


def finish_tracking(
    trackers: Trackers,
    run_dir: Path,
    records: list[StageRecord],
    promotion: Decision | None,
    export_path: str | None,
    images: list[Path],
    failed: bool,
) -> None:
    """Hand the recorded run to the trackers and wait (bounded) for them to drain."""
    export = next((r for r in records if r.stage == "export" and r.status != "failed"), None)
    trackers.finish(
        {
            "run_dir": str(run_dir),
            "report": str(run_dir / "report.md"),
            "images": [str(p) for p in images],
            "promoted": bool(promotion is not None and promotion.promoted),
            "export_path": export_path,
            "export_fingerprint": export.fingerprint if export else None,
            "export_sha256": export.sha256 if export else None,
            "fingerprints": {r.stage: r.fingerprint for r in records},
            "failed": failed,
        }
    )


def _end_tracking(trackers: Trackers | None, feed: StageFeed | None, record: StageRecord) -> None:
    # The rest of metrics.jsonl (all of it for a reused stage), then the stage's outcome.
    if trackers is None or feed is None:
        return
    try:
        feed.stop()
        info = {
            "uri": record.uri,
            "sha256": record.sha256,
            "headline": record.headline,
            "error": record.error,
        }
        trackers.end_stage(record.stage, record.status, info)
    except Exception as exc:  # tracking is decoration: never fail a stage over it
        get_run_logger().warning("tracking of stage %s: %s", record.stage, exc)


def run_recorded(
    launcher: Task[..., dict[str, Any]],
    stage: PlannedStage,
    recipe: Recipe,
    refs: dict[str, ArtifactRef],
    records: list[StageRecord],
    trackers: Trackers | None = None,
) -> ArtifactRef:
    """Write the stage's spec, launch it, and append its record (a failed one on error).
    `trackers` get the stage's metrics.jsonl records while it runs and its outcome."""
    t0 = time.monotonic()
    feed = None
    if trackers is not None:
        feed = trackers.start_stage(stage.name, stage.fingerprint, stage.out_dir / "metrics.jsonl")
    try:
        spec = write_spec(stage, recipe, {p: refs[p] for p in stage.parents})
        status, ref = launch(launcher, stage, spec)
    except BaseException as exc:
        failed = StageRecord(
            stage.name,
            stage.fingerprint,
            "failed",
            time.monotonic() - t0,
            uri=str(stage.out_dir),
            parents=list(stage.parents.values()),
            error=str(exc) or type(exc).__name__,
            kind=stage.kind,
            roles=dict(stage.roles),
        )
        records.append(failed)
        _end_tracking(trackers, feed, failed)
        raise
    records.append(stage_record(stage, status, ref, time.monotonic() - t0))
    _end_tracking(trackers, feed, records[-1])
    check_gate(ref, records[-1])
    return ref


def cancel_engine_jobs(flow_run: FlowRun) -> int:
    """Cancel the jobs a remote engine (infra.launcher slurm or kubernetes) still runs or
    queues for this flow run, found by the flow-run label they were submitted with."""
    recipe = (flow_run.parameters or {}).get("recipe")
    if isinstance(recipe, Recipe):
        recipe = recipe.model_dump(mode="json")
    infra = (recipe or {}).get("infra") or {}
    try:
        if infra.get("launcher") == "slurm":
            from flows.launchers.slurm import cancel_flow_run_jobs

            return cancel_flow_run_jobs(str(flow_run.id))
        if infra.get("launcher") == "kubernetes":
            from flows.launchers.kubernetes import cancel_flow_run_jobs as cancel_k8s

            return cancel_k8s(str(flow_run.id), infra)
    except Exception as exc:  # a hook must not fail the cancel itself
        logging.getLogger("posttrain.flows").warning("could not cancel engine jobs: %s", exc)
    return 0


def stop_stage_processes(flow: Any, flow_run: FlowRun, state: State) -> None:
    """on_cancellation / on_crashed hook: kill every stage process still carrying this flow
    run's id. The task's own cleanup normally did it already; this covers a flow process that
    was killed outright (the runner's SIGKILL after its grace period, an OOM kill)."""
    n = kill_flow_run_processes(str(flow_run.id))
    n += cancel_engine_jobs(flow_run)
    if n:
        logging.getLogger("posttrain.flows").warning(
            "flow run %s ended %s: stopped %d stage process(es)", flow_run.id, state.name, n
        )


def start_tracking(recipe: Recipe, run_id: str) -> Trackers:
    """The recipe's experiment trackers, told that this pipeline run begins."""
    run_dir = Path(recipe.run.workspace) / "runs" / run_id
    trackers = open_trackers(recipe.tracking, run_dir)
    ctx = FlowRunContext.get()
    flow_run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    trackers.start_pipeline(run_id, flow_run_id, redact_obj(recipe.model_dump(mode="json")))
    return trackers


def announce_base(recipe: Recipe, ref: ArtifactRef) -> None:
    """A newly ingested base checkpoint is news for pipelines that retrain on new bases."""
    model_dir = ((read_manifest(ref.path) or {}).get("summary") or {}).get("model_dir")
    if not model_dir:
        return
    try:
        publish_base(model_dir, recipe.run.name, ref.fingerprint)
    except Exception as exc:  # an event is a notification: never fail the run over it
        get_run_logger().warning("could not emit %s: %s", BASE_EVENT, exc)


@flow(
    name="post-train",
    flow_run_name=_flow_run_name,
    on_cancellation=[stop_stage_processes],
    on_crashed=[stop_stage_processes],
)
def post_train(recipe: Recipe) -> dict[str, Any]:
    """The recipe's stages (ingest, the stage graph, evaluate, export), each skipped when its
    artifact exists, then the promotion gate; all while holding the device set's slot."""
    # A served run's recipe came from whoever sent it: it may only narrow the worker's folders.
    check_served(recipe)
    # Idempotent; a UI or deployment run arrives unresolved, and imports reward code only from
    # the worker's reward folders.
    recipe = resolve(recipe, code_roots=reward_roots() if is_served_run() else None)
    run_id, launcher = _new_run_id(), stage_task_for(recipe.run.workspace)
    records: list[StageRecord] = []
    slot = device_set_name(recipe)
    ensure_device_limit(slot)
    infra = recipe.infra
    parallel = int(infra.parallel_stages)  # resolved: "auto" is a number by now
    trackers = start_tracking(recipe, run_id)

    def run_stage(stage: PlannedStage, refs: dict[str, ArtifactRef]) -> ArtifactRef:
        return run_recorded(launcher, stage, recipe, refs, records, trackers)

    def announce(stage: PlannedStage, ref: ArtifactRef) -> None:
        ran = next((r.status == "ran" for r in records if r.stage == stage.name), False)
        if KINDS[stage.kind].produces == "base" and ran:
            announce_base(recipe, ref)

    with hold_devices(slot):  # the gate's head-to-head runs models too: it is inside
        try:
            run_stages(
                plan(recipe),
                run_stage,
                parallel,
                device_slots(parallel, int(infra.devices_per_node), infra.device == "cuda"),
                on_done=announce,
            )
        except BaseException as exc:
            # The run folder and report still say which stage failed and what ran before it.
            run_dir = record_run(recipe, run_id, records, quiet=True, trackers=trackers).get(
                "run_dir"
            )
            if run_dir:
                exc.add_note(f"run folder: {run_dir}")
            raise
        decision = promote(recipe, run_id, records)
    return record_run(recipe, run_id, records, decision, trackers=trackers)
