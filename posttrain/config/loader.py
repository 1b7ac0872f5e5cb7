"""Load a recipe: YAML file + dotted overrides -> validated, resolved `Recipe`.

Resolution turns every `auto` into a concrete value (device, devices_per_node, precision) and
fills the derived batch field, so the recipe written into a run folder says exactly what ran.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from posttrain.config.batch import ResolvedBatch, resolve_batch
from posttrain.config.schema import Recipe
from posttrain.secrets import find_secrets


class RecipeError(ValueError):
    """A recipe that cannot run; `errors` holds one `field.path: message` line per problem."""

    def __init__(self, errors: list[str], source: str = "recipe"):
        self.errors = errors
        super().__init__(f"{source} is invalid:\n" + "\n".join(f"  - {e}" for e in errors))


def format_validation_error(err: ValidationError) -> list[str]:
    """One line per error, each starting with its dotted field path (`sft.optim.lr: ...`)."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; see docs/recipes.md)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def parse_override(item: str) -> tuple[list[str], Any]:
    """`sft.optim.lr=1e-4` -> (["sft", "optim", "lr"], 0.0001). Values are parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError([f"override {item!r}: expected key.path=value"], "overrides")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise RecipeError([f"{key}: cannot parse value {raw!r}: {exc}"], "overrides") from exc
    if isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; on a command line it means a number.
        with contextlib.suppress(ValueError):
            value = float(value) if value.strip().lower() not in ("nan", "inf", "-inf") else value
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override set (creating sections as needed)."""
    data = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                where = ".".join(path[: i + 1])
                raise RecipeError(
                    [f"{where}: is a value, cannot set {'.'.join(path)}"], "overrides"
                )
            node = nxt
        node[path[-1]] = value
    return data


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise RecipeError([f"{p}: no such recipe file"], str(p))
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise RecipeError([f"{p}: not valid YAML: {exc}"], str(p)) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError([f"{p}: top level must be a mapping of sections"], str(p))
    return data


def secret_errors(data: Any) -> list[str]:
    """One `field.path: ...` line per secret-looking value. The recipe has no secret fields, so
    a token anywhere in it is a mistake, and a recipe is copied into run folders, specs, the
    Prefect UI and manifests. The value itself is never echoed."""
    return [
        f"{where}: looks like a secret ({kind}); a recipe holds no credentials (they would be "
        "copied into run folders, manifests and the Prefect UI): pass them through the "
        "environment, e.g. HF_TOKEN"
        for where, kind in find_secrets(data)
    ]


def validate_recipe(data: dict[str, Any], source: str = "recipe") -> Recipe:
    if errors := secret_errors(data):
        raise RecipeError(errors, source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc), source) from exc


def _cuda_devices() -> int:
    # No NVIDIA device node: no GPU, and the orchestrating process need not import torch (2-4 s).
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _bf16_supported() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve(recipe: Recipe) -> Recipe:
    """Make every `auto` concrete and every path absolute; check batch arithmetic."""
    r = recipe.model_copy(deep=True)
    infra = r.infra
    gpus = None
    if infra.device == "auto" or infra.devices_per_node == "auto" or infra.precision == "auto":
        gpus = _cuda_devices()
    if infra.device == "auto":
        infra.device = "cuda" if gpus else "cpu"
    if infra.devices_per_node == "auto":
        infra.devices_per_node = gpus if infra.device == "cuda" else 1
    if infra.precision == "auto":
        infra.precision = "bf16" if infra.device == "cuda" and _bf16_supported() else "fp32"
    errors = []
    if infra.device == "cpu" and infra.precision in ("bf16", "fp16"):
        errors.append(
            f"infra.precision: {infra.precision} on CPU is refused: half-precision matmul on CPU is "
            "~100x slower than fp32 here; use fp32 (or precision: auto)"
        )
    r = resolve_paths(r)
    for name, section in r.training_sections().items():
        try:
            b = section_batch(r, name)
            section.batch.micro_batch_size = b.micro_batch_size
            section.batch.grad_accum_steps = b.grad_accum_steps
            section.batch.global_batch_size = b.global_batch_size
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise RecipeError(errors)
    return r


def resolve_paths(recipe: Recipe) -> Recipe:
    """A copy with the workspace and every data/model path absolute (against the current
    directory). What `posttrain serve`/`submit` send: paths are the sender's, while `auto`
    devices and precision stay for the machine that runs the flow to resolve."""
    r = recipe.model_copy(deep=True)
    r.run.workspace = str(Path(r.run.workspace).expanduser().resolve())
    if r.ingest.path:
        r.ingest.path = str(Path(r.ingest.path).expanduser().resolve())
    for section in r.training_sections().values():
        for attr in ("path", "eval_path"):
            value = getattr(section.data, attr)
            if value:
                setattr(section.data, attr, str(Path(value).expanduser().resolve()))
    return r


def section_batch(recipe: Recipe, name: str) -> ResolvedBatch:
    """The resolved batch triple of training section `name` (sft, reward, dpo)."""
    b = getattr(recipe, name).batch
    dp = recipe.infra.world_size()
    return resolve_batch(
        b.micro_batch_size, b.grad_accum_steps, b.global_batch_size, dp, where=f"{name}.batch"
    )


def load_recipe(
    path: str | os.PathLike[str], overrides: list[str] | None = None, devices: bool = True
) -> Recipe:
    """Read, override, validate and resolve a recipe file. Raises RecipeError listing every problem.

    `devices=False` resolves paths only (`resolve_paths`), for a recipe that will run elsewhere.
    """
    data = apply_overrides(read_yaml(path), overrides or [])
    recipe = validate_recipe(data, str(path))
    return resolve(recipe) if devices else resolve_paths(recipe)
