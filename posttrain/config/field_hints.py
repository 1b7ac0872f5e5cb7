"""What to suggest for a recipe key the schema does not know: the field it was probably meant to
be, found by spelling distance among the fields valid at that place, by the names other trainers
give the same setting (`posttrain.config.aliases`), or by the same name one level up or down;
and, for a link written in a shorthand section, where links go.

The fields valid at a place come from the schema itself (`model_at`), so a hint can only name a
field that exists.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from posttrain.config.aliases import ALIASES, STAGE
from posttrain.kinds import ROLE_FIELDS, graph_kinds

# How alike two names must be (difflib ratio) to be offered: `max_step`/`max_steps` 0.94,
# `sfft`/`sft` 0.86, `lr`/`lora` 0.67 (not offered).
CUTOFF = 0.75


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a union (X | None, Annotated[Union[...], ...]), else [annotation]."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _is_model(x: Any) -> bool:
    return isinstance(x, type) and issubclass(x, BaseModel)


def _kind_tag(model: type[BaseModel]) -> str | None:
    field = model.model_fields.get("kind")
    if field is None or typing.get_origin(field.annotation) is not Literal:
        return None
    return typing.get_args(field.annotation)[0]


def _field(model: type[BaseModel], key: str) -> Any:
    """The field of `model` written `key` in a recipe (its alias, e.g. `from`, or its name)."""
    for name, f in model.model_fields.items():
        if key == (f.alias or name):
            return f
    return None


def _step(annotation: Any, part: Any) -> Any:
    """The annotation one location part below `annotation` (None when there is none)."""
    for member in _members(annotation):
        if _is_model(member):
            if isinstance(part, str) and _kind_tag(member) == part:
                return member  # a `stages:` entry: the union's tag names its kind
            field = _field(member, part) if isinstance(part, str) else None
            if field is not None:
                return field.annotation
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin in (list, tuple) and isinstance(part, int) and args:
            return args[0]
        if origin is dict and isinstance(part, str) and len(args) == 2:
            return args[1]
    return None


def model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The section model at pydantic location `loc` (`("sft", "optim")` -> OptimConfig,
    `("stages", 0, "dpo")` -> the DPO stage entry), or None when `loc` leads to no section."""
    from posttrain.config.schema import Recipe

    annotation: Any = Recipe
    for part in loc:
        annotation = _step(annotation, part)
        if annotation is None:
            return None
    models = [m for m in _members(annotation) if _is_model(m)]
    return models[0] if models else None


def keys_of(model: type[BaseModel]) -> list[str]:
    """The keys a recipe may write in a `model` section."""
    return [f.alias or name for name, f in model.model_fields.items()]


def exists(loc: Sequence[Any]) -> bool:
    model = model_at(loc[:-1])
    return model is not None and loc[-1] in keys_of(model)


def _stage_loc(place: Sequence[Any]) -> tuple[Any, ...] | None:
    """The location of the training stage section `place` lies in (`("sft",)`,
    `("stages", 2, "dpo")`), or None outside one."""
    if place and place[0] in graph_kinds():
        return tuple(place[:1])
    if len(place) >= 3 and place[0] == "stages" and isinstance(place[1], int):
        return tuple(place[:3])
    return None


def _alias(key: str, place: Sequence[Any], stage_path: str | None) -> str | None:
    """The recipe path an alias `key` maps to at `place` (None when none applies there)."""
    stage = _stage_loc(place)
    for target in ALIASES.get(key, ()):
        head, _, rest = target.partition(".")
        if head != STAGE:
            return target
        if stage is None:
            return target if not place else None  # top level: any stage's section
        if exists((*stage, *rest.split("."))):
            return f"{stage_path}.{rest}"
    return None


def _nearby(key: str, place: Sequence[Any], model: type[BaseModel]) -> str | None:
    """`key` as a field one level down (`sft.lr` -> `optim.lr`) or up (`sft.optim.max_steps`
    -> `max_steps`), relative to `place`'s parent for up (returned with a leading `..`)."""
    for name in keys_of(model):
        child = model_at((*place, name))
        if child is not None and key in keys_of(child):
            return f"{name}.{key}"
    parent = model_at(place[:-1]) if place else None
    if parent is not None and key in keys_of(parent):
        return f"..{key}"
    return None


def suggestion(key: str, place: Sequence[Any], path_of: Any) -> str | None:
    """The recipe path to suggest for unknown `key` at `place` (a pydantic location), or None.
    `path_of(loc)` renders a location as a recipe path (`stages.<name>.x`)."""
    model = model_at(place)
    if model is None:
        return None
    stage = _stage_loc(place)
    stage_path = path_of(stage) if stage else None
    here = path_of(place)
    if target := _alias(key, place, stage_path):
        return target
    # Inside a section, another trainer's name may be the section's name joined to the key
    # (`sft.lora.rank` is TRL's `lora_rank`).
    if place and (target := _alias(f"{place[-1]}_{key}", place[:-1], stage_path)):
        return target
    keys = keys_of(model)
    # Another trainer's exact name with no field here (DPO's `lora_alpha`: DPO continues its
    # parent's adapter) is not respelled into a lookalike alias (`orpo_alpha` -> beta).
    aliases = [a for a in ALIASES if key not in ALIASES and _alias(a, place, stage_path)]
    close = difflib.get_close_matches(key, keys + aliases, n=1, cutoff=CUTOFF)
    if close:
        name = close[0]
        if name in keys:
            return f"{here}.{name}" if here else name
        return _alias(name, place, stage_path)
    found = _nearby(key, place, model)
    if found is None:
        return None
    if found.startswith(".."):
        up = path_of(place[:-1])
        return f"{up}.{found[2:]}" if up else found[2:]
    return f"{here}.{found}" if here else found


def link_hint(key: str, place: Sequence[Any], value: Any) -> str | None:
    """For a link (`from`, `reference`, `reward_model`) written in a shorthand section: where
    links are written instead."""
    if key not in ROLE_FIELDS.values() or len(place) != 1 or place[0] not in graph_kinds():
        return None
    kind = place[0]
    target = value if isinstance(value, str) and value else "sft"
    return (
        "links between stages are set in a stages: entry, e.g. "
        f"stages: [{{kind: {kind}, name: {kind}, {key}: {target}}}] in place of the {kind}: "
        "section (docs/stage-graphs.md)"
    )
