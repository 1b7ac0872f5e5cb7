"""Token-level distillation losses: small pure functions over the student's and teacher's logits.

On-policy distillation (GKD, Agarwal et al. 2024, arXiv 2306.13649) scores every token of the
student's own samples under a frozen teacher and pulls the student's next-token distribution
towards the teacher's. With p_s = softmax(student_logits / T), p_t = softmax(teacher_logits / T)
over the vocabulary, per token:

    reverse_kl   KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)      mode-seeking; GKD's default
    forward_kl   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)      mean-seeking (classic KD)
    jsd          generalised Jensen-Shannon, beta in [0, 1], TRL's convention (below)

JSD convention: TRL's `GKDTrainer.generalized_jsd_loss` (trl 1.16,
trl/experimental/gkd/gkd_trainer.py), Eq. (1) of the GKD paper with P = teacher, Q = student:

    0 < beta < 1:  M = beta p_t + (1 - beta) p_s
                   JSD_beta = beta KL(p_t || M) + (1 - beta) KL(p_s || M)
    beta = 0:      KL(p_t || p_s)   forward KL
    beta = 1:      KL(p_s || p_t)   reverse KL

The end points are set apart on purpose, as TRL does: the mixture formula itself goes to 0 at
both ends (beta = 0 gives M = p_s and KL(p_s || p_s) = 0), as beta KL(p_t || p_s) near 0 and as
(1 - beta) KL(p_s || p_t) near 1. So beta = 0 and 1 are the limits of JSD_beta / beta and
JSD_beta / (1 - beta): the direction the loss moves towards, not its scale. A beta of 0.01 is
therefore ~100x smaller than beta = 0, not equal to it; a test holds our numbers to TRL's at
beta 0, 0.5 and 1.

Memory: the caller's logits [B, T, V] already exist (in the model's dtype, 2 bytes a value in
bf16). What must not exist at once is an fp32 log-softmax of both models over all B*T tokens
(8 x 2048 x 151,936 (Qwen2) x 4 bytes = 10 GB per copy, and the divergence needs several). So
`token_divergence` works `chunk_tokens` rows at a time, forward and backward (the backward
recomputes each chunk's log-softmaxes instead of keeping them), and only rows the mask keeps go
through it. The one full-size buffer it makes is the gradient of the student's logits, in their
dtype, which any loss on logits needs.

Teacher logits are detached inside: no gradient ever reaches the teacher (the caller should
still compute them under torch.no_grad(), so no graph is built for the teacher at all).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

DivergenceKind = Literal["reverse_kl", "forward_kl", "jsd"]
Reduction = Literal["token_mean", "sequence_mean"]

# Rows of the flattened [B*T, V] logits per chunk. One [chunk, V] fp32 buffer at 1024 rows and
# V = 151,936 (Qwen2) is 1024 x 151,936 x 4 B = 0.62 GB. Peak per chunk, measured on CPU (peak
# RSS, bf16 logits [1024, 151,936], 128-row chunks): forward ~6.3 buffers for either KL (the two
# upcast logits and log-softmaxes, exp, difference, product) and ~8.7 for jsd (the mixture's log
# and a second KL); backward (recompute plus autograd) ~7.5 and ~12, on top of the gradient
# [B*T, V] in the logits' dtype. So at 1024 rows ~4-5 GB (KL) to ~7.5 GB (jsd) whatever B*T is,
# against 10 GB for ONE fp32 copy of 8 x 2048 tokens' logits; lower it on a tight device.
DEFAULT_CHUNK_TOKENS = 1024


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p (log p - log q) over the last dim: [c, V] x 2 -> [c].

    Terms with p = 0 count 0 (0 log 0 = 0), also where log q = -inf (a logit masked to -inf):
    the difference is zeroed before the product, so neither the value nor its gradient is NaN.
    """
    p = log_p.exp()
    diff = torch.where(p > 0, log_p - log_q, 0.0)
    return (p * diff).sum(-1)


def reverse_kl(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    return _kl(log_ps, log_pt)  # KL(p_s || p_t): [c, V] x 2 -> [c]


def forward_kl(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    return _kl(log_pt, log_ps)  # KL(p_t || p_s)


def jsd(log_ps: torch.Tensor, log_pt: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalised JSD in TRL's convention (module docstring): [c, V] x 2 -> [c].

    log M = logaddexp(log p_s + log(1 - beta), log p_t + log beta), in log space so that small
    probabilities keep their precision; beta = 0 and 1 are forward and reverse KL.
    """
    if beta == 0.0:
        return _kl(log_pt, log_ps)
    if beta == 1.0:
        return _kl(log_ps, log_pt)
    log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
    return beta * _kl(log_pt, log_m) + (1 - beta) * _kl(log_ps, log_m)


Divergence = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
DIVERGENCES: dict[str, Divergence] = {
    "reverse_kl": reverse_kl,
    "forward_kl": forward_kl,
    "jsd": jsd,
}


def _chunk(
    student_rows: torch.Tensor,
    teacher_rows: torch.Tensor,
    divergence: Divergence,
    beta: float,
    temperature: float,
) -> torch.Tensor:
    """[c, V] logits (any float dtype) -> [c] fp32 divergence: upcast, divide by the temperature,
    log-softmax in fp32 (bf16 log-probs lose the small differences the KL is made of)."""
    log_ps = F.log_softmax(student_rows.float() / temperature, dim=-1)
    log_pt = F.log_softmax(teacher_rows.float() / temperature, dim=-1)
    return divergence(log_ps, log_pt, beta)


class _ChunkedDivergence(torch.autograd.Function):
    """(student [N, V], teacher [N, V] detached, rows [n] long, divergence, beta, temperature,
    chunk) -> [n] fp32: the divergence of each selected row, `chunk` rows at a time.

    Backward recomputes each chunk with autograd and writes its gradient straight into one
    [N, V] buffer, so neither the chunks' log-softmaxes nor a full-size gradient per chunk (what
    slicing's own backward would allocate) are ever kept."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        student: torch.Tensor,
        teacher: torch.Tensor,
        rows: torch.Tensor,
        divergence: Divergence,
        beta: float,
        temperature: float,
        chunk: int,
    ) -> torch.Tensor:
        out = torch.empty(rows.numel(), dtype=torch.float32, device=student.device)
        for s in range(0, rows.numel(), chunk):
            idx = rows[s : s + chunk]
            rows_s, rows_t = student.index_select(0, idx), teacher.index_select(0, idx)
            out[s : s + chunk] = _chunk(rows_s, rows_t, divergence, beta, temperature)
        ctx.save_for_backward(student, teacher, rows)
        ctx.args = (divergence, beta, temperature, chunk)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        student, teacher, rows = ctx.saved_tensors
        divergence, beta, temperature, chunk = ctx.args
        grad = torch.zeros_like(student)  # [N, V]; rows the mask dropped keep 0
        for s in range(0, rows.numel(), chunk):
            idx = rows[s : s + chunk]
            with torch.enable_grad():
                x = student.index_select(0, idx).detach().requires_grad_(True)
                val = _chunk(x, teacher.index_select(0, idx), divergence, beta, temperature)
                (g,) = torch.autograd.grad(val, x, grad_out[s : s + chunk])
            grad.index_copy_(0, idx, g)
        return grad, None, None, None, None, None, None


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    kind: DivergenceKind,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Per-token divergence of the student from the teacher (module docstring): [B, T] fp32,
    differentiable with respect to student_logits only.

    student_logits, teacher_logits: [B, T, V] next-token logits at the same positions, same
        vocabulary V (a teacher whose head is padded to another size, Qwen2.5-0.5B 151,936 rows
        and -7B 152,064, is sliced to the shared tokenizer's length by the caller).
    mask: [B, T], nonzero at the response tokens that count; the result is 0 elsewhere, and those
        rows are never computed (their logits may be anything, even NaN).
    """
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; known: {sorted(DIVERGENCES)}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ: token-level distillation needs one vocabulary "
            f"(slice a padded head to the tokenizer's length)"
        )
    b, t, v = student_logits.shape
    assert mask.shape == (b, t), f"mask {tuple(mask.shape)} is not [B, T] = {(b, t)}"
    rows = (mask.reshape(-1) != 0).nonzero().squeeze(1)  # [n] kept rows of [B*T]
    values = _ChunkedDivergence.apply(
        student_logits.reshape(b * t, v),
        teacher_logits.detach().reshape(b * t, v),
        rows,
        DIVERGENCES[kind],
        float(beta),
        float(temperature),
        int(chunk_tokens),
    )  # [n]
    per_token = values.new_zeros(b * t).index_copy(0, rows, values)
    return per_token.view(b, t)


def objective_sum(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    reduction: Reduction,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """per_token [B, T], mask [B, T] -> a micro-batch's share of the step's loss before scaling:
    the summed divergence of its kept tokens (token_mean, TRL's "batchmean" once divided by the
    step's token count), or the sum of each answer's mean divergence (sequence_mean, divided by
    the step's answer count). Summed, not averaged, so micro-batches and ranks add up exactly.
    `lengths` [B]: each answer's token count for sequence_mean (None: the mask's); under
    sequence parallelism the mask is a shard's tokens and `lengths` the whole answers', so the
    shards' sums add up to the answers' means."""
    m = (mask != 0).to(per_token.dtype)
    if reduction == "token_mean":
        return (per_token * m).sum()
    if reduction == "sequence_mean":
        n = m.sum(-1) if lengths is None else lengths.to(per_token.dtype)
        return ((per_token * m).sum(-1) / n.clamp_min(1.0)).sum()
    raise ValueError(f"unknown reduction {reduction!r}; known: ['sequence_mean', 'token_mean']")


def teacher_gap_closed(student_start: float, student_end: float, teacher: float) -> float | None:
    """(end - start) / (teacher - start), not clipped (above 1 the student passed the teacher);
    None when teacher <= start (no gap to close)."""
    gap = teacher - student_start
    if gap <= 0:
        return None
    return (student_end - student_start) / gap
