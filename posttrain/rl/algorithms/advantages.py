"""How a scored rollout becomes per-token advantages (and value targets, with a critic): the
advantage functions the registry (`posttrain.rl.algorithms`) names, pure and hand-tested, and
the rollout's KL and shaped scores they (and online DPO's judge, the metrics) read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.rl.losses import (
    Reduce,
    gae,
    group_advantages,
    kl_penalty,
    leave_one_out_advantages,
    masked_whiten,
    token_rewards,
)
from posttrain.rl.rollout.sample import Rollout


def shaped_scores(ro: Rollout, cfg: Any) -> torch.Tensor:
    """Scores [N], with the recipe's penalty for responses that never stopped."""
    scores = ro.scored["scores"].clone()
    if cfg.missing_eos_penalty is not None:
        scores[~ro.stopped] += cfg.missing_eos_penalty
    return scores


def rollout_kl(ro: Rollout, estimator: str) -> torch.Tensor:
    """[N, R] per-token KL(policy || reference) estimate of the rollout as scored; zeros when
    a pass was skipped because the KL does not count (`posttrain.rl.setup.scoring_passes`)."""
    if "ref_logps" not in ro.scored or "logps" not in ro.scored:
        return torch.zeros_like(ro.mask)
    return kl_penalty(ro.scored["logps"], ro.scored["ref_logps"], estimator)


def sequence_kl(ro: Rollout, estimator: str) -> torch.Tensor:
    """[N] KL(policy || reference) estimate of each response: the sum over its tokens."""
    return (rollout_kl(ro, estimator) * ro.mask).sum(1)


def _sequence_scores(ro: Rollout, cfg: Any, kl_coef: float) -> torch.Tensor:
    """[N] shaped scores, minus kl_coef x each response's KL when the KL goes in the reward."""
    scores = shaped_scores(ro, cfg)
    return scores - kl_coef * sequence_kl(ro, cfg.kl.estimator) if kl_coef else scores


def _token_rewards(ro: Rollout, cfg: Any, kl_coef: float) -> torch.Tensor:
    """[N, R]: the shaped score at the last token, minus kl_coef x KL at every token."""
    return token_rewards(shaped_scores(ro, cfg), rollout_kl(ro, cfg.kl.estimator), ro.mask, kl_coef)


def ppo_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the critic's values, whitened over the whole rollout (all ranks)."""
    rewards = _token_rewards(ro, cfg, kl_coef)
    adv, returns = gae(rewards, ro.scored["values"], ro.mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, ro.mask, reduce=reduce)
    return adv, returns


def grpo_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, None]:
    """Each response's score compared with the other samples of its prompt, the same
    advantage at every token."""
    scores = _sequence_scores(ro, cfg, kl_coef)
    adv = group_advantages(scores, cfg.rollout.samples_per_prompt, cfg.scale_rewards)
    return adv[:, None] * ro.mask, None


def rloo_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, None]:
    """Each response's score minus the mean of the other samples of its prompt, at every token;
    divided by the group's standard deviation only when `scale_rewards` is set."""
    scores = _sequence_scores(ro, cfg, kl_coef)
    k = cfg.rollout.samples_per_prompt
    adv = leave_one_out_advantages(scores, k)
    if cfg.scale_rewards:
        adv = adv / (scores.view(-1, k).std(dim=1, keepdim=True).expand(-1, k).reshape(-1) + 1e-4)
    return adv[:, None] * ro.mask, None


def reinforce_pp_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, None]:
    """Return-to-go (GAE over zero values, gamma = lam = 1) whitened over the whole global
    batch (all ranks): the batch, not the group, is the baseline."""
    rewards = _token_rewards(ro, cfg, kl_coef)
    returns, _ = gae(rewards, torch.zeros_like(rewards), ro.mask, 1.0, 1.0)  # [N, R]
    return masked_whiten(returns, ro.mask, reduce=reduce), None


# (rollout, recipe section, KL coefficient applied to rewards (0 = KL not in the reward), reduce)
# -> (advantages [N, R], value targets [N, R] or None)
AdvantageFn = Callable[
    [Rollout, Any, float, Reduce | None], tuple[torch.Tensor, torch.Tensor | None]
]

# The advantage functions by the name an algorithm gives (`posttrain.rl.algorithms.ALGORITHMS`).
ADVANTAGES: dict[str, AdvantageFn] = {
    f.__name__: f
    for f in (ppo_advantages, grpo_advantages, rloo_advantages, reinforce_pp_advantages)
}
