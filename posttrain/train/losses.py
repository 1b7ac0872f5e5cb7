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


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each labelled token: logits [B, T, V], labels [B, T] (IGNORE outside
    the response; position t predicts labels[t + 1]) -> (logps [B, T-1], 0.0 where IGNORE;
    mask [B, T-1] bool). log_softmax in fp32."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    mask = shift_labels != IGNORE
    safe = shift_labels.masked_fill(~mask, 0)
    logps = torch.gather(shift_logits.log_softmax(-1), 2, safe.unsqueeze(-1)).squeeze(-1)
    return logps * mask, mask


def pair_outcome(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[B] 1 where chosen scores above rejected, 0.5 on a tie, 0 below: the terms of a pairwise
    accuracy. A tie counts half, so a model that cannot tell the two apart (a policy equal to
    its reference, at DPO's step 0) scores chance, 0.5, not 0."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


def pair_tie(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[B] 1 where the pair's two scores are equal: the share of ties a held-out accuracy
    reports beside itself."""
    return (chosen == rejected).float()


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: float = 0.0
) -> torch.Tensor:
    """Reward-model pairwise loss per pair: -log sigmoid(r_chosen - r_rejected - margin).

    chosen_rewards, rejected_rewards: [B] scalar scores. Returns losses [B]. A positive margin
    asks the model to separate the pair by at least that much (Llama 2's margin term).
    """
    return -F.logsigmoid(chosen_rewards - rejected_rewards - margin)
