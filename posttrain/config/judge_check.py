"""`posttrain validate`'s word on each model-as-judge reward entry (`rewards: [{judge: ...}]`):
what it will ask and where, the columns its rubric reads against the data's, and a `command`
that runs `transformers serve` without the `serving` extra installed (one line saying what to
install, before any stage starts)."""

from __future__ import annotations

import importlib.util
import shlex
from typing import Any

from posttrain.sections.judge import JudgeConfig

SERVING_MODULES = ("fastapi", "uvicorn")  # what `transformers serve` imports


def judge_entries(recipe: Any) -> list[tuple[str, str, JudgeConfig]]:
    """(field path of the entry, stage field path, its judge) for every judge of the recipe."""
    out = []
    for s in recipe.graph():
        for i, spec in enumerate(getattr(s.section, "rewards", None) or []):
            if spec.judge is not None:
                out.append((f"{s.where}.rewards.{i}.judge", s.where, spec.judge))
    for i, spec in enumerate((recipe.evaluate and recipe.evaluate.verifiers) or []):
        if spec.judge is not None:
            out.append((f"evaluate.verifiers.{i}.judge", "evaluate", spec.judge))
    return out


def serving_problem(cfg: JudgeConfig) -> str | None:
    """Why `cfg.command` cannot start here (`transformers serve` without fastapi/uvicorn)."""
    if cfg.command is None:
        return None
    argv = shlex.split(cfg.command) if isinstance(cfg.command, str) else list(cfg.command)
    if argv[:2] != ["transformers", "serve"]:
        return None
    missing = [m for m in SERVING_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (
        f"command: `transformers serve` needs {', '.join(missing)} (not installed): "
        "pip install 'posttrain[serving]'"
    )


def check_judges(recipe: Any, peeks: dict[str, Any], report: Any) -> None:
    """A line per judge, or the problems that would stop its stage."""
    for where, stage, cfg in judge_entries(recipe):
        if problem := serving_problem(cfg):
            report.problems.append(f"{where}.{problem}")
            continue
        peek = peeks.get(stage)
        if peek is not None and peek.rows and all("columns" in r for _, r in peek.rows):
            for row_where, row in peek.rows:
                lacks = [c for c in cfg.columns if row["columns"].get(c) is None]
                if lacks:
                    report.problems.append(
                        f"{where}.rubric: {{{lacks[0]}}} is not a column of {row_where} (its "
                        f"columns: {', '.join(sorted(row['columns'])) or 'none'})"
                    )
                    break
        server = cfg.url or "a server the stage starts"
        rule = (
            f"number in [{cfg.range[0]:g}, {cfg.range[1]:g}]"
            if cfg.score == "number"
            else ("choice of " + ", ".join(cfg.choices))
        )
        report.lines.append(f"{where}: {cfg.model} at {server}, scored by {rule}")
