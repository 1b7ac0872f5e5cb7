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
the unsplit batch; so do the gradients of replicated weights (LoRA adapters). Per-row sums
(sequence log-probs, for the preference losses) are taken on each rank over its shard's
positions (`ShardRows`: which row each scores) and summed over the group (`shard_row_sums`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
    rows = len(lengths)
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
    segments = Segments.from_lengths(lengths)
    return {
        "input_ids": ids[:, cut],
        "position_ids": pos[:, cut],
        "targets": shard_targets,
        "target_positions": (shard_targets.reshape(-1) != IGNORE).nonzero().squeeze(1),
        "segments": segments,
        "shard_rows": ShardRows(segments.row_of[cut], rows),
        "sequence_parallel": sp,
    }


def shard_tokens(n: int, sp: SequenceParallel) -> int:
    """The real tokens (not the padding row) in this rank's shard of a flat batch of `n` tokens:
    the slices are ceil(n / P) wide, the padding at the end of the last ones."""
    width = -(-n // sp.size)
    return max(0, min(width, n - sp.rank * width))


def group_of(info: Any) -> SequenceParallel | None:
    """The sequence-parallel group of a `DistInfo` (its `sp_group`), None without one."""
    return SequenceParallel.of(info.sp_group) if info.sp_size > 1 else None


Collate = Callable[[list[dict[str, Any]], int, bool], dict[str, Any]]


def splitting(collate: Collate, sp: SequenceParallel | None) -> Collate:
    """`collate` (rows, pad_id, padding_free) -> a batch, then this rank's shard of it
    (`split_batch`); `collate` itself without sequence parallelism. The split takes the
    padding-free layout (the recipe refuses `batch.padding_free: false` with N > 1)."""
    if sp is None:
        return collate

    def split(rows: list[dict[str, Any]], pad_id: int, flat: bool) -> dict[str, Any]:
        if not flat:
            raise ValueError(
                "sequence parallelism splits padding-free batches, and this model takes padded "
                "rows only (see the log's 'padding-free batches off' line); set "
                "infra.sequence_parallel: 1"
            )
        return split_batch(collate(rows, pad_id, True), sp, pad_id)

    return split


def shard_logps(
    model: nn.Module, shard: dict[str, Any], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a causal LM over this rank's shard -> (log-probs [1, N'/P] of the
    shard's targets, 0.0 where IGNORE; mask [1, N'/P] bool), through the chunked head."""
    targets = shard["targets"]
    with scoring_head(model, targets, chunk, positions=shard["target_positions"]):
        logp = model_call(model, shard).logits  # [1, N'/P]
    return logp, targets != IGNORE


@dataclass(frozen=True)
class ShardRows:
    """Which row of the whole micro-batch each position of a shard scores, for per-row sums.

    row_of [N'/P]: the row of each of the shard's positions (its slice of `Segments.row_of`).
    A position scores the next token; where that token opens the next row its target is
    IGNORE (each row's first label is), so crediting a position to its own row loses nothing.
    rows: the rows of the unsplit batch (the padding row, last, scores nothing and is dropped).
    """

    row_of: torch.Tensor
    rows: int

    def to(self, device: Any, non_blocking: bool = False) -> ShardRows:
        return ShardRows(self.row_of.to(device, non_blocking=non_blocking), self.rows)


def shard_row_sums(values: torch.Tensor, shard: dict[str, Any]) -> torch.Tensor:
    """values [K, N'/P] (K per-position quantities of a shard, e.g. its log-probs, 0 where
    nothing is scored) -> per-row sums [K, rows] of the WHOLE micro-batch, the same on every
    rank of the group and differentiable: each rank sums its positions by row, and the group
    all-reduces the parts (`_SumOverGroup`: the gradient reaches each rank's own positions)."""
    sr: ShardRows = shard["shard_rows"]
    sp: SequenceParallel = shard["sequence_parallel"]
    part = values.new_zeros(values.shape[0], shard["segments"].rows)
    part = part.index_add(1, sr.row_of, values)  # [K, rows (+ the padding row)]
    return sum_over_group(part[:, : sr.rows], sp)


def sum_over_group(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The sum of `x` over the ranks of `sp`'s group, differentiable (see `_SumOverGroup`)."""
    if sp.size == 1:
        return x
    return _SumOverGroup.apply(x, sp.group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity. What consumes the sum (a preference
    loss of whole-row log-probs) is computed alike on every rank of the group, so dL/dsum is
    the same on each; each rank's part enters the sum with derivative 1, so its gradient is
    dL/dsum as it stands. The group's parts then add up, through the replicated weights'
    gradient reduction, to the unsplit batch's gradient. (Backward as an all-reduce of the
    gradient would count it P times.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
