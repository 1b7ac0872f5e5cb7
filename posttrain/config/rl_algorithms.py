"""What each online-RL algorithm declares, as data: critic or not, where `kl.placement: auto`
puts the KL, the default loss aggregation, and its presets (recipe fields it sets when the recipe
leaves them out). Torch-free, so validating a recipe (the flow process, `posttrain config`) stays
light; `posttrain.train.rl_algos` pairs each entry with its advantage function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    critic: bool
    kl_placement: str  # "reward" or "loss"
    loss_aggregation: str = "token_mean"  # see rl_losses.loss_weights
    # Dotted paths in the section (`kl.coef`) -> the value set when the recipe leaves them out.
    presets: dict[str, Any] = field(default_factory=dict)


SPECS: dict[str, AlgorithmSpec] = {
    s.name: s
    for s in (
        AlgorithmSpec("ppo", critic=True, kl_placement="reward"),
        # The GRPO paper averages each response's tokens, then the responses (`sequence_mean`);
        # the token mean over the minibatch has been this project's default since GRPO was added.
        AlgorithmSpec("grpo", critic=False, kl_placement="loss"),
        # Dr. GRPO (Liu et al. 2025): no std scaling and no per-response length normalisation.
        AlgorithmSpec(
            "dr_grpo",
            critic=False,
            kl_placement="loss",
            loss_aggregation="token_sum_norm",
            presets={"scale_rewards": False},
        ),
        # DAPO (Yu et al. 2025): clip-higher, token-level loss, no KL, dynamic sampling.
        AlgorithmSpec(
            "dapo",
            critic=False,
            kl_placement="loss",
            presets={"clip_range_high": 0.28, "kl.coef": 0.0, "dynamic_sampling": True},
        ),
        # RLOO (Ahmadian et al. 2024): leave-one-out baseline, KL in the reward, no std scaling.
        AlgorithmSpec(
            "rloo", critic=False, kl_placement="reward", presets={"scale_rewards": False}
        ),
        # REINFORCE++ (Hu 2025): KL-shaped token rewards, return-to-go, batch-whitened advantages.
        AlgorithmSpec(
            "reinforce_pp", critic=False, kl_placement="reward", presets={"scale_rewards": False}
        ),
    )
}
