"""Distillation losses against numbers worked out by hand, chunking, masking and gradients (the
comparison with TRL's generalized_jsd_loss needs trl: bench/vs_trl_check.py --only gkd)."""

import math

import pytest
import torch

from posttrain.rl.distill_losses import (
    DIVERGENCES,
    objective_sum,
    teacher_gap_closed,
    token_divergence,
)

LN = math.log


def one_token(student: list[float], teacher: list[float]) -> tuple[torch.Tensor, ...]:
    """[1, 1, V] student and teacher logits and a [1, 1] mask that keeps the token."""
    s = torch.tensor([[student]], dtype=torch.float32)
    t = torch.tensor([[teacher]], dtype=torch.float32)
    return s, t, torch.ones(1, 1)


# p_s = softmax(0, 0) = (0.5, 0.5); p_t = softmax(ln 9, 0) = (0.9, 0.1).
HALF_HALF = [0.0, 0.0]
NINE_TENTHS = [LN(9), 0.0]
# reverse KL(p_s || p_t) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5 ln(25/9) = ln(5/3) = 0.5108...
REVERSE = LN(5 / 3)
# forward KL(p_t || p_s) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.9 ln 1.8 + 0.1 ln 0.2 = 0.3681...
FORWARD = 0.9 * LN(1.8) + 0.1 * LN(0.2)


def div(kind: str, student: list[float], teacher: list[float], **kw: float) -> float:
    s, t, m = one_token(student, teacher)
    return token_divergence(s, t, m, kind, **kw).item()  # type: ignore[arg-type]


def test_reverse_and_forward_kl_by_hand() -> None:
    assert div("reverse_kl", HALF_HALF, NINE_TENTHS) == pytest.approx(REVERSE, abs=1e-6)
    assert abs(REVERSE - 0.5108256) < 1e-7
    assert div("forward_kl", HALF_HALF, NINE_TENTHS) == pytest.approx(FORWARD, abs=1e-6)
    assert abs(FORWARD - 0.3680642) < 1e-7
    # Same distributions -> 0.
    assert div("reverse_kl", NINE_TENTHS, NINE_TENTHS) == pytest.approx(0.0, abs=1e-7)


def test_three_way_vocabulary_by_hand() -> None:
    # p_s = softmax(ln 2, 0, 0) = (1/2, 1/4, 1/4); p_t = softmax(0, 0, ln 2) = (1/4, 1/4, 1/2).
    # reverse: 1/2 ln((1/2)/(1/4)) + 1/4 ln 1 + 1/4 ln((1/4)/(1/2)) = 1/2 ln 2 - 1/4 ln 2 = ln2 / 4;
    # forward is the mirror image: the same ln 2 / 4.
    s, t = [LN(2), 0.0, 0.0], [0.0, 0.0, LN(2)]
    assert div("reverse_kl", s, t) == pytest.approx(LN(2) / 4, abs=1e-6)
    assert div("forward_kl", s, t) == pytest.approx(LN(2) / 4, abs=1e-6)


def test_jsd_end_points_are_forward_and_reverse_kl() -> None:
    # TRL's convention: beta = 0 is KL(teacher || student), beta = 1 is KL(student || teacher).
    assert div("jsd", HALF_HALF, NINE_TENTHS, beta=0.0) == pytest.approx(FORWARD, abs=1e-6)
    assert div("jsd", HALF_HALF, NINE_TENTHS, beta=1.0) == pytest.approx(REVERSE, abs=1e-6)


def test_jsd_half_by_hand() -> None:
    # beta = 0.5: M = 0.5 p_t + 0.5 p_s = (0.7, 0.3).
    # KL(p_t || M) = 0.9 ln(0.9/0.7) + 0.1 ln(0.1/0.3) = 0.9 ln(9/7) - 0.1 ln 3 = 0.11632...
    # KL(p_s || M) = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.5 ln(25/21)          = 0.08718...
    # JSD = 0.5 * 0.11632 + 0.5 * 0.08718 = 0.10175...
    kl_t = 0.9 * LN(9 / 7) - 0.1 * LN(3)
    kl_s = 0.5 * LN(25 / 21)
    want = 0.5 * kl_t + 0.5 * kl_s
    assert want == pytest.approx(0.1017492, abs=1e-7)
    assert div("jsd", HALF_HALF, NINE_TENTHS, beta=0.5) == pytest.approx(want, abs=1e-6)


def test_jsd_quarter_weights_the_mixture_towards_the_student() -> None:
    # beta = 0.25: M = 0.25 (0.9, 0.1) + 0.75 (0.5, 0.5) = (0.6, 0.4).
    # KL(p_t || M) = 0.9 ln(0.9/0.6) + 0.1 ln(0.1/0.4) = 0.9 ln 1.5 - 0.1 ln 4
    # KL(p_s || M) = 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.5 ln(25/24)
    # JSD = 0.25 KL(p_t || M) + 0.75 KL(p_s || M) = 0.07188...
    want = 0.25 * (0.9 * LN(1.5) - 0.1 * LN(4)) + 0.75 * 0.5 * LN(25 / 24)
    assert div("jsd", HALF_HALF, NINE_TENTHS, beta=0.25) == pytest.approx(want, abs=1e-6)
    # The mixture formula vanishes at both ends (why TRL sets beta 0 and 1 apart): near 0 it is
    # ~ beta * forward KL, so beta = 1e-4 is ~1e-4 * FORWARD, not FORWARD.
    tiny = div("jsd", HALF_HALF, NINE_TENTHS, beta=1e-4)
    assert tiny == pytest.approx(1e-4 * FORWARD, rel=1e-3)


def test_temperature_divides_both_logits() -> None:
    # T = 2: student (0, 0) -> (0, 0), p_s = (0.5, 0.5); teacher (ln 9, 0) -> (ln 3, 0),
    # p_t = (0.75, 0.25). reverse: 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25) = 0.5 ln(4/3) = 0.1438...
    # forward: 0.75 ln(0.75/0.5) + 0.25 ln(0.25/0.5) = 0.75 ln 1.5 - 0.25 ln 2.
    got = div("reverse_kl", HALF_HALF, NINE_TENTHS, temperature=2.0)
    assert got == pytest.approx(0.5 * LN(4 / 3), abs=1e-6)
    got = div("forward_kl", HALF_HALF, NINE_TENTHS, temperature=2.0)
    assert got == pytest.approx(0.75 * LN(1.5) - 0.25 * LN(2), abs=1e-6)
    # The student's logits are divided too: student (ln 9, 0) -> (ln 3, 0), p_s = (0.75, 0.25);
    # teacher (0, 0): p_t = (0.5, 0.5). reverse: 0.75 ln(0.75/0.5) + 0.25 ln(0.25/0.5).
    got = div("reverse_kl", NINE_TENTHS, HALF_HALF, temperature=2.0)
    assert got == pytest.approx(0.75 * LN(1.5) - 0.25 * LN(2), abs=1e-6)


def test_mask_zeros_and_skips_dropped_tokens() -> None:
    # Row 0 keeps tokens 0 and 2, row 1 keeps token 1; the dropped positions hold NaN logits,
    # which must neither show in the values nor in the student's gradient.
    s = torch.zeros(2, 3, 2)
    t = torch.tensor([LN(9), 0.0]).expand(2, 3, 2).clone()
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    s[mask == 0] = float("nan")
    s.requires_grad_(True)
    out = token_divergence(s, t, mask, "reverse_kl")
    assert out.shape == (2, 3)
    want = torch.tensor([[REVERSE, 0.0, REVERSE], [0.0, REVERSE, 0.0]])
    assert torch.allclose(out, want, atol=1e-6)
    objective_sum(out, mask, "token_mean").backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    assert (s.grad[mask == 0] == 0).all() and (s.grad[mask == 1] != 0).all()


def test_masked_teacher_logit_of_minus_inf_is_not_nan() -> None:
    # A logit masked to -inf in the student (p_s = 0 there) contributes 0 log 0 = 0:
    # p_s = (1, 0), p_t = (0.9, 0.1): reverse KL = 1 ln(1/0.9) = ln(10/9).
    s = torch.tensor([[[0.0, float("-inf")]]], requires_grad=True)
    t = torch.tensor([[NINE_TENTHS]])
    out = token_divergence(s, t, torch.ones(1, 1), "reverse_kl")
    assert out.item() == pytest.approx(LN(10 / 9), abs=1e-6)
    out.sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


@pytest.mark.parametrize("kind", sorted(DIVERGENCES))
def test_chunked_equals_unchunked(kind: str) -> None:
    torch.manual_seed(0)
    s0, t = torch.randn(3, 5, 11) * 2, torch.randn(3, 5, 11) * 2
    mask = (torch.rand(3, 5) > 0.3).long()
    results = []
    for chunk in (1, 2, 7, 1024):
        s = s0.clone().requires_grad_(True)
        out = token_divergence(s, t, mask, kind, beta=0.3, temperature=0.8, chunk_tokens=chunk)  # type: ignore[arg-type]
        (out * torch.arange(15.0).view(3, 5)).sum().backward()  # a different weight per token
        results.append((out.detach(), s.grad))
    for out, grad in results[1:]:
        assert torch.allclose(out, results[0][0], atol=1e-6)
        assert torch.allclose(grad, results[0][1], atol=1e-6)


def test_gradient_by_hand_reaches_the_student_only() -> None:
    # d KL(p_s || p_t) / d z_s = p_s (log p_s - log p_t - KL):
    # p_s = (0.5, 0.5), log p_s - log p_t = (ln(5/9), ln 5), KL = ln(5/3)
    # -> (0.5 ln(1/3), 0.5 ln 3) = (-0.5493, 0.5493).
    s, t, m = one_token(HALF_HALF, NINE_TENTHS)
    s.requires_grad_(True)
    t.requires_grad_(True)  # as if the caller forgot torch.no_grad(): still detached inside
    token_divergence(s, t, m, "reverse_kl").sum().backward()
    assert s.grad is not None
    assert s.grad.view(-1).tolist() == pytest.approx([-0.5 * LN(3), 0.5 * LN(3)], abs=1e-6)
    assert t.grad is None
    # d KL(p_t || p_s) / d z_s = p_s - p_t = (-0.4, 0.4).
    s.grad = None
    token_divergence(s, t, m, "forward_kl").sum().backward()
    assert s.grad.view(-1).tolist() == pytest.approx([-0.4, 0.4], abs=1e-6)
    assert t.grad is None


def test_bf16_logits_get_an_fp32_result_and_a_bf16_gradient() -> None:
    s, t, m = one_token(HALF_HALF, NINE_TENTHS)
    s = s.bfloat16().requires_grad_(True)
    out = token_divergence(s, t.bfloat16(), m, "reverse_kl")
    assert out.dtype == torch.float32
    # ln 9 = 2.19722 rounds to z = 2.203125 in bf16 (steps of 2^-6 in [2, 4)), and from there on
    # the arithmetic is fp32: p_t = (e^z, 1) / (1 + e^z), and
    # KL(p_s || p_t) = 0.5 ln(0.5 / p_t0) + 0.5 ln(0.5 / p_t1) = 0.5 ln(0.25 (1 + e^z)^2 / e^z).
    z = 2.203125
    assert torch.tensor(LN(9)).bfloat16().item() == z
    want = 0.5 * LN(0.25 * (1 + math.exp(z)) ** 2 / math.exp(z))
    assert out.item() == pytest.approx(want, abs=1e-6)
    out.sum().backward()
    assert s.grad is not None and s.grad.dtype == torch.bfloat16


def test_refusals() -> None:
    s, t, m = one_token(HALF_HALF, NINE_TENTHS)
    with pytest.raises(ValueError, match="known: \\['forward_kl', 'jsd', 'reverse_kl'\\]"):
        token_divergence(s, t, m, "kl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beta"):
        token_divergence(s, t, m, "jsd", beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        token_divergence(s, t, m, "jsd", temperature=0.0)
    with pytest.raises(ValueError, match="one vocabulary"):
        token_divergence(s, torch.zeros(1, 1, 3), m, "reverse_kl")
    with pytest.raises(ValueError, match="reduction"):
        objective_sum(torch.zeros(1, 1), m, "mean")  # type: ignore[arg-type]


def test_objective_reductions_by_hand() -> None:
    # Sequence 0 keeps 3 tokens (1, 2, 3), sequence 1 keeps 1 (10), sequence 2 none.
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [10.0, 0.0, 0.0, 0.0], [0.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # token_mean: 1 + 2 + 3 + 10 = 16 over 4 tokens = 4; sequence_mean: mean(1, 2, 3) + 10 = 12
    # over 2 answers = 6. A row that keeps nothing adds 0 either way.
    assert objective_sum(per_token, mask, "token_mean").item() == pytest.approx(16.0)
    assert objective_sum(per_token, mask, "sequence_mean").item() == pytest.approx(12.0)
    # Nothing kept: 0, still a differentiable tensor.
    empty = per_token.clone().requires_grad_(True)
    for reduction in ("token_mean", "sequence_mean"):
        loss = objective_sum(empty, torch.zeros(3, 4), reduction)  # type: ignore[arg-type]
        assert loss.item() == 0.0 and loss.requires_grad


def test_shards_of_answers_add_up_with_their_whole_lengths() -> None:
    """Sequence parallelism: two ranks each keep their shard's tokens of the same answers; with
    the answers' whole lengths both reductions' parts add up to the unsplit sums (with the
    shards' own counts sequence 0's mean would be mean(1, 2) + mean(3) = 4.5, not 2)."""
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [10.0, 0.0, 0.0, 0.0], [0.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    first = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # the cut after token 2
    lengths = mask.sum(1)
    for reduction, whole in (("token_mean", 16.0), ("sequence_mean", 12.0)):
        parts = [objective_sum(per_token, m, reduction, lengths) for m in (first, mask - first)]
        assert sum(p.item() for p in parts) == pytest.approx(whole), reduction


def test_teacher_gap_closed() -> None:
    # Student 0.30 -> 0.45, teacher 0.50: closed 0.15 of a 0.20 gap = 0.75.
    assert teacher_gap_closed(0.30, 0.45, 0.50) == pytest.approx(0.75)
    # Past the teacher: reported as is, above 1; worse than the start: below 0.
    assert teacher_gap_closed(0.30, 0.60, 0.50) == pytest.approx(1.5)
    assert teacher_gap_closed(0.30, 0.25, 0.50) == pytest.approx(-0.25)
    # No gap to close.
    assert teacher_gap_closed(0.50, 0.60, 0.50) is None
    assert teacher_gap_closed(0.60, 0.60, 0.50) is None
