"""FSDP2 sharding, applied in one place for every model of every stage.

Order (as in torchtitan): shard each decoder block, then the root. Trainable and frozen models go
through the same function; frozen ones simply get no optimizer.

`place_model` decides whether a model is sharded at all: on a mesh of one device it is not
(architecture decision 45). FSDP2 at world size 1 shards over nothing but still pays a pre- and
post-forward hook per block, an all-gather "copy" and DTensor dispatch on every parameter access
(5-7% of a LoRA step on CPU, `bench/fsdp_tax.py`; more where kernels are fast, on a GPU). Unwrapped, the model keeps
the plain module's state-dict names, so DCP checkpoints still resume across world sizes, and the
compute dtype FSDP's MixedPrecisionPolicy would give is given by autocast instead. The few calls
that only exist on FSDP modules go through the helpers here (`grad_sync`, `forward_method`,
`gathered`), which do the right thing for both. `infra.shard_single_device` keeps the sharded
path at world size 1 (to exercise the DTensor code on one device).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks, found by the class names transformers marks as not splittable."""
    # Works through peft wrappers: any transformers model inside declares its block classes.
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    # By base class too: once sharded, a block's class is FSDP2's subclass `FSDP<Block>`.
    blocks = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
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
    mp = MixedPrecisionPolicy(
        param_dtype=compute_dtype(precision, base_dtype), reduce_dtype=torch.float32
    )
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model


# `infra.precision`'s half-precision names (fp32 computes as held). Here, not read from
# posttrain.models.loading: models place their teacher with this module, not the reverse.
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str, base_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype parameters are used in for compute, None = as held. bf16/fp16 precision casts
    them; a bf16 base computes in bf16 whatever the precision (activations out of a bf16 base are
    bf16: heads and adapters compute in bf16 too)."""
    dtype = _HALF.get(precision)
    if dtype is None and base_dtype == torch.bfloat16:
        dtype = torch.bfloat16
    return dtype


def place_model(
    model: nn.Module,
    mesh: DeviceMesh,
    precision: str,
    base_dtype: torch.dtype = torch.float32,
    shard_single_device: bool = False,
) -> nn.Module:
    """Every stage's model goes through here (`posttrain.train.session.start_session`): sharded
    by `shard_model` on a mesh of more than one device (or with `shard_single_device`), returned
    unwrapped on one device. The module must already be on its device, or on the meta device for
    `posttrain.models.sharded_load.fill_from_checkpoint` to fill after (which also moves the real
    parameters, adapters and heads, to the device: `to_empty` works on plain modules too).

    Unwrapped with a compute dtype (`compute_dtype`), the root forward runs under
    `torch.autocast(dtype)`: matmuls take bf16/fp16 inputs as under FSDP's param cast (fp32
    masters, fp32 gradients), while autocast keeps softmax/log-softmax/norm reductions in fp32;
    losses agree with the sharded path to bf16 rounding, not bit for bit. Other entry points
    (`generate`, `decode`) get the same through `forward_method`. peft's input casting is
    switched off there (`_no_adapter_input_casts`)."""
    if mesh.size() > 1 or shard_single_device:
        return shard_model(model, mesh, precision, base_dtype=base_dtype)
    dtype = compute_dtype(precision, base_dtype)
    if dtype is not None:
        device_type = mesh.device_type
        model.forward = _autocast(model.forward, device_type, dtype)  # type: ignore[method-assign]
        model._posttrain_autocast = (device_type, dtype)  # for forward_method
        _no_adapter_input_casts(model)
    return model


def _no_adapter_input_casts(model: nn.Module) -> None:
    """Switch off peft's cast of each LoRA layer's input to the adapter's (fp32) weight dtype,
    as `peft.helpers.disable_input_dtype_casting` does for the span of a context, for good:
    under autocast the bf16 input is cast to fp32 by peft and straight back to bf16 by autocast
    for the adapter's matmul (bf16 -> fp32 -> bf16 is exact), so the pair changes nothing but
    costs two casts forward and two backward per adapted linear (28 of ~240 operators per
    decoder layer, LoRA on all linears). Only where the LoRA dropout is off (the default):
    dropout's 1 / (1 - p) scaling rounds differently in bf16 than in fp32 (one bf16 ulp on
    ~10% of the elements at p = 0.1). Adapters added after placement keep peft's default."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(module, BaseTunerLayer) or not dropouts:
            continue
        if all(isinstance(d, nn.Identity) for d in dropouts.values()):
            module.cast_input_dtype_enabled = False


def _autocast(fn: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return fn(*args, **kwargs)

    return run


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def grad_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (FSDP2's
    `set_requires_gradient_sync`: off for all but the last micro-batch of a step, so gradients
    accumulate locally). Nothing to do for an unwrapped model: there is nothing to reduce."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def forward_method(model: nn.Module, name: str) -> None:
    """Make `model.<name>` (a forward other than `forward`: `generate`, `decode`) run as the
    forward does: under FSDP2's pre/post-forward hooks (all-gather, reshard) when sharded, under
    the model's autocast when unwrapped with a compute dtype. Call once per method."""
    if isinstance(model, FSDPModule):
        register_fsdp_forward_method(model, name)
    elif (amp := getattr(model, "_posttrain_autocast", None)) is not None:
        setattr(model, name, _autocast(getattr(model, name), *amp))


@contextmanager
def gathered(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Keep every sharded block's weights gathered from its first forward until the block exits,
    instead of all-gathering each block again at every forward. For decoding: a generation of n
    tokens otherwise costs n all-gathers of the whole model; this costs one, at the price of
    holding the full (unsharded) weights while it runs. The root module is left alone: FSDP2
    keeps the root's parameters gathered through a registered forward method anyway. An
    unwrapped model has no sharded blocks: nothing to do."""
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
