"""A stage's summary, typed: what its `run(ctx)` returns, sealed into its manifest (`summary`).

The stage harness (`posttrain.stages.common`) validates what `run` returns, adds the memory it
measured and what the launch recovered from; the flow reads it back once per stage
(`read_summary`). The fields are what the flow, the gate and the report read; a stage's own
(ingest's `chat_template_sha256`, a head-to-head's `wins`) are kept as extra fields. A sealed
summary that does not validate is a damaged artifact (`ArtifactDamaged`), not read around.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.store.artifacts import MANIFEST


class ArtifactDamaged(ValueError):
    """A sealed artifact whose manifest cannot be read, or whose summary is not a summary."""


class Gate(BaseModel, extra="allow"):
    """A quality gate's verdict (decision 13): the flow stops the run when `passed` is false.
    Its stage adds the numbers it judged (`accuracy`, `min_accuracy`, ...)."""

    passed: bool
    message: str = ""


class Memory(BaseModel, extra="forbid"):
    """The memory pre-flight's estimate beside the peak the stage measured (`measured`: peak
    RSS on CPU, peak reserved on GPU; `posttrain.stages.common.measured_memory`)."""

    estimate_gib: float
    measured: str
    measured_peak_gib: float
    capacity_gib: float | None = None
    fits: bool | None = None
    peak_allocated_gib: float | None = None  # GPU only
    estimate_over_measured: float | None = None  # absent when nothing was measured
    # Tokens per forward the stage ran (`batch.by_tokens`, auto resolved) and, for auto, the
    # pre-flight's estimate at that budget: beside the measured peak.
    by_tokens: int | None = None
    by_tokens_estimate_gib: float | None = None


class Recovery(BaseModel, extra="forbid"):
    """What a launch recovered from (`posttrain.runtime.recovery.recovery_record`)."""

    earlier_attempt: str | None = None
    resumed_from_step: int | None = None
    rejected_checkpoints: list[str] = Field(default_factory=list)


class Summary(BaseModel):
    model_config = ConfigDict(extra="allow")  # the stage's own fields

    headline: dict[str, Any] = Field(default_factory=dict)  # the few metrics the stage shows
    gate: Gate | None = None
    memory: Memory | None = None  # training stages
    recovery: Recovery | None = None
    policies: dict[str, dict[str, Any]] = Field(default_factory=dict)  # evaluate.policies rows
    model_dir: str | None = None  # ingest: the base model's folder (a new-base event names it)
    # Training stages: the step this launch resumed from (> 0) and the checkpoints it rejected
    # as damaged; stage_main turns them into `recovery`.
    resumed_from_step: int | None = None
    rejected_checkpoints: list[str] = Field(default_factory=list)


def read_summary(folder: Path) -> Summary:
    """The summary of the sealed artifact in `folder`; ArtifactDamaged naming what is wrong."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
        return Summary.model_validate(manifest["summary"])
    except ValidationError as exc:
        first = exc.errors()[0]
        why = f"{'.'.join(map(str, first['loc'])) or 'summary'}: {first['msg']}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    raise ArtifactDamaged(
        f"the artifact in {folder} is damaged: its {MANIFEST} has no valid summary ({why})"
    )
