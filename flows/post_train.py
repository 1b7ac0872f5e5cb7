"""The Prefect flow `post-train`: plans the run once, runs its stages and records the run.

The flow body only wires: `posttrain.plan.planner.plan` answers every question the flow has of the
recipe (resolved and planned once: `posttrain run` hands the flow its plan), then each stage goes
through the one generic task (flows/stage/task.py) in dependency order (flows/schedule.py), then
the promotion gate (flows/gate.py) and the run's record (flows/run_record.py). Everything a stage
does happens in its own process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.client.schemas.objects import FlowRun, State
from prefect.context import FlowRunContext
from prefect.logging import get_run_logger
from prefect.states import Failed

from flows.devices import (
    device_set_name,
    ensure_device_limit,
    hold_devices,
    reusable_without_devices,
)
from flows.events import BASE_EVENT, publish_base
from flows.failure_block import known_block, reason_line
from flows.gate import promote
from flows.report.health_summary import stage_health
from flows.report.tables import RunResult, StageRecord
from flows.run_record import record_run
from flows.schedule import device_slots, run_stages
from flows.served_run import is_served_run, served_reach
from flows.stage.failures import QualityGateFailed
from flows.stage.launch import DevicesNeeded, current_flow_run_id, reuse_only
from flows.stage.procs import kill_flow_run_processes
from flows.stage.supervise import Outcome
from flows.stage.task import run_task
from flows.terminal import KNOWN_FAILURES, quiet_known_failures
from flows.trackers import StageFeed, Trackers, open_trackers
from posttrain.config.loader import resolve
from posttrain.config.schema import Recipe, ResolvedRecipe
from posttrain.config.served_access import ServedReach
from posttrain.plan.planner import RunPlan, plan, spec_for
from posttrain.plan.selection import Selection, choose
from posttrain.runtime.spec import PlannedStage
from posttrain.secrets import redact_obj
from posttrain.store.artifacts import ArtifactRef
from posttrain.store.summary import Summary
from posttrain.workspace.promotion import Decision
from posttrain.workspace.run_status import RunJournal


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
    stage: PlannedStage, outcome: Outcome | BaseException, duration_s: float
) -> StageRecord:
    """The record of a stage that ran or was reused, or that failed with `outcome`."""
    common = {"kind": stage.kind, "roles": dict(stage.roles)}
    if isinstance(outcome, BaseException):
        error, parents = str(outcome) or type(outcome).__name__, list(stage.parents.values())
        health = stage_health(stage.out_dir)
        where = {"uri": str(stage.out_dir), "parents": parents, "error": error, "health": health}
        return StageRecord(stage.name, stage.fingerprint, "failed", duration_s, **where, **common)
    ref, ran = outcome.ref, outcome.status == "ran"
    # Only what this run's launch recovered from: a reused artifact's is history.
    summary = outcome.summary if ran else outcome.summary.model_copy(update={"recovery": None})
    health = stage_health(stage.out_dir) if ran else {}
    made = (ref.uri, ref.sha256, list(ref.parents), summary)
    return StageRecord(
        stage.name, ref.fingerprint, outcome.status, duration_s, *made, health=health, **common
    )


class PipelineRun:
    """A run in progress; the schedule calls `run_one` per stage (one at a time or side by side)."""

    def __init__(
        self,
        run_plan: RunPlan,
        run_id: str,
        trackers: Trackers | None,
        journal: RunJournal | None = None,
    ) -> None:
        self.plan, self.run_id, self.trackers = run_plan, run_id, trackers
        self.journal = journal
        self.records: list[StageRecord] = []
        # Stages side by side end on their own threads: one append-and-write at a time, so
        # run.json's last write holds every record so far.
        self._record_lock = threading.Lock()

    def _recorded(self, record: StageRecord) -> None:
        # run.json names each artifact as soon as its stage ends: `posttrain clean` keeps what
        # a run used even when the run is killed before its final record.
        with self._record_lock:
            self.records.append(record)
            if self.journal is not None:
                rows = [
                    {"stage": r.stage, "fingerprint": r.fingerprint, "status": r.status}
                    for r in self.records
                ]
                self.journal.stages(rows)

    def run_one(self, stage: PlannedStage, refs: dict[str, ArtifactRef]) -> ArtifactRef:
        """Launch one stage with its parents' refs, fed to the trackers while it runs, and append
        its record (a failed one on error). A base this run ingested is announced."""
        t0 = time.monotonic()
        feed = None
        if self.trackers is not None:
            metrics = stage.out_dir / "metrics.jsonl"
            feed = self.trackers.start_stage(stage.name, stage.fingerprint, metrics)
        try:
            spec = spec_for(stage, self.plan.recipe, {p: refs[p] for p in stage.parents})
            outcome = run_task(stage, spec)
        except DevicesNeeded:
            raise  # not a failure: the run starts again, holding the devices
        except BaseException as exc:
            failed = stage_record(stage, exc, time.monotonic() - t0)
            self._recorded(failed)
            _end_tracking(self.trackers, feed, failed)
            raise
        record = stage_record(stage, outcome, time.monotonic() - t0)
        self._recorded(record)
        _end_tracking(self.trackers, feed, record)
        check_gate(outcome.summary, record)
        if stage.produces == "base" and outcome.status == "ran":
            announce_base(self.plan.recipe, outcome)
        return outcome.ref

    def stages_and_gate(self, slots: list[str | None]) -> Decision | None:
        """Run the plan's stages, then the promotion gate; a stage failure still writes the run
        folder and report."""
        try:
            run_stages(self.plan.stages, self.run_one, self.plan.parallel, slots)
        except DevicesNeeded:
            raise
        except BaseException as exc:
            try:
                run = record_run(
                    self.plan, self.run_id, self.records, trackers=self.trackers, failed=True
                )
                exc.add_note(f"run folder: {run.run_dir}")
            except Exception as problem:  # logged: it must not hide the stage's error
                get_run_logger().error("could not write the run record: %s", problem)
            raise
        return promote(self.plan.recipe, self.run_id, self.records)


def check_gate(summary: Summary, record: StageRecord) -> None:
    """Stop the pipeline when a stage's summary reports a failed gate: its artifact stays valid,
    nothing downstream runs on it."""
    gate = summary.gate
    if gate is not None and not gate.passed:
        record.error = f"quality gate: {gate.message or 'failed'}"
        raise QualityGateFailed(f"{record.stage}: {gate.message or 'quality gate failed'}")


def _end_tracking(trackers: Trackers | None, feed: StageFeed | None, record: StageRecord) -> None:
    # The rest of metrics.jsonl (all of it for a reused stage), then the stage's outcome.
    if trackers is None or feed is None:
        return
    try:
        feed.stop()
        trackers.end_stage(record)
    except Exception as exc:  # tracking is decoration: never fail a stage over it
        get_run_logger().warning("tracking of stage %s: %s", record.stage, exc)


def cancel_engine_jobs(flow_run: FlowRun) -> int:
    """Cancel the jobs a remote engine still runs or queues for this flow run (by its label)."""
    recipe = (flow_run.parameters or {}).get("recipe")
    if isinstance(recipe, Recipe):
        recipe = recipe.model_dump(mode="json")
    infra = (recipe or {}).get("infra") or {}
    try:
        if infra.get("launcher") == "slurm":
            from flows.stage.launchers.slurm import cancel_flow_run_jobs

            return cancel_flow_run_jobs(str(flow_run.id))
        if infra.get("launcher") == "kubernetes":
            from flows.stage.launchers.kubernetes import cancel_flow_run_jobs as cancel_k8s

            return cancel_k8s(str(flow_run.id), infra)
    except Exception as exc:  # a hook must not fail the cancel itself
        logging.getLogger("posttrain.flows").warning("could not cancel engine jobs: %s", exc)
    return 0


def stop_stage_processes(flow: Any, flow_run: FlowRun, state: State) -> None:
    """on_cancellation / on_crashed hook: kill every stage process and job of this flow run
    that the task's cleanup did not (a flow process killed outright)."""
    n = kill_flow_run_processes(str(flow_run.id))
    n += cancel_engine_jobs(flow_run)
    if n:
        stopped = f"flow run {flow_run.id} ended {state.name}: stopped {n} stage process(es)"
        logging.getLogger("posttrain.flows").warning(stopped)


def start_tracking(run_plan: RunPlan, run_id: str) -> Trackers:
    """The recipe's experiment trackers, told that this pipeline run begins."""
    recipe = run_plan.recipe
    run_dir = Path(recipe.run.workspace) / "runs" / run_id
    trackers = open_trackers(recipe.tracking, run_dir, run_plan.stages)
    trackers.start_pipeline(
        run_id, current_flow_run_id(), redact_obj(recipe.model_dump(mode="json"))
    )
    return trackers


def announce_base(recipe: Recipe, outcome: Outcome) -> None:
    """A newly ingested base checkpoint is news for pipelines that retrain on new bases."""
    if not outcome.summary.model_dir:
        return
    try:
        publish_base(outcome.summary.model_dir, recipe.run.name, outcome.ref.fingerprint)
    except Exception as exc:  # an event is a notification: never fail the run over it
        get_run_logger().warning("could not emit %s: %s", BASE_EVENT, exc)


@flow(
    name="post-train",
    flow_run_name=_flow_run_name,
    on_cancellation=[stop_stage_processes],
    on_crashed=[stop_stage_processes],
)
def post_train(
    recipe: Recipe, until: list[str] | None = None, only: list[str] | None = None
) -> RunResult | State:
    """The recipe's stages, each skipped when its artifact exists, then the promotion gate
    (`run_pipeline`); `until`/`only`: `--until/--only`. A served run that posttrain refuses or
    stops ends Failed with the one-line reason as its state's message, which is all its
    submitter sees (`posttrain submit --wait`); `posttrain run` gets the exception."""
    quiet_known_failures()  # the worker's log: one line per known failure, no traceback
    try:
        return run_pipeline(recipe, until, only)
    except KNOWN_FAILURES as exc:
        if not is_served_run():
            raise
        block = known_block(exc, {s.name: s.where for s in recipe.graph()})
        reason = reason_line(block) if block is not None else f"{type(exc).__name__}: {exc}"
        get_run_logger().error(reason)
        return Failed(message=reason)


# The plan `posttrain run` made before Prefect started (to refuse a bad --until/--only at
# once), handed to its flow so that the run is planned once, on the fingerprints it checked.
_HANDED: ContextVar[RunPlan | None] = ContextVar("posttrain_handed_plan", default=None)


@contextmanager
def handing(run_plan: RunPlan) -> Iterator[None]:
    """Within: a flow run of `run_plan.recipe` in this thread runs `run_plan`."""
    token = _HANDED.set(run_plan)
    try:
        yield
    finally:
        _HANDED.reset(token)


def plan_once(recipe: Recipe, reach: ServedReach | None) -> RunPlan:
    """The plan handed over for this very recipe, or made here. A served run's recipe must only
    narrow the worker's folders (`reach`) and is resolved with the worker's reward code only."""
    handed = _HANDED.get()
    if reach is None and handed is not None and handed.recipe is recipe:
        return handed
    if reach is not None:
        reach.check(recipe)
    if reach is not None or not isinstance(recipe, ResolvedRecipe):
        recipe = resolve(recipe, code_roots=reach.reward_roots if reach is not None else None)
    return plan(recipe)


def run_pipeline(
    recipe: Recipe, until: list[str] | None = None, only: list[str] | None = None
) -> RunResult:
    """The flow's body: choose and plan the stages, run them, the gate, the run's record."""
    reach = served_reach()
    command = "posttrain submit RECIPE" if reach is not None else "posttrain run RECIPE"
    run_plan = choose(plan_once(recipe, reach), Selection.of(until, only), command)
    recipe, run_id = run_plan.recipe, _new_run_id()
    # run.json says `running` from here on, and how the run ended (posttrain.workspace.run_status).
    with RunJournal(recipe.run.workspace, run_id, recipe.run.name) as journal:
        run = PipelineRun(run_plan, run_id, start_tracking(run_plan, run_id), journal)
        decision = on_devices(run)
        gate = [rule.metric for rule in recipe.promotion.rules]
        journal.outcome(evaluate_headline(run.records), decision and decision.promoted, gate)
        return record_run(run_plan, run_id, run.records, decision, trackers=run.trackers)


def on_devices(run: PipelineRun) -> Decision | None:
    """The run's stages and gate, holding the device set; without it when every stage's artifact
    is complete (should one need the devices after all, the run starts again holding them)."""
    run_plan, log = run.plan, get_run_logger()
    slot = device_set_name(run_plan.device)
    slots = device_slots(run_plan.parallel, run_plan.devices_per_stage, run_plan.device == "cuda")
    if reusable_without_devices(run_plan.stages):
        log.info("every stage's artifact is complete: reusing them without waiting for %s", slot)
        try:
            with reuse_only():
                return run.stages_and_gate(slots)
        except DevicesNeeded as exc:
            log.info("%s: waiting for the devices after all", exc)
            run.records.clear()
    ensure_device_limit(slot)
    # The gate's head-to-head runs models too: it is inside.
    with hold_devices(slot, run_plan.recipe.infra.wait_devices_s):
        return run.stages_and_gate(slots)


def evaluate_headline(records: list[StageRecord]) -> dict[str, Any]:
    """The evaluate stage's headline metrics, what `posttrain runs` shows per run."""
    return next((r.summary.headline for r in records if r.stage == "evaluate"), {})
