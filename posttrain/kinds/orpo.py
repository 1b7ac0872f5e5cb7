"""orpo: the recipe section of the ORPO stage (reference-free preference tuning).

The stage itself is `posttrain/stages/orpo.py`; its loss is `orpo_loss` in
`posttrain/train/preference_losses.py`.
"""

from __future__ import annotations

from pydantic import Field

from posttrain.kinds._kind import seq_memory, trainer
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


KIND = trainer(
    name="orpo",
    section=ORPOConfig,
    module="posttrain.stages.orpo",
    help="ORPO: reference-free preference tuning (NLL + odds ratio), from a policy or the base.",
    order=33,
    version="2",
    consumes=("policy",),
    data="pairs",
    new_adapter_from_base=True,
    # Chosen and rejected through the policy only: no reference adapter at all.
    memory=seq_memory("pairs", "policy"),
    # Each row's log-prob sums are all-reduced over the group (models.sequence_split).
    sequence_parallel=True,
)
