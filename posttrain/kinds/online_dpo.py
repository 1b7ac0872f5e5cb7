"""online_dpo: DPO on the policy's own samples, judged on the fly (online DPO, Guo et al. 2024;
TRL's `OnlineDPOTrainer`).

Each step the policy samples `rollout.samples_per_prompt` answers per prompt (the online-RL
rollout engine), the judge scores them - the reward model (`reward_model`), the reward
functions (`rewards`), or both summed, as GRPO's rollouts are scored - and each prompt's best
and worst answers are a (chosen, rejected) pair for one DPO step against the frozen reference.
The stage process is `posttrain.stages.online_dpo`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.kinds._online import online_kind, refuse_rl_fields
from posttrain.sections.fields import Result
from posttrain.sections.shared import KLConfig, OnlineRLConfig, RolloutConfig


class OnlineDPOConfig(OnlineRLConfig):
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(prompts_per_step=8, samples_per_prompt=4),
        description="Generation; samples_per_prompt answers per prompt are judged and the best "
        "and worst form its pair (>= 2).",
    )
    kl: KLConfig = Field(
        default_factory=lambda: KLConfig(coef=0.0),
        description="Only `estimator` is read, for the held-out KL; DPO's `beta` is its KL "
        "constraint (coef must stay 0).",
    )
    loss: Literal["sigmoid", "ipo", "robust", "hinge", "simpo"] = Result(
        "sigmoid",
        description="Preference loss of each pair, as dpo.loss: sigmoid (DPO), ipo, robust, "
        "hinge (SLiC), simpo (reference-free, length-normalised).",
    )
    beta: float = Result(0.1, gt=0, description="DPO's strength of the implicit KL constraint.")
    label_smoothing: float = Result(
        0.0, ge=0, lt=0.5, description="Assumed judge-label noise (sigmoid, robust, simpo)."
    )
    simpo_gamma: float = Result(0.5, ge=0, description="SimPO target reward margin.")
    tie_eps: float = Result(
        0.0,
        ge=0,
        description="A prompt whose best and worst answers score within tie_eps of each other "
        "gives no pair (skipped, counted as `all_equal`).",
    )

    @model_validator(mode="after")
    def _online_dpo(self) -> OnlineDPOConfig:
        if self.rollout.samples_per_prompt < 2:
            raise ValueError(
                "rollout.samples_per_prompt must be >= 2: a prompt's pair is its best and worst "
                "answer"
            )
        refuse_rl_fields(
            self,
            "online DPO",
            "`beta` is its constraint to the reference",
            "one DPO step per rollout (`loss`, `beta`)",
        )
        return self


KIND = online_kind(
    critic=False,
    name="online_dpo",
    section=OnlineDPOConfig,
    module="posttrain.stages.online_dpo",
    help="Online DPO: the policy's own answers judged by the reward model and/or reward "
    "functions, each prompt's best vs worst trained as a DPO pair against the reference.",
    order=55,
    # 2: the held-out KL (eval_kl, max_kl) is kl.estimator's (was k1).
    version="2",
    consumes=("policy", "reference", "reward_model"),
    # The pairs' rows are split over the group and their log-prob sums all-reduced
    # (rl.online_dpo.sequence_logps).
    sequence_parallel=True,
)
