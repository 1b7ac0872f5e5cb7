"""Several LoRA adapters on one base: the trainable policy and a frozen reference share the base
weights, so a DPO/PPO stage holds one copy of the base instead of two models."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import PreTrainedModel

from posttrain.models.sharded_load import adapters_stay_real

POLICY, REFERENCE = "default", "reference"


def trainable_adapter(base: PreTrainedModel, adapter_dir: Path) -> PeftModel:
    """Base + a saved adapter as the trainable policy ("default"), to continue training it (a
    stage that goes on from another stage's policy)."""
    with adapters_stay_real():  # a base on the meta device keeps the adapter's values
        return PeftModel.from_pretrained(
            base, str(adapter_dir), adapter_name=POLICY, is_trainable=True
        )


def policy_with_reference(
    base: PreTrainedModel, policy_adapter: Path, reference_adapter: Path | None = None
) -> PeftModel:
    """Base + two adapters: "default" (trainable, continues from `policy_adapter`) and
    "reference" (frozen; `reference_adapter`, by default the same policy: never the raw base).
    The reference has no gradients and so no optimizer state."""
    model = trainable_adapter(base, policy_adapter)
    with adapters_stay_real():  # a base on the meta device keeps the adapters' values
        model.load_adapter(
            str(reference_adapter or policy_adapter), adapter_name=REFERENCE, is_trainable=False
        )
    for name, p in model.named_parameters():
        if f".{REFERENCE}." in name:
            p.requires_grad_(False)
    return model


@contextmanager
def active_adapter(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Route every LoRA layer through adapter `name` for the duration.

    Sets the layers' active adapter directly rather than through `PeftModel.set_adapter`, which
    also flips `requires_grad` (it would make the frozen reference trainable and the policy
    frozen mid-step, and FSDP2 would then see changed gradient layouts).
    """
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    previous = [m._active_adapter for m in layers]
    for m in layers:
        m._active_adapter = name
    try:
        yield
    finally:
        for m, prev in zip(layers, previous, strict=True):
            m._active_adapter = prev


@contextmanager
def reference_pass(model: torch.nn.Module) -> Iterator[None]:
    """The frozen reference's forward: the "reference" adapter, in eval mode for the duration
    (no dropout: the reference is a function of its weights, not of the RNG stream, whatever
    dropout the SFT adapter it copies was trained with), then the previous mode again."""
    was_training = model.training
    model.eval()
    try:
        with active_adapter(model, REFERENCE):
            yield
    finally:
        model.train(was_training)


def as_policy(model: PeftModel, adapter: str | None) -> AbstractContextManager[None]:
    """A context in which `model` is the policy of adapter `adapter` (`active_adapter`), or the
    base when `adapter` is None (every adapter off: the base's own weights)."""
    return model.disable_adapter() if adapter is None else active_adapter(model, adapter)


def merged_copy(model: PeftModel, adapter: str) -> PreTrainedModel:
    """A copy of the policy of `adapter` with its LoRA merged into the weights (what export
    ships): a plain `transformers` model in eval mode. Costs one more copy of the model while it
    lives; `model` itself is left as it was."""
    merged = copy.deepcopy(model)
    merged.set_adapter(adapter)  # first: deleting the active adapter would switch to another
    for name in list(merged.peft_config):
        if name != adapter:
            merged.delete_adapter(name)
    return merged.merge_and_unload().eval()
