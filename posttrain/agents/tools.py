"""Tools a recipe names (`module:function`): found and imported under the same rules as reward
functions (`posttrain.rewards.loader`: the recipe's folder, `run.allowed_paths`, a served run's
worker folders), each with the JSON schema the chat template is given through `tools=`.

The schema is transformers' own (`get_json_schema`: type hints plus a Google-style docstring
with an `Args:` section), the shape TRL's `tools=` takes, so the same functions work in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import (
    DocstringParsingException,
    TypeHintParsingException,
)

from posttrain.errors import StageVerdict
from posttrain.rewards.loader import RewardLoadError, load_function


class ToolLoadError(StageVerdict, ValueError):
    """A tool (or an environment) that cannot be found, imported or described to the model;
    a verdict the stage prints in one line."""


@dataclass(frozen=True)
class Tool:
    ref: str  # as the recipe names it
    fn: Callable[..., Any]
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", ...}}
    sha256: str  # its module's source, for the fingerprint

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def describe(fn: Callable[..., Any], ref: str) -> dict[str, Any]:
    """`fn`'s JSON schema, or a ToolLoadError saying what its definition lacks."""
    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as exc:
        raise ToolLoadError(
            f"{ref}: cannot describe it to the model: {exc} (a tool needs type hints on every "
            "argument and a Google-style docstring with an Args: section)"
        ) from None


def load_tools(refs: Sequence[str], roots: Sequence[Path] | None = None) -> list[Tool]:
    """The tools `refs` name, in order; names must differ. `roots` as for reward functions
    (None: references a resolved recipe already pointed at their files)."""
    tools: list[Tool] = []
    for ref in refs:
        try:
            fn, sha = load_function(ref, roots, "tool")
        except RewardLoadError as exc:
            raise ToolLoadError(str(exc)) from None
        tools.append(Tool(ref, fn, describe(fn, ref), sha))
    names = [t.name for t in tools]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ToolLoadError(f"rollout.tools: two tools named {', '.join(dupes)}")
    return tools
