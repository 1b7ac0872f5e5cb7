"""distill: on-policy distillation from a teacher (GKD, Agarwal et al. 2024; TRL's GKDTrainer
with lmbda 1). The student samples answers to the prompts, the frozen teacher scores every token
of them, and the student minimises a divergence to the teacher's next-token distributions on
its own samples. The stage process is `posttrain.stages.distill`.

The teacher (`teacher:`) is a policy stage or a base of any base model whose tokenizer is the
student's; off-policy (sequence-level) distillation is an `sft` stage with a `teacher:` link.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.kinds._online import online_kind, refuse_rl_fields
from posttrain.sections.fields import Result
from posttrain.sections.shared import KLConfig, OnlineRLConfig, RolloutConfig


class DistillConfig(OnlineRLConfig):
    rollout: RolloutConfig = Field(
        default_factory=lambda: RolloutConfig(prompts_per_step=8, samples_per_prompt=1),
        description="The student's sampling of the answers the teacher scores.",
    )
    kl: KLConfig = Field(
        default_factory=lambda: KLConfig(coef=0.0),
        description="Only `estimator` is read, for the held-out KL to the starting policy; the "
        "loss is the divergence to the teacher (coef must stay 0).",
    )
    loss: Literal["reverse_kl", "forward_kl", "jsd"] = Result(
        "reverse_kl",
        description="Per-token divergence of the student from the teacher: reverse_kl "
        "KL(student || teacher), mode-seeking (GKD's on-policy default); forward_kl "
        "KL(teacher || student); jsd generalised Jensen-Shannon with `beta`.",
    )
    beta: float = Result(
        0.5,
        ge=0,
        le=1,
        description="jsd's interpolation (TRL's convention: 0 = forward KL, 1 = reverse KL).",
    )
    temperature: float = Result(
        1.0,
        gt=0,
        description="Both models' logits are divided by it inside the divergence (not the "
        "sampling temperature, which is rollout.temperature).",
    )
    reduction: Literal["token_mean", "sequence_mean"] = Result(
        "token_mean",
        description="token_mean: every answer token of the step weighs the same; "
        "sequence_mean: each answer's mean, averaged over answers.",
    )

    @model_validator(mode="after")
    def _distill(self) -> DistillConfig:
        refuse_rl_fields(
            self,
            "distillation",
            "its loss is the divergence to the teacher",
            "one step per rollout on the divergence (`loss`)",
        )
        if self.dynamic_sampling:
            raise ValueError(
                "dynamic_sampling: it keeps groups whose rewards differ; distillation trains "
                "on every answer (leave it off)"
            )
        return self


KIND = online_kind(
    critic=False,
    name="distill",
    section=DistillConfig,
    module="posttrain.stages.distill",
    help="On-policy distillation: the student samples, a frozen teacher (`teacher`) scores "
    "every token, the student minimises reverse KL / forward KL / JSD to it.",
    order=57,
    # 2: the held-out KL (eval_kl, max_kl) is kl.estimator's (was k1).
    version="2",
    consumes=("policy", "reference", "teacher"),
    token_teacher=True,
    # Student and teacher take the same shard of the packed rows, each rank scoring its own
    # tokens (rl.distill.micro_divergence); the teacher's base is checked by sp_check too.
    sequence_parallel=True,
)
