"""The folders a rollout server loads the policy from, one per policy version.

A version is the policy after some number of updates (0: the stage's starting policy). Its
folder is written by rank 0 under `<stage>/serving/` (which the artifact's manifest does not
hash, and which the stage removes when it ends) and named `policy-v<N>`; the reference policy
(the held-out baseline) is `reference`.

- `adapter` (the default): the policy's LoRA adapter in peft format (`adapter_config.json`,
  `adapter_model.safetensors`: megabytes, whatever the base's size). vLLM and SGLang load it by
  name onto the base they serve. For `transformers serve`, which loads whole model folders,
  the folder also links the base's weights, config and the stage's tokenizer: transformers
  applies an adapter it finds beside a model's own files.
- `merged`: the base with the adapter folded in, written tensor by tensor from the base's
  safetensors files (`merge_into`: one tensor in memory at a time, so a 70B base merges on a
  host that could never hold it whole), plus the config and tokenizer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What the base keeps beside its weights that a server reads (the tokenizer comes from the
# stage's own tokenizer folder, which may carry a replaced chat template).
MODEL_FILES = ("config.json", "generation_config.json")


def version_name(version: int) -> str:
    return f"policy-v{version}"


def _link(src: Path, dst: Path) -> None:
    dst.unlink(missing_ok=True)
    os.symlink(src.resolve(), dst)


def weight_files(model_dir: Path) -> list[Path]:
    """The base's safetensors files (one, or the shards an index names)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no safetensors weights for the rollout server to load")
    return files


def servable_base(folder: Path, model_dir: Path, tokenizer_dir: Path) -> Path:
    """`folder` made a model folder a server can load: links to the base's files and to the
    stage's tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES + ("model.safetensors.index.json",):
        if (model_dir / name).is_file():
            _link(model_dir / name, folder / name)
    for f in weight_files(model_dir):
        _link(f, folder / f.name)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            _link(f, folder / f.name)
    return folder


def adapter_version(folder: Path, adapter_dir: Path, base: Path | None) -> Path:
    """A version folder from a saved peft adapter: its files (copied), and with `base` (a
    `servable_base` folder) the base's files linked beside them; the adapter's config names
    `base` (or the folder itself) as its base model."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if base is not None:
        for f in base.iterdir():
            tmp.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(f) if f.is_symlink() else f.resolve(), tmp / f.name)
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(adapter_dir / name, tmp / name)
    config = json.loads((tmp / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str((base or folder).resolve())
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def _lora_scale(config: dict[str, Any]) -> float:
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(
            "rollout.server.weights: merged folds plain LoRA (one rank and alpha, no DoRA) into "
            "the base; this adapter is not one: use weights: adapter"
        )
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def merge_into(folder: Path, base: Path, adapter_dir: Path) -> Path:
    """A version folder of the base with the adapter folded in: for every base weight W that
    has a LoRA pair (A [r, in], B [out, r]), W + scale * B @ A computed in fp32 and cast back
    to W's dtype; other tensors as they are. `base`: a `servable_base` folder."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = _lora_scale(config)
    lora: dict[str, torch.Tensor] = {}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            lora[k.removeprefix("base_model.model.")] = f.get_tensor(k)
    if any(".lora_embedding_" in k or k.endswith(".lora_magnitude_vector") for k in lora):
        raise ValueError("rollout.server.weights: merged folds linear LoRA layers only")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    used = 0
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            os.symlink(os.readlink(f) if f.is_symlink() else f.resolve(), tmp / f.name)
            continue
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(f), "pt") as src:
            for k in src.keys():  # noqa: SIM118
                w = src.get_tensor(k)
                stem = k.removesuffix(".weight")
                a, b = lora.get(f"{stem}.lora_A.weight"), lora.get(f"{stem}.lora_B.weight")
                if a is not None and b is not None:
                    w = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
                    used += 1
                out[k] = w.contiguous()
            metadata = src.metadata()
        save_file(out, str(tmp / f.name), metadata=metadata)
        del out
    if used * 2 != sum(1 for k in lora if ".lora_" in k):
        raise ValueError(
            f"rollout.server.weights: merged found {used} of the adapter's "
            f"{sum(1 for k in lora if '.lora_A.' in k)} LoRA layers in the base's weights"
        )
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
