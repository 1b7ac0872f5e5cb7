"""Call a recipe's reward functions on a batch of responses, check what they return, and sum
them with their weights (and the reward model's score, when the stage has one).

A function that raises, returns the wrong number of values, a non-number or a non-finite value
fails the stage with a `RewardFunctionError` naming the function and the row (its data
location, prompt and response): a broken verifier scored as 0 would train the policy on noise
and look like a hard task. `None` is "not applicable": that function is left out of the row's
sum and of its mean.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import StageVerdict
from posttrain.rewards.extract import completion_text
from posttrain.rewards.judge import JudgeReward
from posttrain.rewards.loader import bind
from posttrain.rewards.signature import ENVIRONMENTS, takes
from posttrain.sections.rewards import RewardSpec

# Keyword arguments the caller fills; a data column of the same name would be shadowed.
RESERVED = ("prompts", "completions", "completion_ids", "stopped", ENVIRONMENTS)


class RewardFunctionError(StageVerdict):
    """A reward function misbehaved; the message names it and the row. A verdict on the user's
    code, not a bug of ours: the stage fails with this message, without a traceback wall (the
    function's own traceback is in the stage's logs/error.txt)."""


@dataclass(frozen=True)
class RewardFunction:
    label: str
    fn_ref: str  # the recipe's `fn`
    weight: float
    fn: Callable[..., Any]
    sha256: str
    where: str = ""  # its field path (`grpo.rewards.0.fn`), which errors start with

    @property
    def name(self) -> str:
        """How errors name it: `grpo.rewards.0.fn my_rewards.py:fn` (the file's own name: the
        field path says which recipe entry it is), else `reward function <label> (<fn>)`."""
        if not self.where:
            return f"reward function {self.label} ({self.fn_ref})"
        if self.where.endswith(".judge"):
            return f"{self.where} ({self.fn_ref})"
        module, _, attr = self.fn_ref.rpartition(":")
        return f"{self.where} {Path(module).name if module.endswith('.py') else module}:{attr}"


def load_rewards(
    specs: Sequence[RewardSpec], roots: Sequence[Path] | None = None, where: str = ""
) -> list[RewardFunction]:
    """Import every function of `specs` (see `posttrain.rewards.loader.load_function`);
    labels must differ. `where`: the recipe field that lists them (`grpo.rewards`)."""
    out: list[RewardFunction] = []
    for i, s in enumerate(specs):
        if s.judge is not None:  # a model as judge: no code to import
            judge = JudgeReward(s.judge, s.label)
            at = f"{where}.{i}.judge" if where else ""
            ref = f"judge {s.judge.model}"
            out.append(RewardFunction(s.label, ref, s.weight, judge, judge.identity, at))
            continue
        fn, sha = bind(s, roots)
        at = f"{where}.{i}.fn" if where else ""
        out.append(RewardFunction(s.label, str(s.fn), s.weight, fn, sha, at))
    labels = [f.label for f in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"reward functions need distinct labels (set `name`), got {labels}")
    return out


def _clip(text: Any, n: int = 160) -> str:
    s = text if isinstance(text, str) else repr(text)
    return s if len(s) <= n else s[: n - 3] + "..."


def _row(i: int, prompts: Sequence[Any], completions: Sequence[Any], where: Sequence[str]) -> str:
    prompt = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
    reply = completion_text(completions[i])
    origin = f" ({where[i]})" if where else ""
    return f"row {i}{origin}: prompt {_clip(prompt)!r}, response {_clip(reply)!r}"


def _call(
    f: RewardFunction, args: dict[str, Any], n: int, where: Sequence[str]
) -> list[float | None]:
    name = f.name
    try:
        values = f.fn(**args)
    except Exception as exc:
        # Find the row it fails on: the batch call says only that some row did (a judge says
        # which, and must not be asked again row by row).
        bad = getattr(exc, "row", None)
        if bad is None:
            bad = next((i for i in range(n) if _raises(f.fn, args, i)), None)
        at = (
            _row(bad, args["prompts"], args["completions"], where)
            if bad is not None
            else f"a batch of {n} rows (each row alone passes)"
        )
        if isinstance(exc, KeyError):  # most often a column the rows do not have
            columns = _columns(exc, args)
            raise RewardFunctionError(f"{name} raised {exc!r} on {at}; {columns}") from exc
        raise RewardFunctionError(f"{name} raised {type(exc).__name__}: {exc} on {at}") from exc
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"{name} returned {type(values).__name__}; expected a list of {n} floats (None = "
            "not applicable)"
        )
    if len(values) != n:
        raise RewardFunctionError(f"{name} returned {len(values)} values for {n} rows")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if not isinstance(v, Real):
            raise RewardFunctionError(
                f"{name} returned {_clip(v)!r} ({type(v).__name__}), not a number, for "
                + _row(i, args["prompts"], args["completions"], where)
            )
        if not math.isfinite(float(v)):
            raise RewardFunctionError(
                f"{name} returned {v} for " + _row(i, args["prompts"], args["completions"], where)
            )
        out.append(float(v))
    return out


def _columns(exc: KeyError, args: dict[str, Any]) -> str:
    """The columns a function could have read, for a KeyError it raised: `the row's columns
    are: answer, task (beside prompts, completions, ...); did you mean answer?`."""
    columns = [k for k in args if k not in RESERVED]
    given = ", ".join(k for k in RESERVED if k in args)
    text = f"the row's columns are: {', '.join(columns) or 'none'} (beside {given})"
    key = exc.args[0] if exc.args else None
    close = difflib.get_close_matches(key, columns, n=1) if isinstance(key, str) else []
    return text + (f"; did you mean {close[0]}?" if close else "")


def _raises(fn: Callable[..., Any], args: dict[str, Any], i: int) -> bool:
    one = {k: [v[i]] for k, v in args.items()}
    try:
        fn(**one)
    except Exception:
        return True
    return False


def score_functions(
    funcs: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[str | list[dict[str, Any]]],
    columns: Sequence[dict[str, Any]],
    completion_ids: Sequence[list[int]],
    stopped: Sequence[bool],
    where: Sequence[str] = (),
    environments: Sequence[Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(weighted sum [N], {label: values [N], NaN where None}) for N responses; a row where
    every function returned None sums to 0. `completions`: response texts (passed on as TRL's
    conversational `[{"role": "assistant", "content": text}]`) or, for episodes, the messages
    after the prompt, passed as they are; `columns`: each row's data columns, passed as one list
    per column (None where a row lacks it); `where`: each row's data location, for errors;
    `environments`: each episode's environment instance, passed as TRL passes them to the
    functions that take them."""
    n = len(completions)
    names = sorted({k for c in columns for k in c})
    clash = [k for k in names if k in RESERVED]
    if clash:
        raise RewardFunctionError(
            f"data columns {clash} collide with reward-function arguments {list(RESERVED)}; "
            "rename them with data.columns"
        )
    args: dict[str, Any] = {
        "prompts": list(prompts),
        "completions": [
            c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in completions
        ],
        "completion_ids": [list(x) for x in completion_ids],
        "stopped": [bool(s) for s in stopped],
        **{k: [c.get(k) for c in columns] for k in names},
    }
    if environments is not None:
        args[ENVIRONMENTS] = list(environments)
    total = torch.zeros(n, dtype=torch.float32)
    per: dict[str, torch.Tensor] = {}
    for f in funcs:
        mine = (
            args
            if takes(f.fn, ENVIRONMENTS)
            else {k: v for k, v in args.items() if k != ENVIRONMENTS}
        )
        vals = _call(f, mine, n, where)
        t = torch.tensor([math.nan if v is None else v for v in vals], dtype=torch.float32)
        per[f.label] = t
        total += f.weight * torch.nan_to_num(t, nan=0.0)
    return total, per


def function_means(per: dict[str, torch.Tensor]) -> dict[str, tuple[float, int]]:
    """{label: (sum over applicable rows, applicable rows)}: reducible over ranks."""
    out = {}
    for label, t in per.items():
        ok = ~torch.isnan(t)
        out[label] = (float(t[ok].sum()), int(ok.sum()))
    return out
