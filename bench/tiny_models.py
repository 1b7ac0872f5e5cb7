"""The models the speed benches share: the two Llama shapes of `sft_throughput.py` (and the
benches that compare against it), a LoRA r16 model of one built from config, and the ingest
section that builds one in a workspace. Imported by the bench scripts (which put this folder on
sys.path), never by the project."""

from __future__ import annotations

from typing import Any

VOCAB = 2048
SIZES = {
    "small": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 256},
    "medium": {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 688},
}


class _Tok:
    """What `posttrain.models.tiny.build_model` reads of a tokenizer."""

    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return VOCAB


def lora_model(shape: dict[str, int]) -> Any:
    """A random-init Llama of `shape` with LoRA r16/alpha 32 (the project's default targets)."""
    from posttrain.config.schema import FromConfigModel, LoraConfig
    from posttrain.models.lora import apply_lora
    from posttrain.models.tiny import build_model

    return apply_lora(
        build_model(FromConfigModel(**shape, vocab_size=VOCAB), _Tok()),
        LoraConfig(r=16, alpha=32),
    )


def ingest_section(shape: dict[str, int]) -> dict[str, Any]:
    """A recipe's `ingest`: a base of `shape` built from config, without pre-training."""
    return {
        "source": "from_config",
        "from_config": {
            **shape,
            "vocab_size": VOCAB,
            "max_position_embeddings": 256,
            "pretrain_steps": 0,
            "corpus_examples": 2000,
        },
    }
