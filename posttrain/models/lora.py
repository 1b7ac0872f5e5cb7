"""LoRA adapters via peft."""

from __future__ import annotations

from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel

from posttrain.config.schema import LoraConfig


def apply_lora(model: PreTrainedModel, cfg: LoraConfig) -> PeftModel:
    """Wrap `model` with a trainable LoRA adapter named "default"; base weights are frozen.

    Must run before FSDP2 sharding, so the adapter's parameters are sharded with their blocks.
    """
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
        bias="none",
    )
    return get_peft_model(model, peft_cfg)
