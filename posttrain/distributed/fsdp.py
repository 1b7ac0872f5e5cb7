"""FSDP2 sharding, applied in one place for every model of every stage.

Order (as in torchtitan): shard each decoder block, then the root. Trainable and frozen models go
through the same function; frozen ones simply get no optimizer. World size 1 takes this path too,
so single-device runs exercise the same DTensor code as multi-device ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from posttrain.models.loading import DTYPES


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names transformers marks as not splittable."""
    # Works through peft wrappers: any transformers model inside declares its block classes.
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"no decoder blocks found in {type(model).__name__} "
            f"(looked for {sorted(names) or 'transformers _no_split_modules'})"
        )
    return blocks


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: str,
    reshard_after_forward: bool = True,
    base_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Apply `fully_shard` per decoder block, then to the root. Parameters keep their dtypes
    (fp32 masters for what trains; the frozen base in `base_dtype`); with bf16/fp16, or a bf16
    base, the policy casts them for compute and reduces gradients in fp32.

    One group holds a block's frozen bf16 base weights and its fp32 LoRA factors: FSDP2 (torch
    2.13) asks for one original dtype among a group's *trainable* parameters only, and packs an
    all-gather of mixed dtypes as bytes (architecture decision 27). Parameters on the meta device
    stay there (`posttrain.models.sharded_load.fill_from_checkpoint` fills them after)."""
    param_dtype = DTYPES[precision] if precision in ("bf16", "fp16") else None
    if param_dtype is None and base_dtype == torch.bfloat16:
        # Activations out of a bf16 base are bf16: compute everything (heads too) in bf16.
        param_dtype = torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


@contextmanager
def gathered(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Keep every sharded block's weights gathered from its first forward until the block exits,
    instead of all-gathering each block again at every forward. For decoding: a generation of n
    tokens otherwise costs n all-gathers of the whole model; this costs one, at the price of
    holding the full (unsharded) weights while it runs. The root module is left alone: FSDP2
    keeps the root's parameters gathered through a registered forward method anyway."""
    if not enabled:
        yield
        return
    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    for m in blocks:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in blocks:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)
