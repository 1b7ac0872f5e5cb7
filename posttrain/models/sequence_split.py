"""Splitting one packed (padding-free) micro-batch between the ranks of a sequence-parallel group.

A flat batch (`posttrain.data.segments.flat_batch`: input_ids/labels/position_ids [1, N] and
the rows' `Segments`) becomes, on rank r of P, the contiguous slice r of N'/P tokens, where N'
is N rounded up to a multiple of P by one padding row whose labels are all IGNORE:

- targets are shifted BEFORE slicing: position t predicts labels[t + 1], so the last token of
  slice r predicts the first token of slice r + 1 (a row crossing the boundary loses nothing);
- position ids are those of the unsplit batch (they restart at each row), so rotary
  embeddings see each token where it lies in its row;
- the segments stay those of the whole sequence: after the all-to-all every rank attends over
  all N' tokens (`posttrain.distributed.sequence_parallel`).

The per-rank sums of token NLL (and the rank's log-probs) add up, over the group, to those of
the unsplit batch; so do the gradients of replicated weights (LoRA adapters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posttrain.data.chat import IGNORE
from posttrain.data.segments import Segments
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.chunked import model_call, scoring_head, shifted_targets


def split_batch(batch: dict[str, Any], sp: SequenceParallel, pad_id: int = 0) -> dict[str, Any]:
    """This rank's shard of a flat batch: input_ids/position_ids/targets [1, N'/P] (targets:
    the token each position predicts, IGNORE where none), `target_positions` (the shard's
    scored positions, taken here on the host), the whole sequence's `segments` and `sp`."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]  # [1, N]
    lengths = list(batch["segments"].lengths)
    pad = -ids.shape[1] % sp.size
    if pad:  # a row of its own: attends to itself only, predicts and is predicted by nothing
        ids = torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1)
        labels = torch.cat([labels, labels.new_full((1, pad), IGNORE)], dim=1)
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype).unsqueeze(0)], dim=1)
        lengths.append(pad)
    targets = shifted_targets(labels)  # [1, N'], before the cut
    width = ids.shape[1] // sp.size
    cut = slice(sp.rank * width, (sp.rank + 1) * width)
    shard_targets = targets[:, cut]
    return {
        "input_ids": ids[:, cut],
        "position_ids": pos[:, cut],
        "targets": shard_targets,
        "target_positions": (shard_targets.reshape(-1) != IGNORE).nonzero().squeeze(1),
        "segments": Segments.from_lengths(lengths),
        "sequence_parallel": sp,
    }


def shard_tokens(n: int, sp: SequenceParallel) -> int:
    """The real tokens (not the padding row) in this rank's shard of a flat batch of `n` tokens:
    the slices are ceil(n / P) wide, the padding at the end of the last ones."""
    width = -(-n // sp.size)
    return max(0, min(width, n - sp.rank * width))


def shard_logps(
    model: nn.Module, shard: dict[str, Any], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a causal LM over this rank's shard -> (log-probs [1, N'/P] of the
    shard's targets, 0.0 where IGNORE; mask [1, N'/P] bool), through the chunked head."""
    targets = shard["targets"]
    with scoring_head(model, targets, chunk, positions=shard["target_positions"]):
        logp = model_call(model, shard).logits  # [1, N'/P]
    return logp, targets != IGNORE
