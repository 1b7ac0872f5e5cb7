"""Load the base model, tokenizer and adapters from artifact folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(path: str | Path) -> Any:
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        # Padding positions are masked out of attention and loss, so EOS is a safe pad.
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> PreTrainedModel:
    """Weights stay in `dtype` (fp32 master weights for training; FSDP2's mixed-precision policy
    casts to bf16 for compute on GPU)."""
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
    )
    return model


def load_base(
    ingest_dir: Path, manifest: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, Any]:
    """The base model and tokenizer an ingest artifact points at."""
    info = manifest["summary"]
    model_dir = Path(info["model_dir"])
    tok = load_tokenizer(ingest_dir / "tokenizer")
    model = load_causal_lm(model_dir, dtype, trust_remote_code=info.get("trust_remote_code", False))
    return model, tok


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
