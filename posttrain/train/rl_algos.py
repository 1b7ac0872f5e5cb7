"""What differs between PPO and GRPO, as a small registry; everything else (rollouts, scoring,
KL estimation, the clipped update, metrics, checkpoints) is one shared loop in
`posttrain.stages.online_rl`.

An algorithm says whether it trains a critic, where the KL penalty goes by default, and how a
scored rollout becomes per-token advantages (and value targets, with a critic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.train.rl_losses import (
    Reduce,
    gae,
    group_advantages,
    kl_penalty,
    masked_whiten,
    token_rewards,
)
from posttrain.train.rollout import Rollout

# (rollout, recipe section, KL coefficient applied to rewards (0 = KL not in the reward), reduce)
# -> (advantages [N, R], value targets [N, R] or None)
AdvantageFn = Callable[
    [Rollout, Any, float, Reduce | None], tuple[torch.Tensor, torch.Tensor | None]
]


def shaped_scores(ro: Rollout, cfg: Any) -> torch.Tensor:
    """Reward-model scores [N], with the recipe's penalty for responses that never stopped."""
    scores = ro.scored["scores"].clone()
    if cfg.missing_eos_penalty is not None:
        scores[~ro.stopped] += cfg.missing_eos_penalty
    return scores


def sequence_kl(ro: Rollout, estimator: str) -> torch.Tensor:
    """[N] KL(policy || reference) estimate of each response: the sum over its tokens."""
    kl = kl_penalty(ro.scored["logps"], ro.scored["ref_logps"], estimator)
    return (kl * ro.mask).sum(1)


def ppo_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (score at the last token, minus kl_coef x KL at every token), GAE over
    the critic's values, advantages whitened over the whole rollout (all ranks)."""
    kl = kl_penalty(ro.scored["logps"], ro.scored["ref_logps"], cfg.kl.estimator)
    rewards = token_rewards(shaped_scores(ro, cfg), kl, ro.mask, kl_coef)
    adv, returns = gae(rewards, ro.scored["values"], ro.mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, ro.mask, reduce=reduce)
    return adv, returns


def grpo_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, None]:
    """Each response's score (minus kl_coef x its KL when the KL goes in the reward) compared
    with the other samples of its prompt, the same advantage at every token; no critic."""
    scores = shaped_scores(ro, cfg)
    if kl_coef:
        scores = scores - kl_coef * sequence_kl(ro, cfg.kl.estimator)
    adv = group_advantages(scores, cfg.rollout.samples_per_prompt, cfg.scale_rewards)
    return adv[:, None] * ro.mask, None


@dataclass(frozen=True)
class Algorithm:
    name: str
    critic: bool
    kl_placement: str  # where `kl.placement: auto` puts the penalty: "reward" or "loss"
    advantages: AdvantageFn


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", critic=True, kl_placement="reward", advantages=ppo_advantages),
        Algorithm("grpo", critic=False, kl_placement="loss", advantages=grpo_advantages),
    )
}
