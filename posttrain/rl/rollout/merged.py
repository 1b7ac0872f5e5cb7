"""A plain copy of one role of the training model, its LoRA folded in: what the `fast` rollout
engine (`posttrain.rl.rollout.fast_engine`) samples from.

The trainer's model is a peft model (every role a LoRA adapter on one frozen base), sharded by
FSDP2 on more than one device; a sampler wants none of that: an adapter costs two extra matmuls
per projection per token and a sharded block an all-gather per forward. `plain_copy` builds the
bare transformers model of the same config (no peft, no FSDP) in the sampling dtype, and
`refresh` writes into it, tensor by tensor, W + scale * B @ A of the role's adapter (computed in
fp32, cast to the copy's dtype) and every other weight as it is. Under FSDP2 each tensor is
gathered whole (`DTensor.full_tensor`, a collective every rank runs in the same order), one at
a time: the copy costs every rank the full model in the sampling dtype, the gather one tensor
more.
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from peft.utils import ModulesToSaveWrapper
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedModel


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from the ranks when FSDP2 shards it (a collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def sampler_attention(trainer: str | None) -> str:
    """The copy's attention implementation: SDPA where the trainer runs SDPA-like kernels
    (posttrain's varlen kernel for packed batches is SDPA without segments; flash-attention's
    varlen entry is for packed training, while a static-cache decode step under
    torch.compile is transformers' best-trodden path with SDPA), else the trainer's own
    (eager for architectures SDPA does not support, Gemma-2's soft-capped attention)."""
    if trainer in (None, "sdpa", "posttrain_varlen") or str(trainer).startswith("flash_"):
        return "sdpa"
    return trainer


def plain_copy(trainer_lm: PreTrainedModel, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An empty plain causal LM of `trainer_lm`'s config (its weights uninitialised until
    `refresh`), in `dtype` on `device`, in eval mode. `trainer_lm`: the peft model's base
    model (`RoleModel.causal_lm`), whose LoRA layers `refresh` folds in."""
    config = trainer_lm.config.__class__.from_dict(trainer_lm.config.to_dict())
    config._attn_implementation = sampler_attention(trainer_lm.config._attn_implementation)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.to_empty(device=device)
    plain.generation_config = trainer_lm.generation_config
    plain.eval()
    plain.requires_grad_(False)
    return plain


def _source(trainer_lm: nn.Module, path: str, attr: str, role: str) -> torch.Tensor:
    """Parameter `attr` of module `path` in the trainer's model, as the role computes it: a
    LoRA layer's base weight with the role's adapter folded in, a wrapped module's copy of the
    role (peft's modules_to_save), else the parameter itself."""
    m = trainer_lm.get_submodule(path) if path else trainer_lm
    if isinstance(m, ModulesToSaveWrapper):
        # nn.ModuleDict has no .get
        m = m.modules_to_save[role] if role in m.modules_to_save else m.original_module  # noqa: SIM401
    if not isinstance(m, LoraLayer):
        return _full(getattr(m, attr))
    base = _full(getattr(m.get_base_layer(), attr))
    if attr != "weight":
        return base
    if role in m.lora_A:
        a, b = _full(m.lora_A[role].weight).float(), _full(m.lora_B[role].weight).float()
        delta = b @ a  # [out, r] @ [r, in] -> [out, in]
    elif role in m.lora_embedding_A:
        a, b = _full(m.lora_embedding_A[role]).float(), _full(m.lora_embedding_B[role]).float()
        delta = (b @ a).T  # [dim, r] @ [r, vocab] -> [vocab, dim], the embedding's layout
    else:
        return base
    if m.use_dora.get(role):
        raise ValueError(
            "rollout.engine: fast folds plain LoRA into its copy; a DoRA adapter is not one: "
            "use engine: hf"
        )
    if getattr(m, "fan_in_fan_out", False):
        delta = delta.T
    return (base.float() + m.scaling[role] * delta).to(base.dtype)


@torch.no_grad()
def refresh(plain: nn.Module, trainer_lm: nn.Module, role: str) -> None:
    """Write `role`'s weights of `trainer_lm` (the peft model's base model, LoRA layers
    included) into `plain` (`plain_copy`), one tensor at a time; buffers (rotary frequencies)
    too, in their own dtype. Every rank calls it at once under FSDP2 (each tensor's gather is a
    collective)."""
    # Every name of a tied weight (the head tied to the embedding), so a tie `to_empty` undid
    # still reads the same values.
    for name, p in plain.named_parameters(remove_duplicate=False):
        path, _, attr = name.rpartition(".")
        p.copy_(_source(trainer_lm, path, attr, role))
    for name, buf in plain.named_buffers():
        path, _, attr = name.rpartition(".")
        src = _full(_source(trainer_lm, path, attr, role))
        owner = plain.get_submodule(path) if path else plain
        owner._buffers[attr] = src.to(device=buf.device).clone()
