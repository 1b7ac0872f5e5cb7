"""Held-out loss and perplexity over the assistant tokens of padded batches: of a model, or of
one policy of a model that holds several as LoRA adapters (evaluate's base, final policy and
parent share one base)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from peft import PeftModel

from posttrain.data.batching import pad_batch
from posttrain.models.adapters import as_policy
from posttrain.train.forward_logps import forward_nll_sum


def heldout_loss(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device | str,
    chunk_tokens: int = 0,
) -> dict[str, Any]:
    """Token-weighted mean next-token NLL over every label token of every batch (`pad_batch`
    dicts, each tensor [B, T]) -> {"loss", "perplexity", "tokens"}. The sum is divided once by
    the total token count, so the number does not depend on how rows were batched. Eval mode
    for the pass, restored after; `chunk_tokens` per pass through the LM head (0: full logits).
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


def policy_heldout_loss(
    model: PeftModel,
    adapter: str | None,
    examples: list[dict],
    pad_id: int,
    batch_size: int,
    chunk_tokens: int,
) -> dict[str, Any]:
    """`heldout_loss` of the policy of adapter `adapter` (None: the base) over `examples`,
    `batch_size` at a time."""
    batches = (
        pad_batch(examples[i : i + batch_size], pad_id) for i in range(0, len(examples), batch_size)
    )
    with as_policy(model, adapter):
        return heldout_loss(model, batches, next(model.parameters()).device, chunk_tokens)
