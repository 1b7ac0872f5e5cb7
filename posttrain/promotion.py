"""The promotion gate: is a run's candidate better than the current champion of its pipeline?

A pipeline (recipe `run.name`) has at most one champion, recorded in
`<workspace>/registry/<name>.json` with the decision history. After a run, the candidate's
metrics (the evaluate stage's headline) are compared with the champion's, rule by rule from
`promotion.rules` (metric, direction, absolute tolerance). The candidate is promoted only if no
rule regresses beyond its tolerance; a rule whose metric is missing on either side is reported
and skipped. The first candidate of a pipeline is promoted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from posttrain.artifacts import atomic_write_text
from posttrain.config.schema import PromotionRule


@dataclass
class RuleResult:
    metric: str
    direction: str
    tolerance: float
    candidate: float | None
    champion: float | None
    # True when the candidate is worse than the champion by more than the tolerance
    regressed: bool = False

    @property
    def compared(self) -> bool:
        return self.candidate is not None and self.champion is not None


@dataclass
class Decision:
    promoted: bool
    reason: str
    rows: list[RuleResult] = field(default_factory=list)

    def regressions(self) -> list[RuleResult]:
        return [r for r in self.rows if r.regressed]


def compare(
    candidate: dict[str, Any], champion: dict[str, Any] | None, rules: list[PromotionRule]
) -> Decision:
    """Rule-by-rule comparison of metric dicts; see the module docstring."""
    if champion is None:
        rows = [
            RuleResult(r.metric, r.direction, r.tolerance, _num(candidate, r.metric), None)
            for r in rules
        ]
        return Decision(True, "first candidate of this pipeline", rows)
    rows = []
    for r in rules:
        row = RuleResult(
            r.metric, r.direction, r.tolerance, _num(candidate, r.metric), _num(champion, r.metric)
        )
        if row.compared:
            assert row.candidate is not None and row.champion is not None
            worse_by = (
                row.candidate - row.champion
                if r.direction == "min"
                else row.champion - row.candidate
            )
            row.regressed = worse_by > r.tolerance
        rows.append(row)
    bad = [r for r in rows if r.regressed]
    if bad:
        what = ", ".join(
            f"{r.metric} {r.candidate:.4g} vs champion {r.champion:.4g} "
            f"({'lower' if r.direction == 'max' else 'higher'} beyond tolerance {r.tolerance:g})"
            for r in bad
        )
        return Decision(False, f"regressed: {what}", rows)
    return Decision(True, "no metric regressed beyond its tolerance", rows)


def _num(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, int | float) else None


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
    path = registry_path(workspace, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(reg, indent=2))
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
    """Report lines: the outcome and a candidate-vs-champion table."""
    lines = [
        f"**{'promoted' if decision.promoted else 'not promoted'}**: {decision.reason}",
        "",
        "| metric | better | tolerance | candidate | champion | regressed |",
        "|---|---|---|---|---|---|",
    ]
    for r in decision.rows:
        cells = (
            r.metric,
            "lower" if r.direction == "min" else "higher",
            f"{r.tolerance:g}",
            "-" if r.candidate is None else f"{r.candidate:.4g}",
            "-" if r.champion is None else f"{r.champion:.4g}",
            "yes" if r.regressed else ("no" if r.compared else "n/a"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines
