"""orpo: the recipe section of the ORPO stage (reference-free preference tuning).

The stage itself is `posttrain/stages/orpo.py`; its loss is `orpo_loss` in
`posttrain/train/preference_losses.py`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from posttrain.kinds._kind import MemoryInputs, StageKind
from posttrain.sections.fields import Result
from posttrain.sections.shared import (
    LoraConfig,
    PreferenceDataConfig,
    TemplateGuard,
    TrainingSection,
)


class ORPOConfig(TrainingSection, TemplateGuard):
    """ORPO (Hong et al., 2024): NLL of the chosen response + beta x an odds-ratio penalty that
    favours chosen over rejected; one policy forward per pair and no reference model."""

    data: PreferenceDataConfig = Field(description="Preference pairs.")
    beta: float = Result(
        0.1,
        gt=0,
        description="Weight of the odds-ratio term against the chosen response's NLL (the "
        "paper's lambda; TRL's `beta`). Rewards in the metrics are beta x mean token log-prob.",
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="Adapter shape when ORPO starts from the base model (`from: ingest`); "
        "ignored when it continues a policy's adapter (that adapter's shape is kept).",
    )


def _memory(section: ORPOConfig, m: MemoryInputs) -> Any:
    from posttrain.memory.estimate import StageShape

    # Chosen and rejected through the policy only: no reference adapter at all.
    return StageShape("pairs", seq_len=section.data.max_seq_len, adapters=(m.policy,), **m.common)


KIND = StageKind(
    name="orpo",
    section=ORPOConfig,
    module="posttrain.stages.orpo",
    help="ORPO: reference-free preference tuning (NLL + odds ratio), from a policy or the base.",
    order=33,
    produces="policy",
    # 2: fingerprints by rule (fields and kinds decide, parents by role).
    version="2",
    consumes=("policy",),
    data="pairs",
    trains=True,
    reads=("run", "infra", "guard"),
    distributed=True,
    new_adapter_from_base=True,
    memory=_memory,
)
