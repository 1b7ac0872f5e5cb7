"""The stage registry: every stage kind is declared once, in `posttrain/kinds/<kind>.py`, beside
its recipe section, as `KIND = StageKind(...)`.

The recipe schema (its shorthand sections and the `stages:` graph), the planner, fingerprints,
the memory pre-flight, evaluate/export selection, timeouts, `docs/recipes.md` and the Prefect UI
form all derive from this registry; no other module lists stage names. Adding a kind = its
module here (section + registration), its stage module, its loss, its test, its recipe.

Light on purpose (pydantic only, no torch): the CLI plans a run from it.
"""

from __future__ import annotations

import importlib
import pkgutil

from posttrain.kinds._kind import ROLE_FIELDS, MemoryInputs, Role, StageKind

__all__ = ["KINDS", "ROLE_FIELDS", "MemoryInputs", "Role", "StageKind", "graph_kinds", "kind_of"]


def _discover() -> dict[str, StageKind]:
    found: list[StageKind] = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        kind = getattr(module, "KIND", None)
        if not isinstance(kind, StageKind):
            raise TypeError(f"{module.__name__} declares no KIND = StageKind(...)")
        found.append(kind)
    names = [k.name for k in found]
    if len(set(names)) != len(names):
        raise TypeError(f"two stage kinds share a name: {sorted(names)}")
    return {k.name: k for k in sorted(found, key=lambda k: (k.order, k.name))}


# Every kind, in chain order (ingest first, then the graph kinds, evaluate and export last).
KINDS: dict[str, StageKind] = _discover()


def graph_kinds() -> dict[str, StageKind]:
    """The kinds a recipe's stage graph may hold (not ingest, evaluate, export)."""
    return {n: k for n, k in KINDS.items() if k.placement == "graph"}


def kind_of(module: str) -> StageKind:
    """The kind whose stage module is `module` (a stage process knows itself by its module)."""
    for k in KINDS.values():
        if k.module == module:
            return k
    raise KeyError(f"no stage kind runs module {module}")
