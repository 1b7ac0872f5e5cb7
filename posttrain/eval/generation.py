"""Text generation under a named decoding setting (`SamplingConfig`), reproducible from a seed.

Every decoding knob is passed to `generate` explicitly (`posttrain.models.decoding`, which says
why), so a checkpoint's generation_config.json cannot change what a named setting means.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.models.decoding import generate_kwargs
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rl.rollout.engine import left_pad
from posttrain.sections.shared import SamplingConfig


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    cfg: SamplingConfig,
    seed: int,
    batch_size: int = 8,
) -> list[str]:
    """`generate_ids` decoded: one string per prompt, without the stop token or special tokens."""
    rows = generate_ids(model, tokenizer, prompts, cfg, seed, batch_size)
    return [decode_new(tokenizer, ids, stopped) for ids, stopped in rows]


def decode_new(tokenizer: Any, ids: list[int], stopped: bool) -> str:
    """The text of new token ids from `generate_ids`, without the stop token that ended them."""
    return tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)


def generate_ids(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    cfg: SamplingConfig,
    seed: int,
    batch_size: int = 8,
) -> list[tuple[list[int], bool]]:
    """(new token ids, stopped) per prompt (already chat-templated text), in order. A row ends
    at the first stop id (`model_stop_token_ids`), its last id; a row that never stopped has
    max_new_tokens ids. Prompts are tokenized without special tokens (the template holds them)
    and padded on the LEFT, so new tokens are the columns after the input width. Batch k is
    seeded with seed + k, so a batch's samples do not depend on how many random numbers earlier
    batches used; the caller's global RNG state is restored afterwards.
    """
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    return generate_from_ids(model, tokenizer, ids, cfg, seed, batch_size)


def generate_from_ids(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    cfg: SamplingConfig,
    seed: int,
    batch_size: int = 8,
) -> list[tuple[list[int], bool]]:
    """`generate_ids` of prompts given as token ids (a multi-turn episode's context, kept as
    generated); the same batches, seeds and stops."""
    if not prompts:
        return []
    kwargs = generate_kwargs(cfg)
    stop_ids = model_stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    if pad_id is None and stop_ids:
        pad_id = stop_ids[0]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows: list[tuple[list[int], bool]] = []
    fork_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=fork_devices), torch.no_grad():
            for k, start in enumerate(range(0, len(prompts), batch_size)):
                input_ids, attn = left_pad(prompts[start : start + batch_size], pad_id)  # [b, P]
                torch.manual_seed(seed + k)
                out = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attn.to(device),
                    eos_token_id=stop_ids or None,
                    pad_token_id=pad_id,
                    **kwargs,
                )  # [b, P + new]; rows that stopped early are padded with pad_id
                for row in out[:, input_ids.shape[1] :].tolist():
                    rows.append(cut_at_stop(row, stop_ids))
    finally:
        model.train(was_training)
    return rows


def cut_at_stop(ids: list[int], stop_ids: list[int]) -> tuple[list[int], bool]:
    """`ids` up to and including the first stop id -> (ids, stopped)."""
    stops = set(stop_ids)
    for i, t in enumerate(ids):
        if t in stops:
            return ids[: i + 1], True
    return ids, False
