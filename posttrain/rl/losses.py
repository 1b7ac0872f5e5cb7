"""The arithmetic of online RL (PPO, GRPO) as pure functions, tested against hand-computed values.

Shapes: B sequences, R response positions. `mask` [B, R] is 1.0 on the response tokens (up to and
including the EOS that ended it) and 0.0 on the padding after them, so every response is a
contiguous prefix of its row. Log-probs are per token, [B, R].

Distributed statistics (whitening, explained variance) take an optional `reduce` callable that
sums a small float64 tensor over ranks; without it they are local.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]


# Per-token estimators of KL(policy || reference) on tokens sampled from the policy. k3: with
# r = ref/policy, E_policy[r - 1 - log r] = KL(policy || ref), and every term is >= 0.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": lambda logp, ref_logp: logp - ref_logp,
    "k2": lambda logp, ref_logp: 0.5 * (logp - ref_logp) ** 2,
    "k3": lambda logp, ref_logp: torch.exp(ref_logp - logp) - 1 - (ref_logp - logp),
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """[B, R] per-token KL estimate; `estimator` is a key of KL_ESTIMATORS."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def token_logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) [B, R] from logits [B, R, V] that predict `tokens` [B, R]."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution [B, R] from logits [B, R, V]."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / std over the masked entries (over all ranks with `reduce`); the unbiased
    variance, as for a sample. Padding stays 0."""
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    if reduce is not None:
        stats = reduce(stats)
    s, s2, n = stats.unbind()
    mean = s / n
    var = (s2 / n - mean**2) * n / (n - 1).clamp(min=1)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.clamp(min=0).to(x.dtype) + eps)
    return out * mask


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """[B, R] rewards: -kl_coef * KL at every response token, plus the sequence's score [B] at its
    last token (the reward judges the finished response; in an episode, the policy's last
    token, wherever tool turns put it)."""
    rewards = -kl_coef * kl * mask
    rewards[torch.arange(rewards.size(0)), last_token(mask)] += scores.to(rewards.dtype)
    return rewards


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """[B] the column of each row's last masked token (0 for a row with none)."""
    cols = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    return torch.where(mask > 0, cols, 0).amax(1)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation -> (advantages [B, R], returns [B, R]).

    delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1}, with V = 0 after
    the last response token (the episode ends there). Returns = A + V are the value targets.
    t runs over the masked tokens only: in an episode, the token after a policy turn's last is
    the next turn's first (tool results and template turns are not the policy's steps)."""
    if bool((mask[:, 1:] > mask[:, :-1]).any()):  # gaps: run on the masked tokens, packed left
        order = torch.argsort((mask <= 0).to(torch.int8), dim=1, stable=True)  # [B, R]
        packed = [x.gather(1, order) for x in (rewards, values, mask)]
        adv_p, ret_p = gae(*packed, gamma, lam)
        adv, ret = torch.zeros_like(adv_p), torch.zeros_like(ret_p)
        return adv.scatter(1, order, adv_p), ret.scatter(1, order, ret_p)
    values = values * mask
    rewards = rewards * mask
    n = rewards.size(1)
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(n)):
        next_v = values[:, t + 1] if t + 1 < n else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        running = delta + gamma * lam * running
        adv[:, t] = running
    adv = adv * mask
    return adv, (adv + values) * mask


def group_advantages(
    scores: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO: each score minus its group's mean, divided by the group's (unbiased) standard
    deviation when `scale`. `scores` [B] holds groups of `group_size` consecutive samples of one
    prompt; returns [B]. A group whose samples all score the same gets advantage 0."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    g = scores.view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def leave_one_out_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each score minus the mean of the OTHER samples of its prompt,
    A_i = r_i - mean_{j != i} r_j = k / (k - 1) (r_i - mean_j r_j) for a group of k; [B] -> [B].
    The baseline does not depend on the sample it judges, so the estimate stays unbiased."""
    if group_size < 2 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size} >= 2")
    g = scores.view(-1, group_size)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - others).reshape(-1)


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic sampling filter: [N] scores in groups of `group_size` consecutive samples
    -> [N / group_size] bool, True where the group's scores are not all equal (a group whose
    samples all score the same has zero group-relative advantage: no gradient, only noise in
    the token mean)."""
    if scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group_size}")
    g = scores.view(-1, group_size)
    return (g != g[:, :1]).any(dim=1)


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate -> (per-token loss [B, R], clipped [B, R] bool).

    loss = max(-A r, -A clip(r, 1-clip, 1+clip_high)) with r = exp(logp - old_logp); a token is
    clipped when the clipped term is the larger (its gradient is then zero). `clip_high` (DAPO's
    clip-higher: a wider upper side lets unlikely tokens with A > 0 grow) defaults to `clip`.
    """
    high = clip if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip, 1 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def truncated_importance_weights(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, stale: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling for tokens sampled by older weights -> (weights [B, R],
    truncated [B, R] bool).

    w = min(exp(old_logp - behaviour_logp), cap) on the rows `stale` [B] bool (sampled by the
    weights behind behaviour_logp, older than those behind old_logp), 1 on the others. The
    clipped surrogate, computed against old_logp, is multiplied by w: an estimate of the
    objective under the weights that sampled, whose variance the cap bounds. Detached (a
    weight, not a path for gradients); a token is truncated when its ratio exceeds the cap."""
    ratio = torch.exp(old_logp.detach() - behaviour_logp)
    rows = stale.bool()[:, None].expand_as(ratio)
    w = torch.where(rows, ratio.clamp(max=cap), torch.ones_like(ratio))
    return w, rows & (ratio > cap)


LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "token_sum_norm")


def loss_weights(
    mask: torch.Tensor, aggregation: str, max_new_tokens: int
) -> tuple[torch.Tensor, float]:
    """How a minibatch's per-token losses become one number -> (weights [B, R], count).

    objective = sum(loss * weights) / count, with `count` summed over every rank's rows of the
    minibatch (weights are row-local, so any split of the rows over ranks sums to the same value):
    - token_mean: weights = mask, count = tokens: every token counts the same (long responses
      weigh more; PPO, GRPO as implemented here, DAPO);
    - sequence_mean: weights = mask / tokens of the row, count = sequences: each response's
      token mean, averaged over responses (the GRPO paper; short responses' tokens weigh more);
    - token_sum_norm: weights = mask / max_new_tokens, count = sequences: each response's token
      sum over a constant, averaged over responses (Dr. GRPO: no per-response length bias).
    """
    if aggregation == "token_mean":
        return mask, float(mask.sum())
    if aggregation == "sequence_mean":
        return mask / mask.sum(1, keepdim=True).clamp(min=1), float(mask.size(0))
    if aggregation == "token_sum_norm":
        return mask / max_new_tokens, float(mask.size(0))
    raise ValueError(f"unknown loss aggregation {aggregation!r}; known: {list(LOSS_AGGREGATIONS)}")


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (per-token loss [B, R], clipped [B, R] bool):
    0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    a, b = (values - returns) ** 2, (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(a, b), b > a


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce: Reduce | None = None
) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens: 1 = the critic predicts
    the returns exactly, 0 = no better than their mean, < 0 = worse."""
    err = returns - values
    sums = [(returns * mask).sum(), (returns**2 * mask).sum(), (err * mask).sum()]
    stats = torch.stack([*sums, (err**2 * mask).sum(), mask.sum()]).double()
    if reduce is not None:
        stats = reduce(stats)
    r, r2, e, e2, n = stats.tolist()
    var_r = r2 / n - (r / n) ** 2
    var_e = e2 / n - (e / n) ** 2
    return float(1 - var_e / var_r) if var_r > 0 else float("nan")


class KLController:
    """Fixed, or adaptive (Ziegler et al. 2019): after a rollout of n sequences with mean KL k,
    coef *= 1 + clip(k / target - 1, -0.2, 0.2) * n / horizon."""

    def __init__(
        self, coef: float, adaptive: bool = False, target: float = 6.0, horizon: int = 10000
    ) -> None:
        self.coef, self.adaptive, self.target, self.horizon = coef, adaptive, target, horizon

    def update(self, kl: float, n_sequences: int) -> float:
        if self.adaptive:
            error = min(max(kl / self.target - 1, -0.2), 0.2)
            self.coef *= 1 + error * n_sequences / self.horizon
        return self.coef
