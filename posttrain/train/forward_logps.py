"""Summed label NLL and log-probs from one forward of a model, full-logits or through the LM
head in chunks (`posttrain.models.chunked`): what SFT, the preference stages and held-out
evaluation train and score on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posttrain.models.chunked import label_logps, model_call
from posttrain.models.sequence_split import shard_logps, shard_row_sums
from posttrain.train.losses import token_logps, token_nll_sum


def forward_nll_sum(
    model: nn.Module, batch: dict[str, Any], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_nll_sum` of one forward over `batch`: (summed NLL of the label tokens, their
    count). `chunk` tokens per pass through the head; 0 = full logits (the unchunked path).
    A sequence-parallel shard (`split_batch`) scores its own targets through the head (all at
    once with `chunk` 0: it has no labels to shift): its share of the micro-batch's sums."""
    if "sequence_parallel" in batch:
        logp, mask = shard_logps(model, batch, chunk)  # [1, N'/P] each
        return -logp.sum(), mask.sum()
    if not chunk:
        return token_nll_sum(model_call(model, batch).logits, batch["labels"])
    logp, mask = label_logps(model, batch, chunk)
    return -logp.sum(), mask.sum()


def forward_sequence_logps(
    model: nn.Module, batch: dict[str, Any], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed label log-prob per row [B] and label count per row [B] from one forward over
    `batch` (padded, or padding-free: rows in the order they were laid out). `chunk` as in
    `forward_nll_sum`. A shard of a sequence-parallel group (`split_batch`): the sums of the
    whole micro-batch's rows, the same on every rank of the group (`shard_row_sums`)."""
    if "sequence_parallel" in batch:
        logp, mask = shard_logps(model, batch, chunk)  # [1, N'/P] each
        # One all-reduce for both: the counts ride along (no grad; exact in fp32 below 2^24).
        dtype = torch.promote_types(logp.dtype, torch.float32)
        sums = shard_row_sums(torch.cat([logp.to(dtype), mask.to(dtype)]), batch)  # [2, rows]
        return sums[0], sums[1].round().long()
    if chunk:
        logp, mask = label_logps(model, batch, chunk)  # [B, T-1] each
    else:
        logp, mask = token_logps(model_call(model, batch).logits, batch["labels"])
    segments = batch.get("segments")
    if segments is None:
        return logp.sum(-1), mask.sum(-1)
    return segments.row_sums(logp), segments.row_sums(mask.long())


def pair_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen logps [B], rejected logps [B], chosen lengths [B], rejected lengths [B]) from one
    `pair_batch` (chosen rows first, then rejected, in one forward); `chunk_tokens` per pass
    through the LM head (0 = full [2B, T, V] logits). Shared by the preference stages."""
    logps, lengths = forward_sequence_logps(model, batch, chunk_tokens)  # [2B] each
    half = logps.size(0) // 2
    return logps[:half], logps[half:], lengths[:half], lengths[half:]
