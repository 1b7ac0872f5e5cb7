"""Reward models: a sequence-classification head (one score) on the base, with a LoRA adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from posttrain.data.batching import collate, pad_batch
from posttrain.errors import RecipeVerdict
from posttrain.models.chunked import model_call
from posttrain.models.sequence_split import sum_over_group
from posttrain.models.sharded_load import CheckpointFiles, build_on_meta


def load_score_model(
    base_dir: str | Path, pad_token_id: int, trust_remote_code: bool = False
) -> PreTrainedModel:
    """Base weights + a fresh 1-output score head (fp32). The score is read at the last
    non-pad token, so the pad id must be set and distinct from real tokens at the end."""
    model = AutoModelForSequenceClassification.from_pretrained(
        str(base_dir), num_labels=1, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    model.config.pad_token_id = pad_token_id
    return model


def score_model_for_training(
    base_dir: str | Path,
    pad_token_id: int,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    attention: str = "auto",
) -> tuple[PreTrainedModel, CheckpointFiles]:
    """`load_score_model` on the meta device (base weights in `dtype`; the fresh score head real,
    fp32, drawn as `from_pretrained` draws it) and the checkpoint `start_session` fills each
    rank's shards from."""
    model, files = build_on_meta(
        base_dir,
        AutoModelForSequenceClassification,
        dtype,
        trust_remote_code=trust_remote_code,
        attention=attention,
        num_labels=1,
    )
    model.config.pad_token_id = pad_token_id  # after construction, as `load_score_model` sets it
    return model, files


def load_reward_model(
    base_dir: str | Path,
    adapter_dir: str | Path,
    pad_token_id: int,
    trust_remote_code: bool = False,
) -> PeftModel:
    base = load_score_model(base_dir, pad_token_id, trust_remote_code)
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False).eval()


def pair_batch(
    pairs: list[dict[str, Any]], pad_id: int, padding_free: bool = False
) -> dict[str, Any]:
    """Chosen sequences then rejected ones in one batch: padded [2B, T] tensors, or padding-free
    ([1, N], the 2B rows end to end: `posttrain.data.segments`)."""
    seqs = [
        {"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"]}
        for side in ("chosen", "rejected")
        for p in pairs
    ]
    return collate(seqs, pad_id, padding_free)


def score_head(model: torch.nn.Module) -> torch.nn.Module:
    """The sequence classifier's per-position head (`score` in every causal-LM family
    transformers gives a sequence-classification class; through peft's modules_to_save
    wrapper, which returns the trained copy's output)."""
    found = [m for name, m in model.named_modules() if name.split(".")[-1] == "score"]
    if not found:
        raise RecipeVerdict(
            "batch.padding_free",
            f"{type(model).__name__} has no `score` head to read padding-free scores from; "
            "set it to false",
        )
    return found[0]  # the outermost: peft's wrapper when there is one


def pair_scores(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards [B], rejected rewards [B]) from one `pair_batch`."""
    scores = sequence_scores(model, batch)  # [2B]
    half = scores.size(0) // 2
    return scores[:half], scores[half:]


def sequence_scores(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """One score per row [B] (fp32): at each row's last token. A padded batch: the model's own
    pooling (last non-pad token). A padding-free one [1, N]: for the duration of the call the
    score head returns, at every position, the vector of the S rows' scores (its own output read
    at each row's last token) [1, N, S], so the model's pooling, at the last token, returns all
    S. The scores must come out of the model's own forward: under FSDP2 that output is what
    gathers the root's weights again for backward. A sequence-parallel shard (`split_batch`):
    `shard_scores`."""
    segments = batch.get("segments")
    if segments is None:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return logits.squeeze(-1).float()
    if "sequence_parallel" in batch:
        return shard_scores(model, batch)
    return scores_at(model, batch, segments.last_positions())


def shard_scores(model: torch.nn.Module, shard: dict[str, Any]) -> torch.Tensor:
    """One score per row [S] of the WHOLE micro-batch from this rank's shard of it, the same on
    every rank of the group: each row's last token lies in one shard; the rank holding it
    reads the row's score there (0 elsewhere) and the group sums the [S] parts, with an
    identity backward (`sum_over_group`), so the score's gradient enters at the rank that read
    it and reaches the other ranks' tokens through attention's exchange."""
    sp, width = shard["sequence_parallel"], shard["input_ids"].shape[1]
    rows = shard["shard_rows"].rows  # the padding row, last, has no score
    last = shard["segments"].last_positions()[:rows] - sp.rank * width  # [S], shard-local
    held = (last >= 0) & (last < width)
    part = scores_at(model, shard, last.clamp(0, width - 1), held)  # [S]
    return sum_over_group(part, sp)


def scores_at(
    model: torch.nn.Module,
    batch: dict[str, Any],
    last: torch.Tensor,
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    """The score head's output at positions `last` [S] of a padding-free batch (or shard)
    [1, N], read through the model's own forward (see `sequence_scores`); 0 where `held` [S]
    is False."""
    head = score_head(model)
    own = head.forward

    def rows_at_every_position(hidden: torch.Tensor) -> torch.Tensor:  # [1, N, H] -> [1, N, S]
        scores = own(hidden)[0, last, 0]  # [S]
        if held is not None:
            scores = torch.where(held, scores, torch.zeros_like(scores))
        return scores.expand(hidden.shape[1], -1).unsqueeze(0)

    head.forward = rows_at_every_position
    try:
        out = model_call(model, batch).logits  # [1, S]
    finally:
        del head.forward
    return out.reshape(-1).float()


@torch.no_grad()
def score_sequences(
    model: torch.nn.Module, seqs: list[list[int]], pad_id: int, batch_size: int = 16
) -> list[float]:
    """Reward of each token sequence (prompt + response, templated)."""
    model.eval()
    device = next(model.parameters()).device
    out: list[float] = []
    for i in range(0, len(seqs), batch_size):
        b = pad_batch([{"input_ids": s, "labels": s} for s in seqs[i : i + batch_size]], pad_id)
        keys = ("input_ids", "attention_mask")
        out += sequence_scores(model, {k: b[k].to(device) for k in keys}).tolist()
    return out
