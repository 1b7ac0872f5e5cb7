"""What differs between PPO and the GRPO family, as a small registry; everything else
(rollouts, scoring, KL estimation, the clipped update, metrics, checkpoints) is one shared loop in
`posttrain.stages.online_rl`.

An algorithm says whether it trains a critic, where the KL penalty goes by default, how the
update aggregates per-token losses by default, how a scored rollout becomes per-token advantages
(and value targets, with a critic), and its presets: recipe fields it changes when the recipe
does not set them (applied when the section is validated, so `posttrain config` shows them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.train.rl_losses import (
    Reduce,
    gae,
    group_advantages,
    kl_penalty,
    leave_one_out_advantages,
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


def rloo_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, None]:
    """RLOO: each response's score (minus kl_coef x its KL: the KL goes in the reward) minus the
    mean of the other samples of its prompt, the same advantage at every token; divided by the
    group's standard deviation only when `scale_rewards` is set (off by the preset); no critic."""
    scores = shaped_scores(ro, cfg)
    if kl_coef:
        scores = scores - kl_coef * sequence_kl(ro, cfg.kl.estimator)
    k = cfg.rollout.samples_per_prompt
    adv = leave_one_out_advantages(scores, k)
    if cfg.scale_rewards:
        adv = adv / (scores.view(-1, k).std(dim=1, keepdim=True).expand(-1, k).reshape(-1) + 1e-4)
    return adv[:, None] * ro.mask, None


def reinforce_pp_advantages(
    ro: Rollout, cfg: Any, kl_coef: float, reduce: Reduce | None
) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (Hu 2025): per-token rewards (-kl_coef x KL at every token, the score at the
    last), return-to-go with gamma 1 and no critic (GAE over zero values with gamma = lam = 1),
    whitened over the whole global batch (all ranks): the batch, not the group, is the baseline."""
    kl = kl_penalty(ro.scored["logps"], ro.scored["ref_logps"], cfg.kl.estimator)
    rewards = token_rewards(shaped_scores(ro, cfg), kl, ro.mask, kl_coef)
    returns, _ = gae(rewards, torch.zeros_like(rewards), ro.mask, 1.0, 1.0)  # [N, R]
    return masked_whiten(returns, ro.mask, reduce=reduce), None


@dataclass(frozen=True)
class Algorithm:
    name: str
    critic: bool
    kl_placement: str  # where `kl.placement: auto` puts the penalty: "reward" or "loss"
    advantages: AdvantageFn
    loss_aggregation: str = "token_mean"  # see rl_losses.loss_weights
    # Recipe fields (dotted paths in the section) set when the recipe leaves them out.
    presets: dict[str, Any] = field(default_factory=dict)


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("ppo", critic=True, kl_placement="reward", advantages=ppo_advantages),
        # The paper averages each response's tokens, then the responses (`sequence_mean`); the
        # token mean over the minibatch has been the default here since GRPO was added.
        Algorithm("grpo", critic=False, kl_placement="loss", advantages=grpo_advantages),
        # Dr. GRPO (Liu et al. 2025): no std scaling and no per-response length normalisation.
        Algorithm(
            "dr_grpo",
            critic=False,
            kl_placement="loss",
            advantages=grpo_advantages,
            loss_aggregation="token_sum_norm",
            presets={"scale_rewards": False},
        ),
        # DAPO (Yu et al. 2025): clip-higher, token-level loss, no KL, dynamic sampling.
        Algorithm(
            "dapo",
            critic=False,
            kl_placement="loss",
            advantages=grpo_advantages,
            presets={"clip_range_high": 0.28, "kl.coef": 0.0, "dynamic_sampling": True},
        ),
        Algorithm(
            "rloo",
            critic=False,
            kl_placement="reward",
            advantages=rloo_advantages,
            presets={"scale_rewards": False},
        ),
        Algorithm(
            "reinforce_pp",
            critic=False,
            kl_placement="reward",
            advantages=reinforce_pp_advantages,
            presets={"scale_rewards": False},
        ),
    )
}
