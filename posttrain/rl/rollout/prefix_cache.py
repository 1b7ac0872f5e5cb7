"""The in-process engine's KV cache kept between the turns of multi-turn episodes.

Without it every turn re-prefills the whole conversation so far: turn k of an episode pays for
the prompt, every earlier reply and every tool result again. With it, a row of the next call
whose prompt extends a kept row (the episode's prompt, its reply, then the tool turn the
template rendered) prefills only the tokens after the kept ones. Rows are matched by their
token ids (`PrefixCache.find`), the way a serving engine's prefix cache matches, so the caller
passes nothing but its prompts; only exact prefixes match (the keys and values of identical
tokens at identical positions under identical weights are identical), and the cache is dropped
whenever the weights change.

A kept row holds the keys and values of the tokens it fed: the prompt and every reply token
but the last (the stop token is sampled, never fed), one (keys, values) pair per layer of shape
[kv_heads, c, head_dim]. A continued batch lays each row's kept tokens right-aligned in a
[n, kv_heads, C, head_dim] block (C = the most kept tokens of a row) and the new tokens
right-aligned after it in [n, T], masked holes between: position ids come from the mask's
running count, so every real token keeps the position it had. Memory: the kept rows of one call
(every row's whole context: 2 x layers x kv_heads x head_dim x bytes per token), plus one
padded copy of a batch while it is assembled; the last call's rows are let go batch by batch
as the new ones are kept.

Only caches whose every layer attends to the whole sequence are kept (a sliding-window layer
keeps only its window, which `find` cannot extend); other models re-prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

_BASE = np.uint64(1_000_003)  # polynomial hash of token prefixes, mod 2^64 (uint64 wraps)


@dataclass(frozen=True)
class Kept:
    """One row's cached tokens and their per-layer (keys, values) [kv_heads, c, head_dim]."""

    ids: tuple[int, ...]
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass
class Continued:
    """A batch continuing from kept rows: the cache [n, kv_heads, C, head_dim] per layer, the
    new tokens `inp` [n, T], `mask` [n, C + T] and `pos` [n, T]."""

    cache: DynamicCache
    inp: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    reused: int  # prompt tokens taken from kept rows instead of prefilled


def full_attention(config: object) -> bool:
    """Whether every layer of a model of `config` caches the whole sequence."""
    layers = DynamicCache(config=config).layers  # type: ignore[arg-type]
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _prefix_hashes(ids: list[int], powers: np.ndarray) -> np.ndarray:
    """hash of ids[:c] at index c - 1, for every c."""
    t = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        return np.cumsum(t * powers[: len(ids)], dtype=np.uint64)


class PrefixCache:
    """The kept rows of the last call, found by the prompts of the next (module docstring)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], Kept] = {}  # (length, prefix hash) -> kept row
        self._powers = np.ones(1, dtype=np.uint64)

    def clear(self) -> None:
        self.rows = {}

    def _hashes(self, ids: list[int]) -> np.ndarray:
        if len(self._powers) < len(ids):  # powers[j] = _BASE ** j, mod 2^64
            steps = np.full(max(len(ids), 2 * len(self._powers)), _BASE, dtype=np.uint64)
            steps[0] = 1
            with np.errstate(over="ignore"):
                self._powers = np.cumprod(steps, dtype=np.uint64)
        return _prefix_hashes(ids, self._powers)

    def find(self, prompts: list[list[int]]) -> list[Kept | None]:
        """For each prompt, the longest kept row whose ids are a strict prefix of it."""
        lengths = sorted({n for n, _ in self.rows}, reverse=True)
        found: list[Kept | None] = []
        for p in prompts:
            hit = None
            if lengths:
                h = self._hashes(p)
                for n in lengths:
                    kept = self.rows.get((n, int(h[n - 1]))) if n < len(p) else None
                    if kept is not None and list(kept.ids) == p[:n]:
                        hit = kept
                        break
            found.append(hit)
        return found

    def keep(self, ids: list[int], cache: DynamicCache, row: int, real: torch.Tensor) -> None:
        """Keep batch row `row` of `cache`: its positions where `real` [S] is set, the tokens
        `ids` (as many as set)."""
        at = real.nonzero().squeeze(1)
        if at.numel() != len(ids):
            raise AssertionError(f"kept {at.numel()} cached positions for {len(ids)} tokens")
        kv = tuple(
            (layer.keys[row].index_select(1, at), layer.values[row].index_select(1, at))
            for layer in cache.layers
        )
        self.rows[(len(ids), int(self._hashes(ids)[-1]))] = Kept(tuple(ids), kv)

    def continued(
        self, kept: list[Kept | None], prompts: list[list[int]], pad_id: int, config: object
    ) -> Continued:
        """The batch of `prompts` (on the kept rows' device) continuing from `kept` rows
        (None: nothing kept, the whole prompt is new)."""
        ref = next(k for k in kept if k is not None).kv
        device = ref[0][0].device
        cached = [len(k.ids) if k is not None else 0 for k in kept]
        tails = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        n, width, t_width = len(prompts), max(cached), max(len(t) for t in tails)
        mask = torch.zeros((n, width + t_width), dtype=torch.long, device=device)
        inp = torch.full((n, t_width), pad_id, dtype=torch.long, device=device)
        cache = DynamicCache(config=config)  # type: ignore[arg-type]
        for layer, (k0, v0) in zip(cache.layers, ref, strict=True):  # [kv_heads, c, head_dim]
            layer.update(
                k0.new_zeros((n, k0.size(0), width, k0.size(2))),
                v0.new_zeros((n, v0.size(0), width, v0.size(2))),
            )
        for i, (k, c, tail) in enumerate(zip(kept, cached, tails, strict=True)):
            if k is not None:
                for layer, (keys, values) in zip(cache.layers, k.kv, strict=True):
                    layer.keys[i, :, width - c :] = keys
                    layer.values[i, :, width - c :] = values
            mask[i, width - c : width] = 1
            inp[i, t_width - len(tail) :] = torch.tensor(tail, dtype=torch.long)
            mask[i, width + t_width - len(tail) :] = 1
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)[:, width:]
        return Continued(cache, inp, mask, pos, sum(cached))
