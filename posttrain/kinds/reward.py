"""reward: a Bradley-Terry reward model (LoRA + score head on the base) on preference pairs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import Field

from posttrain.kinds._kind import MemoryInputs, trainer
from posttrain.sections.fields import Result
from posttrain.sections.shared import (
    LoraConfig,
    PreferenceDataConfig,
    TemplateGuard,
    TrainingSection,
)


class RewardConfig(TrainingSection, TemplateGuard):
    data: PreferenceDataConfig = Field(description="Preference pairs.")
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="Adapter shape (the score head is trained in full)."
    )
    margin: float = Result(
        0.0,
        description="Bradley-Terry margin: loss = -log sigmoid(r_chosen - r_rejected - margin).",
    )
    min_accuracy: float | None = Result(
        None,
        ge=0,
        le=1,
        description="Quality gate: held-out pair accuracy below this stops the "
        "pipeline before any RL stage.",
    )


def _memory(section: RewardConfig, m: MemoryInputs) -> Any:
    from posttrain.memory.estimate import StageShape

    own = replace(m.reward_model, role="reward", trainable=True)
    return StageShape(
        "score",
        seq_len=section.data.max_seq_len,
        adapters=(own,),
        score_head="trainable",
        **m.common,
    )


KIND = trainer(
    name="reward",
    section=RewardConfig,
    module="posttrain.stages.reward",
    help="Reward model (its weights start from the base; `from` names the policy whose chat "
    "template it must share).",
    order=20,
    produces="reward_model",
    version="2",
    consumes=("policy",),
    data="pairs",
    memory=_memory,
    # Each row's score is read where its last token lies and summed over the group.
    sequence_parallel=True,
)
