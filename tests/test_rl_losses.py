"""Online-RL arithmetic against values computed by hand (the working is in each comment)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.rl.losses import (
    KLController,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    gae,
    group_advantages,
    kl_penalty,
    loss_weights,
    masked_whiten,
    token_logps,
    token_rewards,
)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(a: torch.Tensor, b: torch.Tensor | list, tol: float = 1e-4) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=0)


def token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean over the masked tokens as the RL update takes it (`loss_weights`)."""
    weights, count = loss_weights(mask, "token_mean", mask.size(-1))
    return float((x * weights).sum()) / max(1.0, count)


def test_gae_full_response() -> None:
    # gamma 1, lam 0.5, rewards [0, 0, 1], values [.5, .6, .7]:
    # t2: delta = 1 - .7 = .3 -> A = .3; t1: delta = .7 - .6 = .1 -> A = .1 + .5*.3 = .25
    # t0: delta = .6 - .5 = .1 -> A = .1 + .5*.25 = .225; returns = A + V.
    adv, ret = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]), gamma=1.0, lam=0.5)
    close(adv, [[0.225, 0.25, 0.3]])
    close(ret, [[0.725, 0.85, 1.0]])


def test_gae_ignores_padding_after_the_response() -> None:
    # gamma .9, lam .95, response of 2 tokens; the padded third position holds junk (5, 9).
    # t1: V after the end = 0, delta = 3 - 2 = 1 -> A = 1
    # t0: delta = 0 + .9*2 - 1 = .8 -> A = .8 + .9*.95*1 = 1.655
    adv, ret = gae(t([0, 3, 5]), t([1, 2, 9]), t([1, 1, 0]), gamma=0.9, lam=0.95)
    close(adv, [[1.655, 1.0, 0.0]])
    close(ret, [[2.655, 3.0, 0.0]])


def test_gae_rows_are_independent() -> None:
    rewards, values = t([0, 0, 1], [0, 3, 5]), t([0.5, 0.6, 0.7], [1, 2, 9])
    mask = t([1, 1, 1], [1, 1, 0])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=0.95)
    for i in range(2):
        alone, _ = gae(rewards[i : i + 1], values[i : i + 1], mask[i : i + 1], 0.9, 0.95)
        close(adv[i : i + 1], alone)


def test_gae_steps_over_the_tool_tokens_of_an_episode() -> None:
    # Policy tokens at 0, 1 and 4 (2, 3: a tool result, mask 0, junk values 7 and 8).
    # gamma .9, lam .5 over the policy's steps only: t4: delta = 1 - .7 = .3 -> A = .3
    # t1 (next step t4): delta = 0 + .9*.7 - .6 = .03 -> A = .03 + .45*.3 = .165
    # t0: delta = .9*.6 - .5 = .04 -> A = .04 + .45*.165 = .11425
    mask = t([1, 1, 0, 0, 1])
    adv, ret = gae(t([0, 0, 5, 5, 1]), t([0.5, 0.6, 7, 8, 0.7]), mask, gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.0, 0.0, 0.3]])
    close(ret, [[0.61425, 0.765, 0.0, 0.0, 1.0]])


def test_whiten_masked_unbiased() -> None:
    # Entries 1, 2, 3 (the 100 is padding): mean 2, unbiased var (1 + 0 + 1) / 2 = 1.
    close(masked_whiten(t([1, 2, 3, 100]), t([1, 1, 1, 0])), [[-1, 0, 1, 0]])


def test_whiten_reduce_over_ranks_equals_whole_batch() -> None:
    # Two "ranks" hold [1, 2] and [3, 4]; with the reduce, each sees the global mean 2.5 and
    # unbiased std sqrt(5/3) = 1.29099.
    x, m = t([1, 2], [3, 4]), t([1, 1], [1, 1])
    whole = masked_whiten(x, m)
    close(whole, [[-1.16190, -0.38730], [0.38730, 1.16190]])
    other = torch.tensor([7.0, 25.0, 2.0], dtype=torch.float64)  # sum, sum of squares, count
    close(masked_whiten(x[:1], m[:1], reduce=lambda s: s + other), whole[:1])


def test_token_rewards_kl_everywhere_score_at_last_token() -> None:
    # coef .5: -.5 * [.1, .2] on the two real tokens, score 2 added at the last one.
    r = token_rewards(torch.tensor([2.0]), t([0.1, 0.2, 0.3]), t([1, 1, 0]), kl_coef=0.5)
    close(r, [[-0.05, 1.9, 0.0]])


def test_token_rewards_score_at_the_policys_last_token_of_an_episode() -> None:
    # Policy tokens 0 and 2 (1 is a tool result): the score lands on 2, the KL only on 0 and 2.
    r = token_rewards(torch.tensor([2.0]), t([0.1, 0.2, 0.3, 0.4]), t([1, 0, 1, 0]), kl_coef=0.5)
    close(r, [[-0.05, 0.0, 1.85, 0.0]])


def test_kl_estimators() -> None:
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    close(kl_penalty(logp, ref, "k1"), [math.log(2)])  # log .5 - log .25
    close(kl_penalty(logp, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(kl_penalty(logp, ref, "k3"), [0.5 - 1 + math.log(2)])  # r = .5: r - 1 - log r
    assert kl_penalty(ref, logp, "k3").item() >= 0  # k3 never negative
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k9")


def test_clipped_policy_loss() -> None:
    # ratios 1.25, .6, 1.1 with advantages 1, -1, 2 and clip .2:
    # t0: max(-1.25, -1.2) = -1.2 (clipped); t1: max(.6, .8) = .8 (clipped);
    # t2: ratio inside the range: -2.2, not clipped.
    logp = torch.log(t([0.5, 0.3, 0.55]))
    old = torch.log(t([0.4, 0.5, 0.5]))
    loss, clipped = clipped_policy_loss(logp, old, t([1, -1, 2]), clip=0.2)
    close(loss, [[-1.2, 0.8, -2.2]])
    assert clipped.tolist() == [[True, True, False]]


def test_clipped_value_loss() -> None:
    # t0: V 1.5 (old 1.0) clips to 1.2; max((1.5-2)^2, (1.2-2)^2) = .64 -> .32, clipped
    # t1: V = old = 0, return 1: .5 * 1 = .5, not clipped
    loss, clipped = clipped_value_loss(t([1.5, 0.0]), t([1.0, 0.0]), t([2.0, 1.0]), clip=0.2)
    close(loss, [[0.32, 0.5]])
    assert clipped.tolist() == [[True, False]]


def test_group_advantages() -> None:
    # Group [1, 2, 3]: mean 2, unbiased std 1; group [5, 5, 5]: all equal -> 0.
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3)
    close(adv, [-1 / 1.0001, 0, 1 / 1.0001, 0, 0, 0])
    close(group_advantages(torch.tensor([1.0, 3.0]), 2, scale=False), [-1, 1])
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_explained_variance() -> None:
    returns, mask = t([1, 2, 3, 4]), t([1, 1, 1, 1])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0)
    # values 0: err = returns, var_e = var_r -> 0; values = -returns: var_e = 4 var_r -> -3
    assert explained_variance(-returns, returns, mask) == pytest.approx(-3.0)


def test_kl_controller() -> None:
    fixed = KLController(0.1)
    assert fixed.update(100.0, 10) == 0.1
    c = KLController(0.1, adaptive=True, target=6.0, horizon=100)
    # KL 12: error 1 clipped to .2 -> .1 * (1 + .2 * 10/100) = .102
    assert c.update(12.0, 10) == pytest.approx(0.102)
    # KL 3: error -.5 clipped to -.2 -> .102 * (1 - .02) = .09996
    assert c.update(3.0, 10) == pytest.approx(0.09996)


def test_logps_entropy_and_mean() -> None:
    logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens
    close(entropy_from_logits(logits), [[math.log(4)] * 2])
    logits[0, 1, 2] = math.log(3)  # p = 3/6 for token 2 at position 1
    close(token_logps(logits, torch.tensor([[0, 2]])), [[math.log(0.25), math.log(0.5)]])
    assert token_mean(t([1, 2, 30]), t([1, 1, 0])) == pytest.approx(1.5)


def _rollout(scores: list[float], stopped: list[bool]):
    """A scored two-sequence rollout: responses of 3 and 2 tokens (EOS id 9)."""
    from posttrain.rl.rollout.sample import Rollout, response_mask

    response = torch.tensor([[5, 6, 9], [7, 9, 0]])
    mask, stop = response_mask(response, stop_ids=9)
    stop = torch.tensor(stopped)
    ro = Rollout(
        torch.ones(2, 2, dtype=torch.long),
        torch.ones(2, 2, dtype=torch.long),
        response,
        mask,
        stop,
        [[], []],
    )
    ro.scored = {
        "scores": torch.tensor(scores),
        "logps": torch.log(t([0.5, 0.5, 0.5], [0.25, 0.5, 1.0])),
        "ref_logps": torch.log(t([0.25, 0.5, 0.5], [0.25, 0.25, 1.0])),
        "values": t([0.1, 0.2, 0.3], [0.4, 0.5, 0.6]),
    }
    return ro


def test_response_mask_ends_at_the_first_eos() -> None:
    from posttrain.rl.rollout.sample import response_mask

    mask, stopped = response_mask(torch.tensor([[5, 9, 9, 0], [5, 6, 7, 8]]), stop_ids=9)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]] and stopped.tolist() == [True, False]
    # Several stop ids (EOS 9, an end-of-turn marker 6): the first of any ends the response.
    mask, stopped = response_mask(torch.tensor([[5, 9, 9, 0], [5, 6, 7, 8], [5, 7, 8, 4]]), [9, 6])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert stopped.tolist() == [True, True, False]


def test_missing_eos_penalty_only_hits_responses_that_never_stopped() -> None:
    from types import SimpleNamespace

    from posttrain.rl.algorithms.advantages import shaped_scores

    ro = _rollout([1.0, 2.0], [True, False])
    assert shaped_scores(ro, SimpleNamespace(missing_eos_penalty=-3.0)).tolist() == [1.0, -1.0]
    assert shaped_scores(ro, SimpleNamespace(missing_eos_penalty=None)).tolist() == [1.0, 2.0]


def test_ppo_advantages_are_gae_over_kl_shaped_rewards_whitened() -> None:
    from types import SimpleNamespace

    from posttrain.rl.algorithms.advantages import ppo_advantages

    ro = _rollout([1.0, 2.0], [True, True])
    cfg = SimpleNamespace(
        missing_eos_penalty=None,
        kl=SimpleNamespace(estimator="k1"),
        gamma=1.0,
        lam=1.0,
        whiten_advantages=False,
    )
    adv, ret = ppo_advantages(ro, cfg, 0.5, None)
    # k1 per token: row 0 [log 2, 0, 0], row 1 [0, log 2, pad]; rewards -0.5 KL, score at the
    # end. gamma = lam = 1: the return at t is the sum of rewards from t on.
    l2 = math.log(2)
    close(ret, [[1 - 0.5 * l2, 1.0, 1.0], [2 - 0.5 * l2, 2 - 0.5 * l2, 0.0]])
    close(adv, ret - ro.scored["values"] * ro.mask)
    cfg.whiten_advantages = True
    white, _ = ppo_advantages(ro, cfg, 0.5, None)
    assert abs(token_mean(white, ro.mask)) < 1e-6


def test_grpo_advantages_compare_samples_of_one_prompt() -> None:
    from types import SimpleNamespace

    from posttrain.rl.algorithms.advantages import grpo_advantages

    ro = _rollout([1.0, 3.0], [True, True])
    cfg = SimpleNamespace(
        missing_eos_penalty=None,
        kl=SimpleNamespace(estimator="k1"),
        rollout=SimpleNamespace(samples_per_prompt=2),
        scale_rewards=False,
    )
    adv, returns = grpo_advantages(ro, cfg, 0.0, None)
    assert returns is None
    close(adv, [[-1, -1, -1], [1, 1, 0]])  # the group mean is 2; the same value at every token
    # KL in the reward: each response's KL sum is log 2, so the scores shift equally: same result.
    close(grpo_advantages(ro, cfg, 1.0, None)[0], adv)
