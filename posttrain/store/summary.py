"""A stage's summary, typed: what its `run(ctx)` returns, sealed into its manifest (`summary`).

The stage harness (`posttrain.stages.common`) validates what `run` returns into `Summary`, adds
the memory it measured and what this launch recovered from, and writes it; the flow reads it
back once per stage (`read_summary`) and hands the parsed summary along. The fields below are
the ones the flow, the gate and the report read; whatever else a stage records (ingest's
`chat_template_sha256`, a head-to-head's `wins`) is kept as written, as extra fields.

A summary that does not validate in a sealed manifest is a damaged artifact, one clear error
(`ArtifactDamaged`): the summary was written by this model, so nothing reads around it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.store.artifacts import MANIFEST


class ArtifactDamaged(ValueError):
    """A sealed artifact whose manifest cannot be read, or whose summary is not a summary."""


class Gate(BaseModel):
    """A quality gate's verdict (decision 13): the flow stops the run when `passed` is false.
    Its stage adds the numbers it judged (`accuracy`, `min_accuracy`, ...)."""

    model_config = ConfigDict(extra="allow")

    passed: bool
    message: str = ""


class Memory(BaseModel):
    """A training stage's memory pre-flight estimate beside the peak this process measured
    (`posttrain.stages.common.measured_memory`)."""

    model_config = ConfigDict(extra="forbid")

    estimate_gib: float
    measured: str = Field(description="What was measured: `peak RSS` (CPU) or `peak reserved`.")
    measured_peak_gib: float
    capacity_gib: float | None = None
    fits: bool | None = None
    peak_allocated_gib: float | None = None  # GPU only
    estimate_over_measured: float | None = None  # absent when nothing was measured


class Recovery(BaseModel):
    """What a launch recovered from (`posttrain.runtime.recovery.recovery_record`)."""

    model_config = ConfigDict(extra="forbid")

    earlier_attempt: str | None = None
    resumed_from_step: int | None = None
    rejected_checkpoints: list[str] = Field(default_factory=list)


class Summary(BaseModel):
    """A stage's summary; extra fields are the stage's own."""

    model_config = ConfigDict(extra="allow")

    headline: dict[str, Any] = Field(
        default_factory=dict, description="The few key metrics the stage chose to show."
    )
    gate: Gate | None = None
    memory: Memory | None = None
    recovery: Recovery | None = None
    # evaluate: `evaluate.policies` side by side, policy name -> its row.
    policies: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # ingest: the base model's folder (what a new-base event names).
    model_dir: str | None = None
    # Training stages: this launch resumed from that step (> 0), and the checkpoints it
    # rejected as damaged; stage_main turns them into `recovery`.
    resumed_from_step: int | None = None
    rejected_checkpoints: list[str] = Field(default_factory=list)

    def sealed(self) -> dict[str, Any]:
        """The manifest's `summary`: the fields the stage set, nothing defaulted added."""
        return self.model_dump(exclude_unset=True)


def read_summary(folder: Path) -> Summary:
    """The summary of the sealed artifact in `folder`. Raises ArtifactDamaged naming the file
    and what is wrong."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        return Summary.model_validate(manifest["summary"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = _why(exc)
        raise ArtifactDamaged(f"the artifact in {folder} is damaged: {path.name} {why}") from None


def _why(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"has no valid summary ({where or 'summary'}: {first['msg']})"
    if isinstance(exc, KeyError):
        return "has no summary"
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    return f"is not a JSON object ({exc})"
