"""Fold a LoRA adapter into its base weights and save a plain transformers checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import PreTrainedModel

from posttrain.models.loading import load_causal_lm

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")


def merge_adapter(
    base_dir: str | Path,
    adapter_dir: str | Path,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Base + adapter -> one model with W' = W + (alpha / r) * B @ A, cast to `dtype`.

    The merge runs in fp32 whatever the base's stored dtype, and the cast comes last: merging in
    bf16 would round W and the small update B @ A separately (the update can be below bf16's
    resolution for a weight of W's size and vanish), instead of rounding their sum once.
    """
    base = load_causal_lm(base_dir, torch.float32, trust_remote_code=trust_remote_code)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
    merged = peft_model.merge_and_unload()  # the plain transformers model, LoRA layers removed
    return merged.to(dtype)


def save_export(model: PreTrainedModel, tokenizer: Any, out_dir: str | Path) -> list[Path]:
    """Save weights (safetensors), config, generation config and tokenizer -> files in out_dir.

    transformers 5 always writes safetensors (its `safe_serialization` flag is gone); the check
    below keeps it that way, since a pickle export can run code when loaded.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    files = sorted(p for p in out.rglob("*") if p.is_file())
    pickles = [p.name for p in files if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise RuntimeError(f"export wrote pickle files {pickles}; expected safetensors only")
    if not any(p.suffix == ".safetensors" for p in files):
        raise RuntimeError(f"export wrote no *.safetensors weights in {out}")
    return files
