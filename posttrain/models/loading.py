"""Load the base model, tokenizer and adapters from artifact folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from posttrain.models.sharded_load import CheckpointFiles, attn_kwargs, build_on_meta

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(path: str | Path) -> Any:
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        # Padding positions are masked out of attention and loss, so EOS is a safe pad.
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    attention: str = "auto",
) -> PreTrainedModel:
    """Weights stay in `dtype` (fp32 master weights for training; FSDP2's mixed-precision policy
    casts to bf16 for compute on GPU)."""
    return AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        use_safetensors=True,
        **attn_kwargs(attention),
    )


def load_base(
    ingest_dir: Path,
    manifest: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    attention: str = "auto",
) -> tuple[PreTrainedModel, Any]:
    """The base model and tokenizer an ingest artifact points at, whole on this process (for
    evaluation and export; training stages load sharded: `base_for_training`)."""
    info = manifest["summary"]
    model_dir = Path(info["model_dir"])
    tok = load_tokenizer(ingest_dir / "tokenizer")
    trust = info.get("trust_remote_code", False)
    return load_causal_lm(model_dir, dtype, trust_remote_code=trust, attention=attention), tok


def base_dtype(infra: Any) -> torch.dtype:
    """The frozen base's dtype for a recipe's `infra` section (`auto` as `resolve` makes it)."""
    name = infra.base_dtype
    if name == "auto":
        name = "bf16" if infra.device == "cuda" and infra.precision == "bf16" else "fp32"
    return DTYPES[name]


def base_for_training(
    ingest_dir: Path, manifest: dict[str, Any], dtype: torch.dtype, attention: str = "auto"
) -> tuple[PreTrainedModel, Any, CheckpointFiles]:
    """The base causal LM on the meta device (base weights in `dtype`), its tokenizer, and the
    checkpoint files `start_session` fills each rank's shards from after sharding
    (`posttrain.models.sharded_load`). Adapters go on it under `adapters_stay_real`."""
    info = manifest["summary"]
    tok = load_tokenizer(ingest_dir / "tokenizer")
    model, files = build_on_meta(
        info["model_dir"],
        AutoModelForCausalLM,
        dtype,
        trust_remote_code=info.get("trust_remote_code", False),
        attention=attention,
    )
    return model, tok, files


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable
