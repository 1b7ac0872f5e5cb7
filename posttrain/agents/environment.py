"""Environments a recipe names (`rollout.environment: module:Class`), in the shape TRL's
`environment_factory` takes: one instance per episode.

- `reset(**row_columns) -> str | None`: called with the prompt row's columns; a string is
  appended to the last user message.
- its public methods (not `reset`, `step`, `get_reward`, nothing starting with `_`) are the
  episode's tools, described to the model like `rollout.tools` (type hints and docstring).
- `get_reward() -> float` (optional): the finished episode's score.
- or, for environments that are not tool sets (games, simulators), a gym-like
  `step(assistant_message) -> (observation messages, reward, done)`.

A stage may name several classes (`{name: module:Class}`, TRL's multi-environment shape): each
prompt row names its own in its `environment` column (`ROUTE`), and its episode sees that
class's tools and gets that class's reward only.

What an environment's code does wrong (raises, returns the wrong type) fails the stage with one
line naming the class, the method and the row (`EnvironmentFailed`); what a tool does wrong is
the model's to read (`posttrain.agents.tool_runner`).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.agents.tools import ToolLoadError, describe
from posttrain.errors import StageVerdict
from posttrain.rewards.loader import RewardLoadError, load_function

RESERVED = ("reset", "step", "get_reward")

# The column a prompt row names its environment class in, when a stage has several (TRL's).
ROUTE = "environment"


class EnvironmentFailed(StageVerdict):
    """An environment's own code failed: one line naming class, method and row (a verdict on
    the user's code: the stage prints it without a traceback wall, kept in logs/error.txt)."""


@dataclass(frozen=True)
class StepResult:
    observations: list[dict[str, Any]]  # messages to append (role user or tool)
    reward: float
    done: bool


@dataclass
class EnvironmentClass:
    ref: str
    cls: type
    sha256: str
    tool_names: list[str] = field(default_factory=list)
    schemas: list[dict[str, Any]] = field(default_factory=list)  # the tools', described at load

    @property
    def is_gym(self) -> bool:
        return callable(getattr(self.cls, "step", None))

    @property
    def has_reward(self) -> bool:
        return callable(getattr(self.cls, "get_reward", None))

    @property
    def rewards(self) -> bool:
        """Whether its episodes get a reward of its own (get_reward, or step's rewards). As in
        TRL, `get_reward` is optional: the stage's reward functions may score it alone."""
        return self.has_reward or self.is_gym


def no_reward(env: EnvironmentClass, rewards_field: str) -> str:
    """Why episodes of `env` nothing scores are refused, naming the two ways to score them."""
    return (
        f"{env.cls.__name__} has no get_reward() and no step(), and {rewards_field} is empty: "
        f"its episodes would have no reward; add a get_reward() method or list reward "
        f"functions in {rewards_field}"
    )


def reset_problem(env: EnvironmentClass, columns: list[str]) -> str | None:
    """Why `reset(**row_columns)` cannot take the data's rows (None: it can): a parameter no
    column fills, or columns it does not take without **kwargs."""
    try:
        params = list(inspect.signature(env.cls.reset).parameters.values())[1:]  # not self
    except (TypeError, ValueError):
        return None
    shown = f"{env.cls.__name__}.reset{inspect.signature(env.cls.reset)}"
    required = [
        p.name
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if missing := [n for n in required if n not in columns]:
        have = ", ".join(columns) or "none"
        return f"{shown} needs {', '.join(missing)}, which the data's rows lack (columns: {have})"
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        names = {p.name for p in params}
        if extra := [c for c in columns if c not in names]:
            return f"{shown} does not take the columns {', '.join(extra)}: add **kwargs"
    return None


def route_problem(names: Collection[str], columns: dict[str, Any]) -> str | None:
    """Why a prompt row with `columns` cannot pick one of the environment classes `names`
    (None: it can)."""
    listed = ", ".join(sorted(names))
    got = columns.get(ROUTE)
    if got is None:
        return (
            f"has no '{ROUTE}' column naming its environment (rollout.environment lists: {listed})"
        )
    if not isinstance(got, str) or got not in names:
        close = difflib.get_close_matches(str(got), list(names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return (
            f"names environment {got!r}, which rollout.environment does not list ({listed}){hint}"
        )
    return None


def _public_methods(cls: type) -> list[str]:
    return [
        n
        for n, v in inspect.getmembers(cls, callable)
        if not n.startswith("_") and n not in RESERVED and not isinstance(v, type)
    ]


def load_environment(ref: str, roots: Sequence[Path] | None = None) -> EnvironmentClass:
    """The class `ref` names, checked for the protocol (a `reset`; tools or a `step`); its
    tools' schemas are checked here, before any episode runs."""
    try:
        cls, sha = load_function(ref, roots, "environment")
    except RewardLoadError as exc:
        raise ToolLoadError(str(exc)) from None
    if not isinstance(cls, type):
        raise ToolLoadError(f"rollout.environment {ref}: not a class ({type(cls).__name__})")
    if not callable(getattr(cls, "reset", None)):
        raise ToolLoadError(f"rollout.environment {ref}: {cls.__name__} has no reset() method")
    env = EnvironmentClass(ref, cls, sha, _public_methods(cls))
    if not env.is_gym and not env.tool_names:
        raise ToolLoadError(
            f"rollout.environment {ref}: {cls.__name__} has neither tools (public methods) "
            "nor a step(assistant_message) method"
        )
    # Described once, at load: a method's schema is the same bound or not (no `self`), and a
    # tool the model cannot be told about fails here, not in the first episode.
    env.schemas = [describe(getattr(cls, n), f"{ref}.{n}") for n in env.tool_names]
    return env


class Episode:
    """One episode's environment instance; every call names the row it serves on failure."""

    def __init__(self, env: EnvironmentClass, where: str) -> None:
        self.env, self.where = env, where  # where: the prompt row's `file:line`
        self.instance = self._call(env.cls, "__init__")

    def _call(self, fn: Callable[..., Any], method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise EnvironmentFailed(
                self._says(method, f"raised {type(exc).__name__}: {exc}")
            ) from exc

    def _says(self, method: str, what: str) -> str:
        return f"rollout.environment {self.env.cls.__name__}.{method} {what} (row {self.where})"

    def reset(self, columns: dict[str, Any]) -> str | None:
        out = self._call(self.instance.reset, "reset", **columns)
        if out is not None and not isinstance(out, str):
            raise EnvironmentFailed(
                self._says("reset", f"returned {type(out).__name__}, not str or None")
            )
        return out

    def tools(self) -> dict[str, Callable[..., Any]]:  # this instance's tool methods by name
        return {n: getattr(self.instance, n) for n in self.env.tool_names}

    def reward(self) -> float | None:
        if not self.env.has_reward:
            return None
        return self._number(self._call(self.instance.get_reward, "get_reward"), "get_reward")

    def step(self, assistant_message: dict[str, Any]) -> StepResult:
        out = self._call(self.instance.step, "step", assistant_message)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise EnvironmentFailed(
                self._says("step", "did not return (observations, reward, done)")
            )
        obs, reward, done = out
        obs = [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
        if not isinstance(obs, list) or not all(_is_message(m) for m in obs):
            raise EnvironmentFailed(
                self._says("step", "returned observations that are not a list of messages")
            )
        if not isinstance(done, bool):
            raise EnvironmentFailed(self._says("step", f"returned done={done!r}, not a bool"))
        return StepResult(obs, self._number(reward, "step"), done)

    def _number(self, value: Any, method: str) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise EnvironmentFailed(self._says(method, f"returned {value!r}, not a finite number"))
        return float(value)


def _is_message(m: Any) -> bool:
    return (
        isinstance(m, dict)
        and m.get("role") in ("user", "tool")
        and isinstance(m.get("content"), str)
    )
