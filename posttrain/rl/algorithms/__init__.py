"""The online-RL algorithms, one registry: per name what the algorithm declares (critic or not,
where `kl.placement: auto` puts the KL, the default loss aggregation, its presets: recipe fields
it sets when the recipe leaves them out) and the function that turns a scored rollout into
per-token advantages (and value targets, with a critic), in `advantages`.

Everything else (rollouts, scoring, KL estimation, the clipped update, metrics, checkpoints) is
the one loop of `posttrain.rl.loop`. This module is torch-free, so validating a recipe (the flow
process, `posttrain config`) stays light: the advantage function is looked up by its name in
`posttrain.rl.algorithms.advantages.ADVANTAGES` by the step that computes advantages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Algorithm:
    name: str
    critic: bool
    kl_placement: str  # "reward" or "loss"
    # Its advantage function's name, in `posttrain.rl.algorithms.advantages.ADVANTAGES`.
    advantage: str
    loss_aggregation: str = "token_mean"  # see posttrain.rl.losses.loss_weights
    # Dotted paths in the section (`kl.coef`) -> the value set when the recipe leaves them out.
    presets: dict[str, Any] = field(default_factory=dict)


# Presets: RLOO, REINFORCE++ and Dr. GRPO do not scale the scores by their standard deviation.
NO_STD = {"scale_rewards": False}
DAPO = {"clip_range_high": 0.28, "kl.coef": 0.0, "dynamic_sampling": True}

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", critic=True, kl_placement="reward", advantage="ppo_advantages"),
        # The GRPO paper averages each response's tokens, then the responses (`sequence_mean`);
        # the token mean over the minibatch has been this project's default since GRPO was added.
        Algorithm("grpo", critic=False, kl_placement="loss", advantage="grpo_advantages"),
        # Dr. GRPO (Liu et al. 2025): no std scaling and no per-response length normalisation.
        Algorithm("dr_grpo", False, "loss", "grpo_advantages", "token_sum_norm", NO_STD),
        # DAPO (Yu et al. 2025): clip-higher, token-level loss, no KL, dynamic sampling.
        Algorithm("dapo", False, "loss", "grpo_advantages", presets=DAPO),
        # RLOO (Ahmadian et al. 2024): leave-one-out baseline, KL in the reward.
        Algorithm("rloo", False, "reward", "rloo_advantages", presets=NO_STD),
        # REINFORCE++ (Hu 2025): KL-shaped token rewards, return-to-go, batch-whitened advantages.
        Algorithm("reinforce_pp", False, "reward", "reinforce_pp_advantages", presets=NO_STD),
    )
}
