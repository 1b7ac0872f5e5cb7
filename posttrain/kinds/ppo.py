"""ppo: PPO with a value head against a reward model, KL to a reference policy."""

from __future__ import annotations

from posttrain.kinds._online import online_kind
from posttrain.sections.fields import Result
from posttrain.sections.shared import OnlineRLConfig


class PPOConfig(OnlineRLConfig):
    gamma: float = Result(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Result(0.95, ge=0, le=1, description="GAE lambda.")
    value_clip: float = Result(0.2, gt=0, description="Value clip around the rollout's values.")
    vf_coef: float = Result(0.1, ge=0, description="Value-loss weight.")
    whiten_advantages: bool = Result(True, description="Normalise advantages over the rollout.")


KIND = online_kind(
    critic=True,
    name="ppo",
    section=PPOConfig,
    module="posttrain.stages.ppo",
    help="PPO against a reward model (needs one: `reward_model`).",
    order=40,
    # 3: the reported, gated and adapted-to KL is kl.estimator's (was k1).
    version="3",
    consumes=("policy", "reference", "reward_model"),
    sequence_parallel=True,
)
