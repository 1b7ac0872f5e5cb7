"""Preference losses against numbers worked out by hand, the registry, and gradient signs."""

import math

import pytest
import torch

from posttrain.train.preference_losses import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    hinge_loss,
    implicit_rewards,
    ipo_loss,
    loss_hyperparameters,
    nll_term,
    preference_loss,
    robust_loss,
    sigmoid_loss,
    simpo_loss,
)

LN3 = math.log(3)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def logps_with_margin(h: float) -> tuple[torch.Tensor, ...]:
    """(pi_c, pi_r, ref_c, ref_r) whose log-ratio margin (pi_c - ref_c) - (pi_r - ref_r) is h:
    chosen ratio = h (pi_c = h - 4, ref_c = -4), rejected ratio = 0 (both -5)."""
    return t(h - 4), t(-5.0), t(-4.0), t(-5.0)


def test_sigmoid_by_hand() -> None:
    # beta = 0.5, h = 2 ln 3 -> logits = ln 3 -> sigmoid = 3/4 -> loss = -ln(3/4) = ln(4/3).
    losses, rc, rr = sigmoid_loss(*logps_with_margin(2 * LN3), beta=0.5)
    assert losses.item() == pytest.approx(math.log(4 / 3), abs=1e-6)
    # Rewards are beta * (pi - ref): chosen 0.5 * 2 ln 3 = ln 3, rejected 0.
    assert rc.item() == pytest.approx(LN3, abs=1e-6) and rr.item() == 0.0
    assert not rc.requires_grad and not rr.requires_grad


def test_sigmoid_beta_scales_the_margin() -> None:
    # beta = 1, same h = 2 ln 3 -> logits = ln 9 -> sigmoid = 9/10 -> loss = ln(10/9).
    losses, rc, _ = sigmoid_loss(*logps_with_margin(2 * LN3), beta=1.0)
    assert losses.item() == pytest.approx(math.log(10 / 9), abs=1e-6)
    assert rc.item() == pytest.approx(2 * LN3, abs=1e-6)


def test_sigmoid_label_smoothing_by_hand() -> None:
    # logits = ln 3: sigmoid(logits) = 3/4, sigmoid(-logits) = 1/4.
    # eps = 0.1: 0.9 * -ln(3/4) + 0.1 * -ln(1/4) = 0.9 ln(4/3) + 0.1 ln 4.
    losses, _, _ = sigmoid_loss(*logps_with_margin(2 * LN3), beta=0.5, label_smoothing=0.1)
    assert losses.item() == pytest.approx(0.9 * math.log(4 / 3) + 0.1 * math.log(4), abs=1e-6)
    # eps = 0.5 is symmetric: the loss is minimal at margin 0, ln 2 there.
    zero, _, _ = sigmoid_loss(*logps_with_margin(0.0), beta=0.5, label_smoothing=0.5)
    assert zero.item() == pytest.approx(math.log(2), abs=1e-6)


def test_robust_by_hand() -> None:
    # logits = ln 3; eps = 0.1: (0.9 * -ln(3/4) + 0.1 * ln(1/4)) / (1 - 0.2)
    #                          = (0.9 ln(4/3) - 0.1 ln 4) / 0.8.
    losses, rc, _ = robust_loss(*logps_with_margin(2 * LN3), beta=0.5, label_smoothing=0.1)
    want = (0.9 * math.log(4 / 3) - 0.1 * math.log(4)) / 0.8
    assert losses.item() == pytest.approx(want, abs=1e-6)
    assert rc.item() == pytest.approx(LN3, abs=1e-6)
    # eps = 0 is plain DPO.
    plain, _, _ = robust_loss(*logps_with_margin(2 * LN3), beta=0.5)
    assert plain.item() == pytest.approx(math.log(4 / 3), abs=1e-6)
    with pytest.raises(ValueError, match="< 0.5"):
        robust_loss(*logps_with_margin(1.0), beta=0.5, label_smoothing=0.5)


def test_ipo_target_is_one_over_two_beta() -> None:
    # beta = 0.25 -> target 1 / (2 * 0.25) = 2; h = 3 -> (3 - 2)^2 = 1.
    losses, rc, _ = ipo_loss(*logps_with_margin(3.0), beta=0.25)
    assert losses.item() == pytest.approx(1.0, abs=1e-6)
    assert rc.item() == pytest.approx(0.75, abs=1e-6)  # beta * 3
    # beta = 0.5 -> target 1; h = 3 -> (3 - 1)^2 = 4.  h = target -> 0.
    assert ipo_loss(*logps_with_margin(3.0), beta=0.5)[0].item() == pytest.approx(4.0, abs=1e-6)
    assert ipo_loss(*logps_with_margin(1.0), beta=0.5)[0].item() == pytest.approx(0.0, abs=1e-6)
    # Overshooting the target is penalised too: h = 5, target 1 -> 16.
    assert ipo_loss(*logps_with_margin(5.0), beta=0.5)[0].item() == pytest.approx(16.0, abs=1e-5)


def test_ipo_uses_summed_logps_not_length_averages() -> None:
    # The paper's h is on whole-sequence log-ratios: lengths must not change the loss.
    a = ipo_loss(*logps_with_margin(3.0), t(1.0), t(1.0), beta=0.25)[0]
    b = ipo_loss(*logps_with_margin(3.0), t(7.0), t(2.0), beta=0.25)[0]
    assert a.item() == b.item() == pytest.approx(1.0, abs=1e-6)


def test_hinge_by_hand() -> None:
    # beta = 0.5: h = 1 -> relu(1 - 0.5) = 0.5; h = 4 -> relu(1 - 2) = 0; h = -2 -> relu(2) = 2.
    # Chosen ratio pi_c - ref_c = h, rejected ratio 0, as in logps_with_margin.
    pc, ref_c, pr = t(1 - 4, 4 - 4, -2 - 4), t(-4.0, -4.0, -4.0), t(-5.0, -5.0, -5.0)
    losses, rc, _ = hinge_loss(pc, pr, ref_c, pr.clone(), beta=0.5)
    assert losses.tolist() == pytest.approx([0.5, 0.0, 2.0], abs=1e-6)
    assert rc.tolist() == pytest.approx([0.5, 2.0, -1.0], abs=1e-6)


def test_simpo_by_hand() -> None:
    # pi_c = -6 over 3 tokens -> -2 per token; pi_r = -12 over 4 tokens -> -3 per token.
    # beta = 2: rewards 2 * -2 = -4 and 2 * -3 = -6; margin 2. gamma = 2 - ln 3 -> logits ln 3
    # -> loss ln(4/3). (Summed log-probs would give a margin of 2 * 6 = 12: normalisation matters.)
    pc, pr, lc, lr = t(-6.0), t(-12.0), t(3.0), t(4.0)
    losses, rc, rr = simpo_loss(pc, pr, None, None, lc, lr, beta=2.0, gamma=2 - LN3)
    assert losses.item() == pytest.approx(math.log(4 / 3), abs=1e-6)
    assert (rc.item(), rr.item()) == pytest.approx((-4.0, -6.0), abs=1e-6)
    # gamma = 0 -> logits 2 -> -ln sigmoid(2) = ln(1 + e^-2).
    losses0, _, _ = simpo_loss(pc, pr, None, None, lc, lr, beta=2.0, gamma=0.0)
    assert losses0.item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-6)
    # Label smoothing as in sigmoid: eps = 0.1 at logits ln 3.
    smooth, _, _ = simpo_loss(
        pc, pr, None, None, lc, lr, beta=2.0, gamma=2 - LN3, label_smoothing=0.1
    )
    assert smooth.item() == pytest.approx(0.9 * math.log(4 / 3) + 0.1 * math.log(4), abs=1e-6)


@pytest.mark.parametrize("name", ["sigmoid", "robust", "ipo", "hinge"])
def test_implicit_rewards_of_the_dpo_family_by_hand(name: str) -> None:
    # beta = 0.5: chosen -3 vs ref -4 -> 0.5 * 1 = 0.5; rejected -7 vs ref -5 -> 0.5 * -2 = -1.
    # Summed log-probs: the lengths (3 and 30 tokens) change nothing.
    r = implicit_rewards(t(-3.0, -7.0), t(-4.0, -5.0), t(3.0, 30.0), beta=0.5, loss=name)
    assert r.dtype == torch.float32 and not r.requires_grad
    assert r.tolist() == pytest.approx([0.5, -1.0], abs=1e-6)


def test_implicit_rewards_of_simpo_by_hand() -> None:
    # beta = 2: -6 over 3 tokens -> 2 * -2 = -4; -12 over 4 tokens -> 2 * -3 = -6. No
    # reference: passing one changes nothing. The DPO-family reward of the same numbers with a
    # zero reference would be 2 * -6 = -12 and 2 * -12 = -24: a 12-nat margin, not 2.
    pc, lengths = t(-6.0, -12.0), t(3.0, 4.0)
    r = implicit_rewards(pc, None, lengths, beta=2.0, loss="simpo")
    assert r.tolist() == pytest.approx([-4.0, -6.0], abs=1e-6)
    with_ref = implicit_rewards(pc, t(-1.0, -1.0), lengths, beta=2.0, loss="simpo")
    assert with_ref.tolist() == r.tolist()
    dpo = implicit_rewards(pc, t(0.0, 0.0), lengths, beta=2.0, loss="sigmoid")
    assert dpo.tolist() == pytest.approx([-12.0, -24.0], abs=1e-6)


def test_implicit_rewards_upcast_and_name_the_known_losses() -> None:
    # bf16 log-probs 256 nats apart from the reference: the difference is taken in fp32.
    pc, ref = torch.tensor([-1000.0]).bfloat16(), torch.tensor([-744.0]).bfloat16()
    r = implicit_rewards(pc, ref, None, beta=0.1, loss="sigmoid")
    assert r.dtype == torch.float32 and r.item() == pytest.approx(-25.6, abs=1e-4)
    with pytest.raises(ValueError, match="unknown preference loss 'dpo'; known: hinge, ipo"):
        implicit_rewards(pc, ref, None, beta=0.1, loss="dpo")


def test_nll_term_is_mean_per_token_nll() -> None:
    # -(-6)/3 = 2 and -(-2)/1 = 2 -> mean 2; -(-3)/1 = 3 -> mean (2 + 3) / 2 = 2.5.
    assert nll_term(t(-6.0, -2.0), t(3.0, 1.0)).item() == pytest.approx(2.0)
    assert nll_term(t(-6.0, -3.0), t(3.0, 1.0)).item() == pytest.approx(2.5)


def test_registry_names_and_errors() -> None:
    assert set(PREFERENCE_LOSSES) == {"sigmoid", "robust", "ipo", "hinge", "simpo"}
    assert sorted(REFERENCE_FREE) == ["simpo"]
    with pytest.raises(ValueError) as exc:
        preference_loss("dpo", beta=0.1)
    assert "'dpo'" in str(exc.value)
    assert all(name in str(exc.value) for name in PREFERENCE_LOSSES)
    assert loss_hyperparameters("simpo") == ["beta", "gamma", "label_smoothing"]
    assert loss_hyperparameters("ipo") == ["beta"]
    with pytest.raises(ValueError, match="known: hinge, ipo, robust, sigmoid, simpo"):
        loss_hyperparameters("orpo")
    with pytest.raises(ValueError, match="unexpected gamma"):
        preference_loss("sigmoid", beta=0.1, gamma=1.0)
    with pytest.raises(ValueError, match="gamma"):
        preference_loss("simpo", beta=2.0)  # missing, caught at setup
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss("ipo", beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        preference_loss("sigmoid", beta=0.1, label_smoothing=0.7)


def test_bound_loss_matches_direct_call() -> None:
    fn = preference_loss("sigmoid", beta=0.5, label_smoothing=0.1)
    a = fn(*logps_with_margin(2 * LN3), t(1.0), t(1.0))[0]
    b = sigmoid_loss(*logps_with_margin(2 * LN3), beta=0.5, label_smoothing=0.1)[0]
    assert a.item() == b.item()


HPARAMS = {
    "sigmoid": {"beta": 0.1},
    "robust": {"beta": 0.1, "label_smoothing": 0.2},
    "ipo": {"beta": 0.1},
    "hinge": {"beta": 0.1},
    "simpo": {"beta": 2.0, "gamma": 0.5},
}


@pytest.mark.parametrize("name", sorted(PREFERENCE_LOSSES))
def test_raising_chosen_lowers_the_loss(name: str) -> None:
    # At zero margin every loss is in its active region; d loss / d pi_c < 0 < d loss / d pi_r.
    pc, pr = t(-5.0, -9.0).requires_grad_(), t(-5.0, -9.0).requires_grad_()
    ref = t(-5.0, -9.0)
    losses, _, _ = preference_loss(name, **HPARAMS[name])(
        pc, pr, ref, ref, t(2.0, 3.0), t(2.0, 3.0)
    )
    assert losses.shape == (2,) and torch.isfinite(losses).all()
    losses.mean().backward()
    assert (pc.grad < 0).all() and (pr.grad > 0).all(), (pc.grad, pr.grad)


@pytest.mark.parametrize("name", sorted(PREFERENCE_LOSSES))
def test_each_loss_returns_its_implicit_rewards(name: str) -> None:
    # The per-step training metrics read the loss's rewards, the held-out ones implicit_rewards:
    # the same numbers, exactly, for every loss.
    pc, pr, rc, rr = t(-3.0, -8.0), t(-6.0, -2.0), t(-4.0, -9.0), t(-5.0, -1.0)
    lc, lr = t(2.0, 5.0), t(3.0, 1.0)
    hp = HPARAMS[name]
    _, chosen, rejected = preference_loss(name, **hp)(pc, pr, rc, rr, lc, lr)
    assert torch.equal(chosen, implicit_rewards(pc, rc, lc, beta=hp["beta"], loss=name))
    assert torch.equal(rejected, implicit_rewards(pr, rr, lr, beta=hp["beta"], loss=name))


def test_half_precision_inputs_are_upcast() -> None:
    # fp16 log-probs (exactly representable here) give the fp32 losses, computed in fp32.
    pc, pr, ref = torch.tensor([-1000.0]), torch.tensor([-1000.5]), torch.tensor([-1000.0])
    full = sigmoid_loss(pc, pr, ref, ref, beta=1.0)[0]
    half = sigmoid_loss(pc.half(), pr.half(), ref.half(), ref.half(), beta=1.0)[0]
    assert half.dtype == torch.float32 and half.item() == full.item()


def test_pair_accuracy_counts_a_tie_as_half() -> None:
    """Hand-computed: above, tie, below, tie -> (1 + 0.5 + 0 + 0.5) / 4 = 0.5, ties 2/4."""
    from posttrain.train.losses import pair_outcome, pair_tie
    from posttrain.train.preference_losses import orpo_loss

    chosen = torch.tensor([2.0, 1.0, -1.0, 0.0])
    rejected = torch.tensor([1.0, 1.0, 0.5, 0.0])
    assert pair_outcome(chosen, rejected).tolist() == [1.0, 0.5, 0.0, 0.5]
    assert pair_tie(chosen, rejected).mean().item() == 0.5
    # ORPO's metrics use the same rule: equal log-probabilities are a tie.
    logps = torch.tensor([-4.0, -4.0]), torch.tensor([-4.0, -6.0])
    lengths = torch.tensor([2.0, 2.0])
    _, m = orpo_loss(logps[0], logps[1], lengths, lengths, beta=0.1)
    assert m["correct"].tolist() == [0.5, 1.0] and m["ties"].tolist() == [1.0, 0.0]
