"""Held-out loss and perplexity over the assistant tokens of padded batches."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from posttrain.train.chunked import forward_nll_sum


def heldout_loss(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device | str,
    chunk_tokens: int = 0,
) -> dict[str, Any]:
    """Token-weighted mean next-token NLL over every label token of every batch.

    batches: dicts from `pad_batch` (input_ids/labels/attention_mask/position_ids, each [B, T]).
    The sum over all batches is divided once by the total token count, so a short last batch
    weighs per token, not per batch, and the number does not depend on how rows were batched.
    Returns {"loss", "perplexity" = exp(loss), "tokens"}. The model is put in eval mode for the
    pass (no dropout) and returned to training mode afterwards if it was training, so a training
    loop can call this between steps. `chunk_tokens`: tokens per pass through the LM head
    (`posttrain.train.chunked`; 0 = full [B, T, V] logits).
    """
    was_training = model.training
    model.eval()
    nll_total = 0.0  # python float (fp64): fp32 sums of many tokens drift
    tokens = 0
    try:
        with torch.no_grad():
            for batch in batches:
                b = {k: v.to(device) for k, v in batch.items()}
                nll, n = forward_nll_sum(model, b, chunk_tokens)
                nll_total += float(nll)
                tokens += int(n)
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("held-out batches contain no label tokens to score")
    loss = nll_total / tokens
    # exp overflows a float above ~709; a loss that large means "no better than nothing" anyway.
    perplexity = math.exp(loss) if loss < 700 else math.inf
    return {"loss": loss, "perplexity": perplexity, "tokens": tokens}
