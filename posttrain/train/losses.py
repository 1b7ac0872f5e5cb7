"""Loss functions: small, pure, tested against hand-computed numbers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.data.chat import IGNORE


def token_nll_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token negative log-likelihood and the number of scored tokens.

    logits: [B, T, V]; labels: [B, T] with IGNORE where no loss is taken. Position t predicts
    labels[t + 1]. Returning the sum (not the mean) lets the caller normalise by the number of
    target tokens in the whole global batch, across micro-batches and ranks, so every token
    weighs the same however the batch is split.
    """
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    nll = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    return nll, (shift_labels != IGNORE).sum()
