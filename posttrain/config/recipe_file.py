"""A recipe file as data: read and checked YAML, command-line overrides, and `RecipeError`, the
error every recipe problem is reported as (with its own `fix` line).

Apart from the loader so that `extends` (which reads each file it names) and the loader (which
merges them) need not import each other.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import yaml

FIX_FIELDS = (
    "correct the fields named above (docs/recipes.md lists every field); "
    "`posttrain validate` checks a recipe without running it"
)
FIX_PATH = "check the path (run from the folder that holds it, or give an absolute path)"
FIX_YAML = "fix the YAML at the line shown"
FIX_OVERRIDE = "write each override as key.path=value, e.g. sft.optim.lr=1e-4"


class RecipeError(ValueError):
    """A recipe that cannot run; `errors` holds one `field.path: message` line per problem and
    `fix` what to do about them (the CLI's `fix:` line): a missing file needs another path, a
    YAML syntax error an edit at its line, a field error the field corrected."""

    def __init__(self, errors: list[str], source: str = "recipe", fix: str = FIX_FIELDS):
        self.errors = errors
        self.fix = fix
        super().__init__(f"{source} is invalid:\n" + "\n".join(f"  - {e}" for e in errors))


# A recipe is a few hundred values, five levels deep. YAML aliases can make a structure that
# refers to itself (`&a [*a]`) or expands exponentially ("billion laughs"): either would hang
# or crash validation, so a parsed value is walked once, with both bounds, before anything else.
MAX_VALUES = 100_000
MAX_DEPTH = 64


def check_plain(value: Any, where: str) -> list[str]:
    """Errors for a value too deep, recursive or large to be a recipe (aliases expanded)."""
    stack, seen = [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if depth > MAX_DEPTH:
            return [f"{where}: nested more than {MAX_DEPTH} levels deep (a recursive YAML alias?)"]
        if seen > MAX_VALUES:
            return [f"{where}: more than {MAX_VALUES} values once YAML aliases are expanded"]
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list | tuple | set):
            stack.extend((v, depth + 1) for v in node)
    return []


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
    return deepest


def _safe_yaml(text: str) -> Any:
    """yaml.safe_load, whose errors besides YAMLError (a date like 2023-02-30, nesting deeper
    than the parser's recursion) become YAMLError too."""
    # The pure-Python parser recurses per level: "[" * 3000 costs ~2 s before RecursionError.
    # Counting brackets (quoted ones too) over-estimates, which only matters far past MAX_DEPTH.
    if _bracket_depth(text) > 2 * MAX_DEPTH:
        raise yaml.YAMLError(f"brackets nested more than {2 * MAX_DEPTH} deep")
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    except (ValueError, OverflowError) as exc:
        raise yaml.YAMLError(f"{type(exc).__name__}: {exc}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`sft.optim.lr=1e-4` -> (["sft", "optim", "lr"], 0.0001). Values are parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise RecipeError(
            [f"override {item!r}: expected key.path=value"], "overrides", FIX_OVERRIDE
        )
    try:
        value = _safe_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise RecipeError(
            [f"{key}: cannot parse value {raw[:200]!r}: {exc}"], "overrides", FIX_OVERRIDE
        ) from None
    if errors := check_plain(value, key):
        raise RecipeError(errors, "overrides")
    if isinstance(value, str):
        # YAML 1.1 reads "1e-4" (no dot) as a string; on a command line it means a number.
        with contextlib.suppress(ValueError):
            value = float(value) if value.strip().lower() not in ("nan", "inf", "-inf") else value
    return key.split("."), value


def _stage_entry(entries: list[Any], name: str, where: str) -> dict[str, Any]:
    """The `stages:` entry named `name` (its kind when it has no name), for an override."""
    for entry in entries:
        if isinstance(entry, dict) and (entry.get("name") or entry.get("kind")) == name:
            return entry
    names = [e.get("name") or e.get("kind") for e in entries if isinstance(e, dict)]
    raise RecipeError([f"{where}: no stage named {name!r} in stages ({names})"], "overrides")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted override set (creating sections as needed).
    `stages.<name>.field=...` reaches into the `stages:` entry of that name."""
    data = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):  # the `stages:` list: entries by name
                node = _stage_entry(node, part, ".".join(path[: i + 1]))
                continue
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict) and not (part == "stages" and isinstance(nxt, list)):
                where = ".".join(path[: i + 1])
                raise RecipeError(
                    [f"{where}: is a value, cannot set {'.'.join(path)}"], "overrides"
                )
            node = nxt
        node[path[-1]] = value
    return data


def yaml_problem(exc: yaml.YAMLError, source: str) -> str:
    """One line for a YAML error: `recipe.yaml line 12, column 5: <problem> (<context>)`, not
    pyyaml's multi-line dump with its source excerpt."""
    mark = getattr(exc, "problem_mark", None)
    if not isinstance(exc, yaml.MarkedYAMLError) or mark is None:
        return f"{source}: not valid YAML: {exc}"
    text = f"{source} line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    context, where = exc.context, exc.context_mark
    if context and where is not None and where.line != mark.line:
        text += f" ({context} that starts at line {where.line + 1})"
    elif context:
        text += f" ({context})"
    return text


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a recipe file" if p.is_dir() else "no such recipe file"
        raise RecipeError([f"{p}: {what}"], str(p), FIX_PATH)
    try:
        data = _safe_yaml(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RecipeError(
            [f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})"],
            str(p),
            "save the recipe as UTF-8 text",
        ) from None
    except yaml.YAMLError as exc:
        raise RecipeError([yaml_problem(exc, str(p))], str(p), FIX_YAML) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            [f"{p}: top level must be a mapping of sections"],
            str(p),
            "write the recipe as sections (run:, ingest:, sft: ...); docs/recipes.md has them",
        )
    if errors := check_plain(data, str(p)):
        raise RecipeError(errors, str(p), FIX_YAML)
    return data
