"""The promotion gate, flow side: after a completed run, does its export replace the champion?

The comparison is `posttrain.workspace.promotion`; this module gathers the candidate's metrics:
the evaluate headline, plus `win_rate_vs_champion` when a rule asks for it, measured by the
head-to-head stage (launched like every stage, its artifact fingerprinted and reused). Nothing
here fails the run: a head-to-head that does not apply is skipped (the rule shows n/a and why);
one that fails refuses promotion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.logging import get_run_logger

from flows.report.tables import StageRecord, export_model_path
from flows.stage.launch import REUSE_ONLY, DevicesNeeded
from flows.stage.supervise import Outcome
from flows.stage.task import run_task
from posttrain.config.schema import ResolvedRecipe
from posttrain.kinds import KINDS
from posttrain.plan.planner import spec_for
from posttrain.runtime.spec import PlannedStage, StageSpec
from posttrain.store.artifacts import ref_from_manifest
from posttrain.store.status import status
from posttrain.workspace.promotion import (
    WIN_RATE_VS_CHAMPION,
    Decision,
    Unmeasured,
    compare,
    head_to_head_stage,
    read_registry,
    record_decision,
    uses_metric,
)

# (planned stage, its spec) -> its outcome; raises the stage's error (flows.stage.task.run_task).
RunSpec = Callable[[PlannedStage, StageSpec], Outcome]
# What the head-to-head's summary counts, kept in the registry entry.
HEAD_TO_HEAD_COUNTS = ("wins", "losses", "ties", "n", "win_rate")
Log = logging.Logger | logging.LoggerAdapter


@dataclass
class HeadToHead:
    """What the gate learnt from the head-to-head: the metric, or why there is none."""

    value: float | None = None
    unmeasured: Unmeasured | None = None
    note: str = ""  # one report line
    record: dict[str, Any] = field(default_factory=dict)  # kept in the registry entry


def promote(recipe: ResolvedRecipe, run_id: str, records: list[StageRecord]) -> Decision | None:
    """The promotion gate after a completed run, recorded in the registry. A run that left out
    its evaluate or its export (`--until`/`--only`) is not a candidate."""
    if not recipe.promotion.enabled:
        return None
    by_stage = {r.stage: r for r in records}
    evaluate = by_stage.get("evaluate")
    if evaluate is None or (recipe.export is not None and "export" not in by_stage):
        return None
    log = get_run_logger()
    export_fp = by_stage["export"].fingerprint if "export" in by_stage else None
    champion = read_registry(recipe.run.workspace, recipe.run.name)["champion"]
    if champion and export_fp and champion.get("export_fingerprint") == export_fp:
        return Decision(True, "already the champion (same export artifact)", [])
    metrics = dict(evaluate.summary.headline)
    unmeasured: dict[str, Unmeasured] = {}
    h2h = None
    if champion and uses_metric(recipe.promotion.rules, WIN_RATE_VS_CHAMPION):
        h2h = head_to_head_vs_champion(recipe, by_stage, champion, log)
        if h2h.value is not None:
            metrics[WIN_RATE_VS_CHAMPION] = h2h.value
        elif h2h.unmeasured is not None:
            unmeasured[WIN_RATE_VS_CHAMPION] = h2h.unmeasured
    decision = compare(
        metrics, champion and champion["metrics"], recipe.promotion.rules, unmeasured
    )
    candidate = {
        "run_id": run_id,
        "metrics": metrics,
        "export_path": export_model_path(records),
        "export_fingerprint": export_fp,
        "lineage": {r.stage: r.fingerprint for r in records},
    }
    if h2h is not None:
        decision.notes.append(h2h.note)
        candidate["head_to_head"] = h2h.record
    record_decision(recipe.run.workspace, recipe.run.name, candidate, decision)
    log.info("promotion: %s", decision.reason)
    return decision


def head_to_head_vs_champion(
    recipe: ResolvedRecipe,
    by_stage: dict[str, StageRecord],
    champion: dict[str, Any],
    log: Log,
    run_spec: RunSpec = run_task,
) -> HeadToHead:
    """Run (or reuse) the head-to-head of this run's export against the champion's; skipped,
    with the reason, when it cannot apply (`_cannot_run`). An error is caught: the result then
    blocks promotion, naming it. `run_spec` defaults to the `stage` task (needs a flow run)."""
    why = _cannot_run(by_stage, champion)
    if why:
        note = f"head-to-head against the champion skipped: {why}"
        log.warning(note)
        return HeadToHead(unmeasured=Unmeasured(why), note=note)
    try:
        parents = {
            "candidate": ref_from_manifest(Path(by_stage["export"].uri)),
            "champion": ref_from_manifest(Path(champion["export_path"]).parent),
            "reward_model": ref_from_manifest(Path(by_stage[_judge(by_stage)].uri)),
            "base": ref_from_manifest(Path(by_stage[_base(by_stage)].uri)),
        }
        stage = head_to_head_stage(recipe, parents)
        # Sizes only: whether to ask for the devices; the supervisor hashes before it reuses.
        if REUSE_ONLY.get() and not status(stage.out_dir, stage.fingerprint, hashes=False).complete:
            raise DevicesNeeded("the promotion gate's head-to-head runs both models")
        outcome = run_spec(stage, spec_for(stage, recipe, parents))
        value = float(outcome.summary.headline[WIN_RATE_VS_CHAMPION])
        # The head-to-head stage's own fields (posttrain.stages.head_to_head).
        counts = {k: (outcome.summary.model_extra or {})[k] for k in HEAD_TO_HEAD_COUNTS}
    except DevicesNeeded:
        raise
    except Exception as exc:
        text = str(exc) or type(exc).__name__
        reason = f"head-to-head against the champion failed: {_first_line(text)}"
        log.error("%s\n%s", reason, text)
        return HeadToHead(unmeasured=Unmeasured(reason, blocks=True), note=reason)
    ref = outcome.ref
    note = (
        f"head-to-head against champion {champion.get('run_id')} ({outcome.status}): "
        f"{counts['wins']} wins, {counts['losses']} losses, {counts['ties']} ties on "
        f"{counts['n']} held-out prompts, judged by this run's reward model "
        f"(win-rate {value:.4g}); answers in {ref.path / 'samples.jsonl'}"
    )
    log.info(note)
    record = {"champion_run_id": champion.get("run_id"), "artifact": ref.uri}
    record |= {"fingerprint": ref.fingerprint, **counts}
    return HeadToHead(value=value, note=note, record=record)


def _judge(by_stage: dict[str, StageRecord]) -> str:
    """The reward stage the evaluation judged with, else the run's last ("" for none)."""
    evaluate = by_stage.get("evaluate")
    if evaluate is not None and evaluate.roles.get("reward_model"):
        return evaluate.roles["reward_model"]
    rewards = [
        name
        for name, r in by_stage.items()
        if (kind := KINDS.get(r.kind or r.stage)) is not None and kind.produces == "reward_model"
    ]
    return rewards[-1] if rewards else ""


def _base(by_stage: dict[str, StageRecord]) -> str:
    """The base the run's export stands on (its `base` role; `ingest` by default)."""
    export = by_stage.get("export")
    return (export.roles.get("base") if export is not None else None) or "ingest"


def _cannot_run(by_stage: dict[str, StageRecord], champion: dict[str, Any]) -> str:
    """Why the head-to-head does not apply to this run, or "" when it does."""
    judge = _judge(by_stage)
    if judge not in by_stage:
        return "the recipe has no reward stage to judge with"
    if "export" not in by_stage or _base(by_stage) not in by_stage:
        return "the run has no export to compare"
    reward_prompts = Path(by_stage[judge].uri) / "data" / "eval.jsonl"
    if not reward_prompts.is_file() or not reward_prompts.read_text().strip():
        return f"the reward stage held out no pairs to take prompts from ({reward_prompts})"
    if not champion.get("export_path") or not champion.get("export_fingerprint"):
        return "the champion's registry entry names no export"
    # Present and the recorded artifact, file sizes only: hashing every file of a large export
    # here would cost minutes, and the stage verifies its parents before reading them.
    model_dir = Path(champion["export_path"])
    look = status(model_dir.parent, champion["export_fingerprint"], hashes=False)
    if not (model_dir / "config.json").is_file() or not look.complete:
        return f"the champion's export {model_dir} no longer exists"
    return ""


def _first_line(text: str) -> str:
    """The first line of a stage error, plus the stage's own POSTTRAIN_ERROR line if any."""
    lines = text.splitlines()
    cause = next((x for x in lines if x.startswith("POSTTRAIN_ERROR")), "")
    return lines[0] + (f" ({cause.split(' failed: ', 1)[-1]})" if cause else "")
