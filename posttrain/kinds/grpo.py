"""grpo: the GRPO family (group- or batch-relative advantages, no critic) against a reward
model: grpo, dr_grpo, dapo, rloo, reinforce_pp (`posttrain.rl.algorithms`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.kinds._online import online_kind
from posttrain.rl.algorithms import ALGORITHMS
from posttrain.sections.fields import Result
from posttrain.sections.shared import KLConfig, OnlineRLConfig, RolloutConfig


class GRPOConfig(OnlineRLConfig):
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(prompts_per_step=8, samples_per_prompt=4),
        description="Generation; samples_per_prompt is the group size (>= 2).",
    )
    kl: KLConfig = Field(
        default_factory=lambda: KLConfig(estimator="k3", coef=0.04),
        description="KL penalty against the reference (in the loss, k3, by default).",
    )
    scale_rewards: bool = Result(
        True, description="Divide group-centred rewards by the group's standard deviation."
    )
    algorithm: Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp"] = Result(
        "grpo",
        description="`grpo`: score minus group mean over group std, token-mean loss (the paper "
        "averaged per response: loss_aggregation sequence_mean). `dr_grpo` (Dr. GRPO): no std "
        "scaling, each response's token sum over max_new_tokens. `dapo` (DAPO): clip-higher "
        "(clip_range_high 0.28), token-mean loss, no KL, dynamic sampling. `rloo`: score minus "
        "the mean of the other samples of its prompt, KL in the reward. `reinforce_pp` "
        "(REINFORCE++): KL-shaped token rewards, return-to-go, whitened over the whole batch. "
        "Each sets the fields it changes (its presets) unless the recipe sets them.",
    )

    @model_validator(mode="after")
    def _presets(self) -> GRPOConfig:
        """The algorithm's presets on the fields the recipe left out, and its loss aggregation
        when none is set: the validated section holds the values the run uses."""
        if self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "rollout.samples_per_prompt must be >= 2: GRPO's advantage compares the samples "
                "of one prompt with each other"
            )
        algo = ALGORITHMS[self.algorithm]
        for path, value in algo.presets.items():
            head, _, leaf = path.partition(".")
            if not leaf:
                if head not in self.model_fields_set:
                    self.__dict__[head] = value  # not an assignment: the user did not set it
            elif (
                head not in self.model_fields_set
                or leaf not in getattr(self, head).model_fields_set
            ):
                # A default sub-section (kl) is built with explicit values: only a recipe that
                # gives the sub-section and the leaf has set it.
                self.__dict__[head] = getattr(self, head).model_copy(update={leaf: value})
        if self.loss_aggregation is None:
            self.__dict__["loss_aggregation"] = algo.loss_aggregation
        if self.algorithm == "reinforce_pp" and self.scale_rewards:
            raise ValueError(
                "scale_rewards: reinforce_pp whitens advantages over the whole batch, there is "
                "no group std to divide by; leave it out or set false"
            )
        return self


KIND = online_kind(
    critic=False,
    name="grpo",
    section=GRPOConfig,
    module="posttrain.stages.grpo",
    help="GRPO against a reward model (needs one: `reward_model`).",
    order=50,
    # 3: the reported, gated and adapted-to KL is kl.estimator's (was k1).
    version="3",
    consumes=("policy", "reference", "reward_model"),
    # Its scoring and update forwards split the sampled rows (`posttrain.rl.rollout.sp_shard`);
    # on the `hf` rollout engine only (posttrain.config.sp_check).
    sequence_parallel=True,
)
