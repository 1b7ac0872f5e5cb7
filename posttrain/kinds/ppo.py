"""ppo: PPO with a value head against a reward model, KL to a reference policy."""

from __future__ import annotations

from typing import Any

from posttrain.kinds._kind import MemoryInputs, StageKind
from posttrain.kinds._online import rollout_inputs, rollout_memory
from posttrain.sections.fields import Result
from posttrain.sections.shared import OnlineRLConfig


class PPOConfig(OnlineRLConfig):
    gamma: float = Result(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Result(0.95, ge=0, le=1, description="GAE lambda.")
    value_clip: float = Result(0.2, gt=0, description="Value clip around the rollout's values.")
    vf_coef: float = Result(0.1, ge=0, description="Value-loss weight.")
    whiten_advantages: bool = Result(True, description="Normalise advantages over the rollout.")


def _memory(section: PPOConfig, m: MemoryInputs) -> Any:
    return rollout_memory(section, m, critic=True)


KIND = StageKind(
    name="ppo",
    section=PPOConfig,
    module="posttrain.stages.ppo",
    help="PPO against a reward model (needs one: `reward_model`).",
    order=40,
    produces="policy",
    # 2: fingerprints by rule (fields and kinds decide, parents by role).
    version="2",
    consumes=("policy", "reference", "reward_model"),
    data="prompts",
    trains=True,
    reads=("run", "infra", "guard"),
    distributed=True,
    inputs=rollout_inputs,
    memory=_memory,
)
