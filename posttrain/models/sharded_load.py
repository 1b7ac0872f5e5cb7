"""Load a base model so that no rank ever holds all of it (architecture decision 27).

The order, as in torchtitan: build the model on the meta device from its config (no memory),
put the adapters and heads on it (real tensors, initialised exactly as on a loaded base), shard
with FSDP2 (`posttrain.distributed.fsdp.shard_model`), then `fill_from_checkpoint`: allocate only
this rank's shard of each base parameter (`to_empty`) and read just those rows from the
safetensors files (`safe_open(...).get_slice(name)[start:stop]`). A rank's peak is its shard of
the base plus the largest single slice it reads, not the whole model.

What is not a base parameter keeps the values it was built with:
- parameters the checkpoint lacks (a sequence-classification score head) are made real on CPU
  at build time and initialised by the model's own `_init_weights`, which draws from the same
  RNG as `from_pretrained` does when it initialises a missing key;
- LoRA adapters: peft moves a new adapter to its base layer's device; on a meta base that would
  discard its values, so `adapters_stay_real` keeps them where peft created them (CPU, fp32):
  same RNG draws, same values as on a loaded base, and no bf16 rounding of an fp32 master.
  (LoRA on embedding layers keeps its factors as bare parameters, which this does not cover:
  such a target fails loudly in `fill_from_checkpoint`, naming the parameter.)
Non-persistent buffers (rotary `inv_freq`) are recomputed by `_init_weights` after sharding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, PreTrainedModel

INDEX = "model.safetensors.index.json"
log = logging.getLogger("posttrain.models")


@dataclass(frozen=True)
class CheckpointFiles:
    """Where each tensor of a safetensors checkpoint lives: {tensor name: file}."""

    folder: Path
    where: dict[str, Path]

    @classmethod
    def of(cls, folder: str | Path) -> CheckpointFiles:
        """One `model.safetensors`, or the shards a `model.safetensors.index.json` lists."""
        folder = Path(folder)
        if (folder / INDEX).exists():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            return cls(folder, {k: folder / f for k, f in weight_map.items()})
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors files (and no {INDEX})")
        where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), "pt") as st:
                where.update(dict.fromkeys(st.keys(), f))  # noqa: SIM118 (safe_open has no __iter__)
        return cls(folder, where)


def attn_kwargs(attention: str) -> dict[str, str]:
    """transformers' `attn_implementation` for `infra.attention` (`auto`: the library's default,
    SDPA for every family this project trains)."""
    return {} if attention == "auto" else {"attn_implementation": attention}


def build_on_meta(
    model_dir: str | Path,
    auto_cls: Any,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    attention: str = "auto",
    **config_overrides: Any,
) -> tuple[PreTrainedModel, CheckpointFiles]:
    """The model of `model_dir`'s config on the meta device, base parameters in `dtype`; what the
    checkpoint does not hold (a score head) is real, fp32 and initialised (module docstring)."""
    files = CheckpointFiles.of(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    with torch.device("meta"):
        model = auto_cls.from_config(
            config,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **attn_kwargs(attention),
        )
    # Tied parameters appear once, under their source name.
    missing = [n for n, _ in model.named_parameters() if checkpoint_key(n, files) is None]
    body = f"{model.base_model_prefix}."
    if lost := [n for n in missing if n.startswith(body)]:
        # A head may be new (a score head on a causal-LM checkpoint); the body never is.
        raise _no_tensor(model_dir, lost)
    for name in missing:
        module = model.get_submodule(name.rpartition(".")[0])
        if any(p.is_meta for p in module.parameters(recurse=False)):
            log.info("%s: not in the checkpoint, initialised fresh (fp32)", name)
            module.to_empty(device="cpu", recurse=False).float()
            with torch.no_grad():
                model._init_weights(module)
    return model, files


def _no_tensor(folder: str | Path, names: list[str]) -> ValueError:
    more = f" (+{len(names) - 5} more)" if len(names) > 5 else ""
    return ValueError(f"{folder}: no tensor in the checkpoint for {names[:5]}{more}")


@contextmanager
def adapters_stay_real() -> Iterator[None]:
    """While adapters are added to a base on the meta device, a module that holds real tensors is
    not moved to meta (peft moves each new adapter, and its `modules_to_save` copies, to the
    device and dtype of the base layer it wraps; on a meta base that discards their values). They
    stay as created (CPU, fp32); `fully_shard` later moves them to the device. On a real base
    nothing changes: only moves to meta are held back."""
    original = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        real = any(not t.is_meta for t in (*self.parameters(), *self.buffers()))
        if device is not None and device.type == "meta" and real:
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.to = original  # type: ignore[method-assign]


_WRAPPER_PARTS = ("base_layer",)
_WRAPPER_PREFIXES = ("lm.", "base_model.model.")


def checkpoint_key(param_name: str, files: CheckpointFiles) -> str | None:
    """The checkpoint tensor a (possibly peft-wrapped) parameter name holds, or None.
    `lm.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` ->
    `model.layers.0.self_attn.q_proj.weight`."""
    name = param_name
    for prefix in _WRAPPER_PREFIXES:
        name = name.removeprefix(prefix)
    name = ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)
    if name in files.where:
        return name
    # A checkpoint of the bare decoder (no head) names its tensors without the "model." prefix.
    bare = name.removeprefix("model.")
    return bare if bare in files.where else None


def _local_view(p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's tensor of p, the slices of the full tensor it holds)."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
    else:
        shape, offset, local = tuple(p.shape), (0,) * p.dim(), p
    return local, tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


def _owner_init(model: nn.Module) -> dict[nn.Module, PreTrainedModel]:
    """{module: the innermost transformers model that contains it} (its `_init_weights`
    knows how that architecture initialises the module)."""
    owner: dict[nn.Module, PreTrainedModel] = {}
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            for sub in m.modules():
                owner[sub] = m  # inner models come later in modules() order and win
    return owner


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """[(module, attribute), ...] for each parameter that more than one module holds."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
    return [h for h in holders.values() if len(h) > 1]


@torch.no_grad()
def fill_from_checkpoint(model: nn.Module, files: CheckpointFiles, device: torch.device) -> int:
    """After `place_model` (sharded or not): allocate every meta parameter's local shard (the
    whole tensor when unwrapped) on `device` and read its rows from the checkpoint; keep every
    real parameter's values; recompute non-persistent buffers. Returns the bytes read by this rank. Raises naming any meta parameter that has no
    tensor in the checkpoint."""
    kept = {
        n: _local_view(t)[0].detach().clone()
        for n, t in (*model.named_parameters(), *model.named_buffers())
        if not _local_view(t)[0].is_meta
    }
    missing = [
        n for n, p in model.named_parameters() if n not in kept and checkpoint_key(n, files) is None
    ]
    if missing:
        raise _no_tensor(files.folder, missing)
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    tied = _shared_parameters(model)
    model.to_empty(device=device)
    # On an unwrapped model `to_empty` gives each module its own new tensor for a parameter two
    # modules share (tied embeddings); share it again. (FSDP2 keeps the tie: a no-op there.)
    for (owner, name), *aliases in tied:
        for module, attr in aliases:
            setattr(module, attr, getattr(owner, name))
    for name, b in model.named_buffers():
        if name in kept:
            b.copy_(kept.pop(name))
    n_read = 0
    for name, p in model.named_parameters():
        local, index = _local_view(p)
        if name in kept:
            local.copy_(kept.pop(name))
            continue
        key = checkpoint_key(name, files)
        assert key is not None
        if local.numel() == 0:  # more ranks than rows: this rank holds none of it
            continue
        # One open per tensor: the mmap (and the page cache it pins in this process's RSS) is
        # released before the next tensor, so a rank never maps more than one tensor's file.
        with safe_open(str(files.where[key]), "pt") as f:
            rows = f.get_slice(key)[index]
        local.copy_(rows.to(local.dtype))
        n_read += rows.numel() * rows.element_size()
        del rows
    owner = _owner_init(model)
    for name in meta_buffers:
        module = model.get_submodule(name.rpartition(".")[0])
        key = checkpoint_key(name, files)
        if key is not None:  # a persistent buffer the checkpoint holds
            with safe_open(str(files.where[key]), "pt") as f:
                module.get_buffer(name.rpartition(".")[2]).copy_(f.get_tensor(key))
        else:  # rotary inv_freq and the like: computed from the config
            owner[module]._init_weights(module)
    return n_read
