"""Reward models: a sequence-classification head (one score) on the base, with a LoRA adapter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, PreTrainedModel

from posttrain.data.batching import pad_batch
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


def pair_batch(pairs: list[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen sequences then rejected ones in one padded batch -> [2B, T] tensors."""
    seqs = [
        {"input_ids": p[f"{side}_ids"], "labels": p[f"{side}_labels"]}
        for side in ("chosen", "rejected")
        for p in pairs
    ]
    return pad_batch(seqs, pad_id)


def pair_scores(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards [B], rejected rewards [B]) from one `pair_batch`."""
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scores = scores.squeeze(-1).float()  # [2B]
    half = scores.size(0) // 2
    return scores[:half], scores[half:]


@torch.no_grad()
def score_sequences(
    model: torch.nn.Module, seqs: list[list[int]], pad_id: int, batch_size: int = 16
) -> list[float]:
    """Reward of each token sequence (prompt + response, templated)."""
    model.eval()
    device = next(model.parameters()).device
    out: list[float] = []
    for i in range(0, len(seqs), batch_size):
        chunk = [{"input_ids": s, "labels": s} for s in seqs[i : i + batch_size]]
        b = pad_batch(chunk, pad_id)
        logits = model(
            input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device)
        ).logits
        out += logits.squeeze(-1).float().tolist()
    return out
