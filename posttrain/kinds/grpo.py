"""grpo: GRPO (group-relative advantages, no critic) against a reward model."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from posttrain.config.sections import KLConfig, OnlineRLConfig, RolloutConfig
from posttrain.kinds._kind import MemoryInputs, StageKind
from posttrain.kinds._online import rollout_memory


class GRPOConfig(OnlineRLConfig):
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(prompts_per_step=8, samples_per_prompt=4),
        description="Generation; samples_per_prompt is the group size (>= 2).",
    )
    kl: KLConfig = Field(
        default_factory=lambda: KLConfig(estimator="k3", coef=0.04),
        description="KL penalty against the reference (in the loss, k3, by default).",
    )
    scale_rewards: bool = Field(
        True, description="Divide group-centred rewards by the group's standard deviation."
    )

    @model_validator(mode="after")
    def _groups(self) -> GRPOConfig:
        if self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "rollout.samples_per_prompt must be >= 2: GRPO's advantage compares the samples "
                "of one prompt with each other"
            )
        return self


def _memory(section: GRPOConfig, m: MemoryInputs) -> Any:
    return rollout_memory(section, m, critic=False)


KIND = StageKind(
    name="grpo",
    section=GRPOConfig,
    module="posttrain.stages.grpo",
    help="GRPO against a reward model (needs one: `reward_model`).",
    order=50,
    produces="policy",
    consumes=("policy", "reference", "reward_model"),
    data="prompts",
    trains=True,
    distributed=True,
    rank_dependent=True,
    memory=_memory,
)
