"""A recipe's reward entry (`rewards: [{fn | judge, weight, kwargs}]`); no imports happen here."""

from __future__ import annotations

import re
from typing import Any

from pydantic import field_validator, model_validator

from posttrain.sections.fields import Result, _Section
from posttrain.sections.judge import JudgeConfig

BUILTIN = "posttrain.rewards"

# module.path:function  or  some/file.py:function
_REF = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*)$")


class RewardSpec(_Section):
    fn: str | None = Result(
        None,
        source="code",
        description="The function: `posttrain.rewards.<module>:<name>` (built in), "
        "`<module>:<name>` for `<module>.py` in the recipe's folder or one of "
        "`run.allowed_paths`, or `<file.py>:<name>`. Signature as TRL's reward functions: "
        "(prompts, completions, **columns) -> one float (or None) per row. Exactly one of "
        "`fn` and `judge`.",
    )
    judge: JudgeConfig | None = Result(
        None,
        description="A model as judge instead of a function: a model behind an "
        'OpenAI-compatible server scores each response by a rubric (docs/code-rewards.md, "A model '
        'as judge").',
    )
    weight: float = Result(1.0, description="Weight of this function in the summed reward.")
    kwargs: dict[str, Any] = Result(
        default_factory=dict,
        description="Keyword arguments bound to the function (e.g. `{penalty: -0.5}`).",
    )
    name: str | None = Result(
        None,
        description="Label in metrics and reports; default the function's name, `judge` "
        "for a judge.",
    )

    @field_validator("fn")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        if value is not None:
            split_ref(value)
        return value

    @model_validator(mode="after")
    def _one_scorer(self) -> RewardSpec:
        if (self.fn is None) == (self.judge is None):
            which = "both" if self.fn is not None else "neither"
            raise ValueError(f"fn, judge: give exactly one (a function or a judge), got {which}")
        if self.judge is not None and self.kwargs:
            raise ValueError("kwargs: a judge takes no kwargs (they are a function's arguments)")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return "judge" if self.fn is None else split_ref(self.fn)[1]


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
