"""Deterministic batch order, padding and packing.

The order is a pure function of (seed, optimizer step), so a resumed run — at any world size —
sees exactly the rows an uninterrupted run would have seen, with no sampler state to save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.data.chat import IGNORE
from posttrain.data.segments import flat_batch, target_positions


def epoch_permutation(n_rows: int, epoch: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_rows, generator=g).tolist()


def step_indices(
    n_rows: int, step: int, *, micro: int, accum: int, dp_size: int, rank: int, seed: int
) -> list[list[int]]:
    """Row indices of `rank`'s micro-batches at optimizer step `step` -> [accum][micro].

    Steps walk one endless stream of per-epoch shuffles; global batch g = micro*accum*dp_size takes
    stream positions [step*g, (step+1)*g), rank-major within each micro-batch slot.
    """
    g = micro * accum * dp_size
    perms: dict[int, list[int]] = {}

    def at(pos: int) -> int:
        epoch, off = divmod(pos, n_rows)
        if epoch not in perms:
            perms[epoch] = epoch_permutation(n_rows, epoch, seed)
        return perms[epoch][off]

    base = step * g
    out = []
    for k in range(accum):
        start = base + (k * dp_size + rank) * micro
        out.append([at(start + j) for j in range(micro)])
    return out


def pad_batch(examples: list[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example -> input_ids/labels/attention_mask/position_ids [B, T]
    and the `target_positions` [N] the chunked head scores."""
    width = max(len(e["input_ids"]) for e in examples)
    n = len(examples)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    for i, e in enumerate(examples):
        t = len(e["input_ids"])
        ids[i, :t] = torch.tensor(e["input_ids"])
        labels[i, :t] = torch.tensor(e["labels"])
        mask[i, :t] = 1
        pos[i, :t] = torch.tensor(e.get("position_ids") or list(range(t)))
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "position_ids": pos,
        "target_positions": target_positions(labels),
    }


def collate(
    examples: list[dict[str, list[int]]], pad_id: int, padding_free: bool
) -> dict[str, Any]:
    """One micro-batch: padding-free ([1, N] rows end to end, `flat_batch`) or right-padded
    ([B, T_max], `pad_batch`). Same rows, same per-row results either way."""
    return flat_batch(examples) if padding_free else pad_batch(examples, pad_id)


def pack_examples(examples: list[dict[str, list[int]]], max_len: int) -> list[dict[str, Any]]:
    """Greedy first-fit packing in order; position ids restart at every packed row."""
    packed: list[dict[str, Any]] = []
    cur: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for e in examples:
        t = len(e["input_ids"])
        if cur["input_ids"] and len(cur["input_ids"]) + t > max_len:
            packed.append(cur)
            cur = {"input_ids": [], "labels": [], "position_ids": []}
        cur["input_ids"] += e["input_ids"]
        # The first token of a row must not be predicted from the previous row's last token.
        cur["labels"] += [IGNORE] + e["labels"][1:]
        cur["position_ids"] += list(range(t))
    if cur["input_ids"]:
        packed.append(cur)
    return packed


def regroup_by_tokens(
    rows: list[int], length: Callable[[int], int], budget: int, at_least: int = 1
) -> list[list[int]]:
    """A rank's rows of one step regrouped into micro-batches of at most `budget` tokens:
    longest first, each into the first micro-batch it fits (first-fit decreasing; a row longer
    than the budget goes alone). Then split, largest group first, until there are `at_least`
    groups (ranks must run as many forwards as each other: FSDP gathers are collective).

    Same rows per step as row-count micro-batches, so a token-normalised loss does not change;
    only how many forwards carry them, and how full each is."""
    order = sorted(rows, key=lambda i: (-length(i), i))
    groups: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = length(i)
        for g, u in enumerate(used):
            if u + n <= budget:
                groups[g].append(i)
                used[g] += n
                break
        else:
            groups.append([i])
            used.append(n)
    if at_least > len(rows):
        raise ValueError(f"cannot make {at_least} micro-batches of {len(rows)} rows")
    while len(groups) < at_least:
        big = max(range(len(groups)), key=lambda g: (len(groups[g]), -g))
        g = groups.pop(big)
        groups += [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups
