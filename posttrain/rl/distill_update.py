"""On-policy distillation's update (`posttrain.rl.distill`): the student's own samples scored
token by token by the frozen teacher, one optimizer step on the divergence between them.

Per micro-batch of `micro` rollout rows: the teacher's logits at the response positions
(no grad), the student's (with grad), both sliced to the shared vocabulary (heads padded to
different sizes within a family), the per-token divergence of `cfg.loss` at `cfg.temperature`
(`posttrain.rl.distill_losses.token_divergence`, chunked: no full fp32 log-softmax of either
model is ever held), then backward. The step's loss is a mean over every rank's response tokens
(`token_mean`) or answers (`sequence_mean`): each rank backpropagates its sum x world / global
count, and FSDP's gradient averaging divides the world back, so the result does not depend on
how rows are split over ranks or micro-batches.

Each forward of a sharded model (student or teacher) is a collective: every rank runs as many
micro-batches as the rank with the most rows; a rank out of rows runs a filler row of weight 0.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum, all_reduce_sums, min_max
from posttrain.models.adapters import POLICY
from posttrain.models.teacher import teacher_logits
from posttrain.rl.distill_losses import token_divergence
from posttrain.rl.rollout.sample import Rollout, model_inputs
from posttrain.train.session import TrainSession


@dataclass(frozen=True)
class DistillStats:
    """What one distillation step measured, over all ranks."""

    # teacher_kl: the mean per-token divergence (cfg.loss) of the student's answers from the
    # teacher; teacher_agreement: the share of answer tokens where both models' most likely next
    # token is the same (teacher-forced on the student's sample); loss: the step's objective
    means: dict[str, float]
    tokens: int  # response tokens over all ranks
    grad_norm: float  # before clipping
    lr: float
    updates: int  # optimizer steps: 1, or 0 when the rollout had no response token


def micro_divergence(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    ro: Rollout,
    rows: list[int],
    cfg: Any,
    vocab: int,
    packed: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token divergence [n, R] with grad to the student, mask [n, R], student logits
    [n, R, vocab], teacher logits [n, R, vocab]) of rollout rows `rows`."""
    inp = model_inputs(ro, rows, packed, device)
    t_logits = teacher_logits(teacher, inp, vocab)  # [n, R, vocab], no grad
    s_logits = student(POLICY, **inp)[..., :vocab]  # [n, R, vocab]
    mask = ro.mask[rows].to(device)  # [n, R]
    per_token = token_divergence(
        s_logits, t_logits, mask, cfg.loss, beta=cfg.beta, temperature=cfg.temperature
    )
    return per_token, mask, s_logits, t_logits


def objective_sum(per_token: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """This micro-batch's share of the step's loss before scaling: the summed divergence of its
    tokens (token_mean), or the sum of each answer's mean divergence (sequence_mean)."""
    if reduction == "token_mean":
        return (per_token * mask).sum()
    return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1.0)).sum()


def distill_update(
    tr: TrainSession,
    teacher: torch.nn.Module,
    ro: Rollout,
    cfg: Any,
    micro: int,
    vocab: int,
    step: int,
    packed: bool = False,
) -> DistillStats:
    """One optimizer step of the student (`tr.model`) towards `teacher` on this rank's rollout
    `ro`, `micro` rows per forward (module docstring). `step`: the logged step (1-based)."""
    device, world = tr.dist.device, tr.dist.world_size
    counts = all_reduce_sums(
        {"tokens": ro.mask.sum(), "answers": (ro.mask.sum(1) > 0).sum()}, device
    )  # one collective for both
    tokens, answers = int(counts["tokens"]), int(counts["answers"])
    if not tokens:
        return DistillStats({}, 0, math.nan, math.nan, 0)
    count = tokens if cfg.reduction == "token_mean" else answers
    rows = list(range(ro.n))
    n_micro = int(min_max(math.ceil(len(rows) / micro), device)[1])
    sums: Counter[str] = Counter()
    share = 0.0
    for k in range(n_micro):
        chunk, weight = rows[k * micro : (k + 1) * micro], 1.0
        if not chunk:  # this rank is out of rows: a filler forward that counts for nothing
            chunk, weight = [0], 0.0
        grad_sync(tr.model, k == n_micro - 1)
        per_token, mask, s_logits, t_logits = micro_divergence(
            tr.model, teacher, ro, chunk, cfg, vocab, packed, device
        )
        objective = objective_sum(per_token, mask, cfg.reduction) * (weight * world / count)
        tr.backward(objective)
        share += float(objective.detach()) / world
        with torch.no_grad():
            keep = mask * weight
            same = (s_logits.argmax(-1) == t_logits.argmax(-1)).float()
            sums["divergence"] += float((per_token.detach() * keep).sum())
            sums["agree"] += float((same * keep).sum())
    loss = all_reduce_sum(share, device)
    norm, lr = tr.optimizer_step(cfg.optim.max_grad_norm, loss=loss, step=step)
    t = all_reduce_sums(dict(sums), device)
    means = {
        "loss": loss,
        "teacher_kl": t["divergence"] / tokens,
        "teacher_agreement": t["agree"] / tokens,
    }
    return DistillStats(means, tokens, norm, lr, 1)
