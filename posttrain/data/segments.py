"""Padding-free batches: the rows of a micro-batch laid end to end in one [1, N] sequence.

A padded micro-batch of B rows costs B x T_max tokens through every linear layer; laid end to
end it costs N = sum of the real lengths. Position ids restart at every row (so rotary
embeddings see each row as it would alone), and `Segments` says where each row lies, so that
attention stays inside its row (`posttrain.models.varlen_attention`) and per-row sums (sequence
log-probs, reward scores) can be taken.

Targets: position t predicts labels[t + 1], so the last token of row i would predict the first
token of row i + 1. Each row's first label is set to IGNORE (it is never a target in a padded
row either), so no loss or log-prob crosses a row boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.data.chat import IGNORE


@dataclass(frozen=True)
class Segments:
    """Where the rows of a flat [1, N] batch lie.

    lengths: row lengths (python ints: known when the batch is built, so no device sync).
    row_of / pos_of [N]: the row of each flat token and its position in that row.
    gather [S, L]: flat index of token j of row s (L = the longest row; slots past a row's end
    point at that row's first token and are never read by a real query: attention is causal).
    cu_seqlens [S+1] int32: where each row starts, then N (flash varlen kernels' layout).
    """

    lengths: tuple[int, ...]
    row_of: torch.Tensor
    pos_of: torch.Tensor
    gather: torch.Tensor
    cu_seqlens: torch.Tensor

    @classmethod
    def from_lengths(cls, lengths: list[int]) -> Segments:
        lens = torch.tensor(lengths, dtype=torch.long)
        starts = torch.cumsum(lens, 0) - lens  # [S]
        row_of = torch.repeat_interleave(torch.arange(len(lengths)), lens)  # [N]
        pos_of = torch.arange(int(lens.sum())) - starts[row_of]  # [N]
        width = max(lengths)
        j = torch.arange(width)
        gather = starts[:, None] + torch.where(j[None, :] < lens[:, None], j[None, :], 0)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)]).to(torch.int32)
        return cls(tuple(lengths), row_of, pos_of, gather, cu)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Segments:
        move = {"device": device, "non_blocking": non_blocking}
        return Segments(
            self.lengths,
            self.row_of.to(**move),
            self.pos_of.to(**move),
            self.gather.to(**move),
            self.cu_seqlens.to(**move),
        )

    def row_sums(self, values: torch.Tensor) -> torch.Tensor:
        """values [1, N] (or [1, N-1]: per shifted position t, credited to the row of token
        t + 1, i.e. the row whose label it scores) -> per-row sums [S]."""
        v = values.reshape(-1)
        rows = self.row_of if v.numel() == self.row_of.numel() else self.row_of[1:]
        return v.new_zeros(self.rows).index_add(0, rows, v)

    def last_positions(self) -> torch.Tensor:
        """Flat index of each row's last token [S] (where a sequence classifier reads)."""
        lens = torch.tensor(self.lengths, device=self.gather.device)
        return torch.cumsum(lens, 0) - 1


def flat_batch(examples: list[dict[str, list[int]]]) -> dict[str, Any]:
    """Rows end to end -> input_ids/labels/position_ids [1, N] and `segments`; no padding and
    no attention_mask (the segments confine attention). Rows that carry `position_ids` (rows
    packed by `pack_examples`) keep theirs, and each packed piece counts as its own row; with
    the `target_positions` [M] the chunked head scores."""
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    lengths: list[int] = []
    for e in examples:
        p = e.get("position_ids") or list(range(len(e["input_ids"])))
        ids += e["input_ids"]
        lab = list(e["labels"])
        # Each piece starts where its position ids restart at 0.
        starts = [i for i, x in enumerate(p) if x == 0] or [0]
        for a, b in zip(starts, starts[1:] + [len(p)], strict=True):
            lengths.append(b - a)
            lab[a] = IGNORE  # the previous row's last token must not predict it
        labels += lab
        pos += p
    label_tensor = torch.tensor([labels], dtype=torch.long)
    return {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "labels": label_tensor,
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "segments": Segments.from_lengths(lengths),
        "target_positions": target_positions(label_tensor),
    }


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices [N] into the [B * T] positions of `labels` [B, T] (a host tensor) of the
    positions that predict a label: t where labels[b, t + 1] != IGNORE. Taken here, on the host
    side of the data loader, so the chunked LM head (`posttrain.models.chunked.head_scores`)
    gathers and scatters by index: a boolean mask on the device has a data-dependent size, and
    indexing by it waits for the device (one host sync per forward)."""
    b, t = labels.shape
    scored = labels.new_zeros((b, t), dtype=torch.bool)
    scored[:, :-1] = labels[:, 1:] != IGNORE
    return scored.reshape(-1).nonzero().squeeze(1)


def batch_rows(batch: dict[str, Any]) -> int:
    """Rows (sequences) in a batch (flat or padded)."""
    if "segments" in batch:
        return batch["segments"].rows
    return batch["input_ids"].size(0)


def layout_stats(batches: list[dict[str, Any]], real: int) -> dict[str, float]:
    """How a step's micro-batches were laid out, for metrics.jsonl: the share of token slots
    that were padding (0 when padding-free) and the number of forwards. `real`: the step's real
    tokens, which the caller counted on the host (the slots are read from shapes: no sync)."""
    slots = sum(b["input_ids"].numel() for b in batches)
    return {"padding_frac": round(1 - real / max(1, slots), 4), "forwards": len(batches)}


def pair_tokens(pair: dict[str, Any]) -> int:
    """Tokens one encoded preference pair costs in a forward: both replies with their prompt."""
    return len(pair["chosen_ids"]) + len(pair["rejected_ids"])
