"""The promotion gate: is a run's candidate better than the current champion of its pipeline?

A pipeline (recipe `run.name`) has at most one champion, recorded in
`<workspace>/registry/<name>.json` with the decision history. After a run, the candidate's
metrics (the evaluate stage's headline) are compared with the champion's, rule by rule from
`promotion.rules` (metric, direction, absolute tolerance). The candidate is promoted only if no
rule regresses beyond its tolerance; a rule whose metric is missing on either side is reported
and skipped. The first candidate of a pipeline is promoted.

`win_rate_vs_champion` is measured against the champion itself: the head-to-head stage
(`posttrain.stages.head_to_head`) has both exports answer the same held-out prompts and the
candidate run's reward model judge each pair. Its champion side is the champion against itself,
a draw on every prompt (0.5), not whatever the champion scored when it was a candidate (that was
against an older champion). A metric the gate tried and failed to measure blocks promotion (see
`Unmeasured`); one that does not apply (no reward model, champion export deleted) is skipped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from posttrain.config.schema import PromotionRule, ResolvedRecipe
from posttrain.runtime.spec import PlannedStage
from posttrain.store.artifacts import ArtifactRef, atomic_write_text, fingerprint, stage_dir

WIN_RATE_VS_CHAMPION = "win_rate_vs_champion"
# The champion side of metrics measured against the champion itself: what the champion scores
# against itself. A model facing itself answers every prompt identically (same weights, same
# sampling, same seed), so every prompt is a tie: win-rate (0 + n/2)/n = 0.5.
CHAMPION_BASELINES: dict[str, float] = {WIN_RATE_VS_CHAMPION: 0.5}

HEAD_TO_HEAD = "head_to_head"
HEAD_TO_HEAD_MODULE = "posttrain.stages.head_to_head"
# Bump when a change to the stage's code should invalidate its cached artifacts.
HEAD_TO_HEAD_VERSION = "2"
# The artifacts the head-to-head reads, in the order their fingerprints are hashed: the
# candidate's and the champion's exports, and the candidate run's reward model and its base.
HEAD_TO_HEAD_PARENTS = ("candidate", "champion", "reward_model", "base")


@dataclass
class RuleResult:
    metric: str
    direction: str
    tolerance: float
    candidate: float | None
    champion: float | None
    # True when the candidate is worse than the champion by more than the tolerance
    regressed: bool = False
    # Why the rule was not compared, when the gate knows (e.g. "no reward stage")
    note: str = ""

    @property
    def compared(self) -> bool:
        return self.candidate is not None and self.champion is not None


@dataclass
class Decision:
    promoted: bool
    reason: str
    rows: list[RuleResult] = field(default_factory=list)
    # Report lines under the table, e.g. the head-to-head's counts
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Unmeasured:
    """Why the candidate has no value for a rule's metric."""

    reason: str
    # True when the measurement was attempted and failed: the candidate is then not promoted,
    # since an unknown result is no evidence of "no regression". False when it does not apply
    # (no reward model to judge with, the champion's export is gone): the rule is skipped.
    blocks: bool = False


def compare(
    candidate: dict[str, Any],
    champion: dict[str, Any] | None,
    rules: list[PromotionRule],
    unmeasured: dict[str, Unmeasured] | None = None,
) -> Decision:
    """Rule-by-rule comparison of metric dicts; see the module docstring. `unmeasured`: metric
    -> why the candidate lacks it (shown in its row; a blocking one refuses promotion)."""
    unmeasured = unmeasured or {}
    rows = []
    for r in rules:
        theirs = None
        if champion is not None:
            theirs = CHAMPION_BASELINES.get(r.metric, _num(champion, r.metric))
        row = RuleResult(r.metric, r.direction, r.tolerance, _num(candidate, r.metric), theirs)
        if row.candidate is None and r.metric in unmeasured:
            row.note = unmeasured[r.metric].reason
        if row.compared:
            assert row.candidate is not None and row.champion is not None
            diff = row.candidate - row.champion  # > 0: worse where lower is better
            row.regressed = (diff if r.direction == "min" else -diff) > r.tolerance
        rows.append(row)
    if champion is None:
        return Decision(True, "first candidate of this pipeline", rows)
    problems = []
    bad = [r for r in rows if r.regressed]
    if bad:
        what = ", ".join(
            f"{r.metric} {r.candidate:.4g} vs champion {r.champion:.4g} "
            f"({'lower' if r.direction == 'max' else 'higher'} beyond tolerance {r.tolerance:g})"
            for r in bad
        )
        problems.append(f"regressed: {what}")
    blocked = [
        unmeasured[r.metric].reason
        for r in rows
        if r.candidate is None and r.metric in unmeasured and unmeasured[r.metric].blocks
    ]
    problems += list(dict.fromkeys(blocked))  # one rule per metric is the norm; no repeats
    if problems:
        return Decision(False, "; ".join(problems), rows)
    return Decision(True, "no metric regressed beyond its tolerance", rows)


def _num(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else None


def uses_metric(rules: list[PromotionRule], metric: str) -> bool:
    return any(r.metric == metric for r in rules)


def head_to_head_stage(recipe: ResolvedRecipe, parents: dict[str, ArtifactRef]) -> PlannedStage:
    """The head-to-head of a candidate export against the champion's, planned like a stage:
    fingerprint, folder `<workspace>/artifacts/head_to_head/<fingerprint>/`, one process.

    `parents` holds HEAD_TO_HEAD_PARENTS. The fingerprint covers their fingerprints (so the
    same candidate against the same champion, judged by the same reward model, is reused) and
    the evaluate fields the stage reads; swapping candidate and champion is another artifact.
    """
    missing = [p for p in HEAD_TO_HEAD_PARENTS if p not in parents]
    if missing:
        raise ValueError(f"head-to-head needs the artifacts {', '.join(missing)}")
    cfg = recipe.evaluate
    inputs = {
        "section": {
            "win_rate_prompts": cfg.win_rate_prompts,
            "win_rate_sampling": cfg.win_rate_sampling.model_dump(mode="json"),
            # Generation seeds batch k with seed + k: the batch size changes sampled answers.
            "batch_size": cfg.batch_size,
        },
        "seed": recipe.run.seed,
        "precision": recipe.infra.precision,
        "device": recipe.infra.device,
    }
    fps = {p: parents[p].fingerprint for p in HEAD_TO_HEAD_PARENTS}
    fp = fingerprint(HEAD_TO_HEAD, HEAD_TO_HEAD_VERSION, inputs, fps)
    return PlannedStage(
        name=HEAD_TO_HEAD,
        module=HEAD_TO_HEAD_MODULE,
        fingerprint=fp,
        out_dir=stage_dir(recipe.run.workspace, HEAD_TO_HEAD, fp),
        parents=fps,
        nprocs=1,
        timeout_s=recipe.infra.timeouts.head_to_head,
        inputs=inputs,
    )


def registry_path(workspace: str | Path, name: str) -> Path:
    return Path(workspace) / "registry" / f"{name}.json"


def read_registry(workspace: str | Path, name: str) -> dict[str, Any]:
    path = registry_path(workspace, name)
    if not path.exists():
        return {"name": name, "champion": None, "history": []}
    return json.loads(path.read_text())


def record_decision(
    workspace: str | Path, name: str, candidate: dict[str, Any], decision: Decision
) -> dict[str, Any]:
    """Append the decision to the pipeline's history and, when promoted, make `candidate` (run id,
    metrics, export path, lineage) the champion. Written atomically; returns the registry."""
    reg = read_registry(workspace, name)
    entry = {
        **candidate,
        "decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "promoted": decision.promoted,
        "reason": decision.reason,
        "comparison": [asdict(r) for r in decision.rows],
    }
    reg["history"].append(entry)
    if decision.promoted:
        reg["champion"] = {k: v for k, v in entry.items() if k != "comparison"}
    atomic_write_text(registry_path(workspace, name), json.dumps(reg, indent=2))
    return reg


def champions(workspace: str | Path) -> list[dict[str, Any]]:
    """The champion of every pipeline in the workspace, by name."""
    folder = Path(workspace) / "registry"
    out = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        reg = json.loads(path.read_text())
        if reg.get("champion"):
            out.append({"name": reg["name"], **reg["champion"]})
    return out


def comparison_markdown(decision: Decision) -> list[str]:
    """Report lines: the outcome, a candidate-vs-champion table and the decision's notes."""
    lines = [
        f"**{'promoted' if decision.promoted else 'not promoted'}**: {decision.reason}",
        "",
        "| metric | better | tolerance | candidate | champion | regressed | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in decision.rows:
        cells = (
            r.metric,
            "lower" if r.direction == "min" else "higher",
            f"{r.tolerance:g}",
            "-" if r.candidate is None else f"{r.candidate:.4g}",
            "-" if r.champion is None else f"{r.champion:.4g}",
            "yes" if r.regressed else ("no" if r.compared else "n/a"),
            r.note.replace("|", "/"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    if decision.notes:
        lines += ["", *(f"- {n}" for n in decision.notes)]
    return lines
