"""Whether a reward function can take the call posttrain makes: the check `posttrain validate`
runs on every reward function and verifier a recipe names, before anything trains.

posttrain calls `fn(prompts=..., completions=..., completion_ids=..., stopped=..., **columns,
**kwargs)` (`posttrain.rewards.combine.score_functions`): every argument by keyword, one list
per data column, the recipe's `kwargs` bound first. A function that cannot take that call
fails on the first batch of rollouts, after the stages before it trained.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

# Keyword arguments the caller fills (combine.py's RESERVED, which imports torch).
CALLER_ARGS = ("prompts", "completions", "completion_ids", "stopped")
# Passed, as TRL passes it, in a stage whose episodes have an environment: each episode's
# environment instance, in order; only to a function that names it or takes **kwargs.
ENVIRONMENTS = "environments"


def takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` accepts the keyword `name` (a parameter of that name, or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in params)


def call_problem(
    fn: Callable[..., Any],
    bound: Iterable[str],
    columns: Iterable[str] | None,
    environments: bool = False,
) -> str | None:
    """Why `fn` cannot take posttrain's call (None: it can). `bound`: the recipe's kwargs;
    `columns`: the data columns its rows carry (None: not known now, e.g. a hub dataset);
    `environments`: the stage's episodes have an environment (`environments` is passed)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: its call is checked at run time
    params = sig.parameters.values()
    shown = f"{getattr(fn, '__name__', 'it')}{sig}"
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    if positional:
        return (
            f"{shown}: posttrain passes every argument by keyword; {positional} are positional-only"
        )
    if any(p.kind is p.VAR_KEYWORD for p in params):
        accepted = None
    else:
        accepted = {p.name for p in params if p.kind is not p.VAR_POSITIONAL}
    given = list(dict.fromkeys([*CALLER_ARGS, *bound, *sorted(columns or ())]))
    if accepted is not None and (extra := [n for n in given if n not in accepted]):
        return (
            f"{shown} does not take {', '.join(extra)}, which posttrain passes (prompts, "
            "completions, completion_ids, stopped and every data column, by keyword): add **kwargs"
        )
    required = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if ENVIRONMENTS in required and not environments:
        return f"{shown} needs {ENVIRONMENTS}, which only a stage with a rollout.environment passes"
    given += [ENVIRONMENTS] if environments else []
    if columns is not None and (missing := [n for n in required if n not in given]):
        have = ", ".join(sorted(columns)) or "none"
        return f"{shown} needs {', '.join(missing)}, which the data's rows lack (columns: {have})"
    return None
