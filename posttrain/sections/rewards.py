"""A recipe's reward-function entry (`rewards: [{fn, weight, kwargs}]`); no imports happen here."""

from __future__ import annotations

import re
from typing import Any

from pydantic import field_validator

from posttrain.sections.fields import Result, _Section

BUILTIN = "posttrain.rewards"

# module.path:function  or  some/file.py:function
_REF = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


class RewardSpec(_Section):
    fn: str = Result(
        source="code",
        description="The function: `posttrain.rewards.<module>:<name>` (built in), "
        "`<module>:<name>` for `<module>.py` in the recipe's folder or one of "
        "`run.allowed_paths`, or `<file.py>:<name>`. Signature as TRL's reward functions: "
        "(prompts, completions, **columns) -> one float (or None) per row.",
    )
    weight: float = Result(1.0, description="Weight of this function in the summed reward.")
    kwargs: dict[str, Any] = Result(
        default_factory=dict,
        description="Keyword arguments bound to the function (e.g. `{penalty: -0.5}`).",
    )
    name: str | None = Result(
        None, description="Label in metrics and reports; default the function's name."
    )

    @field_validator("fn")
    @classmethod
    def _reference(cls, value: str) -> str:
        split_ref(value)
        return value

    @property
    def label(self) -> str:
        return self.name or split_ref(self.fn)[1]


def split_ref(fn: str) -> tuple[str, str]:
    """`module:function` -> (module or file path, function); ValueError for anything else."""
    m = _REF.match(fn.strip())
    if not m:
        raise ValueError(
            f"{fn!r} is not `module:function` or `file.py:function` "
            "(e.g. posttrain.rewards.math:answer_match)"
        )
    return m["module"], m["attr"]


def is_builtin(fn: str) -> bool:
    module = split_ref(fn)[0]
    return module == BUILTIN or module.startswith(BUILTIN + ".")


def is_file_ref(module: str) -> bool:
    return module.endswith(".py") or "/" in module or module.startswith("~")
