"""LoRA adapters via peft."""

from __future__ import annotations

import json
from pathlib import Path

from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel

from posttrain.models.sharded_load import adapters_stay_real
from posttrain.sections.shared import LoraConfig


def prepare_for_training(model: PreTrainedModel, activation_checkpointing: bool) -> None:
    """Training-time settings of a base model, before adapters wrap it: optional activation
    checkpointing (non-reentrant, so frozen inputs need no requires_grad trick) and no KV cache
    (a training forward never reuses it)."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, task_type: str = "CAUSAL_LM") -> PeftModel:
    """Wrap `model` with a trainable LoRA adapter named "default"; base weights are frozen.
    With task_type "SEQ_CLS" (reward models) peft also trains and saves the score head in full.

    Must run before FSDP2 sharding, so the adapter's parameters are sharded with their blocks.
    """
    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type=task_type,
        bias="none",
    )
    with adapters_stay_real():  # a base on the meta device keeps its adapter's values
        return get_peft_model(model, peft_cfg)


# peft keeps these as sets and writes them in the set's order, which follows Python's string
# hashing: two runs of one recipe wrote the same weights with differently ordered configs (a
# different file hash, so a different artifact). Their order means nothing to peft.
_SET_FIELDS = ("target_modules", "modules_to_save", "exclude_modules")


def canonical_adapter_configs(folder: Path) -> None:
    """Rewrite every `adapter_config.json` under `folder` with its set-valued fields sorted, so
    an adapter's files are a function of the run, not of PYTHONHASHSEED."""
    for path in folder.rglob("adapter_config.json"):
        config = json.loads(path.read_text())
        for name in _SET_FIELDS:
            if isinstance(config.get(name), list):
                config[name] = sorted(config[name])
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
