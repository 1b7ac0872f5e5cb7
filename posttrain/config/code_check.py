"""The user code a resolved recipe names -- reward functions, verifiers, tools, environments --
imported by name the way its stage imports it (`load_function`, `load_tools`,
`load_environment`), and each reward function's signature held against posttrain's call.

The loader already found each module's file when the recipe was resolved (a wrong module is
refused there); here the name inside it, and what it is, are checked: a misspelt function is
`grpo.rewards.0.fn: my_rewards.py has no function 'word_overlapp' (it has: word_overlap)`.
"""

from __future__ import annotations

from typing import Any

from posttrain.agents.tools import ToolLoadError
from posttrain.config.schema import Recipe
from posttrain.rewards.loader import RewardLoadError
from posttrain.sections.rewards import split_ref


def _message(ref: str, exc: Exception) -> str:
    # Loader errors start with the reference, which after resolution is an absolute path.
    return str(exc).removeprefix(f"{ref}: ")


def _short(ref: str) -> str:
    module, attr = split_ref(ref)
    return f"{module.rsplit('/', 1)[-1]}:{attr}"


def _reward_line(code: Any, columns: list[str] | None, report: Any, environment: bool) -> None:
    from posttrain.rewards.loader import load_function
    from posttrain.rewards.signature import call_problem

    try:
        fn, _ = load_function(code.ref, None, code.kind)
    except RewardLoadError as exc:
        report.problems.append(f"{code.where}: {_message(code.ref, exc)}")
        return
    kwargs = getattr(code.owner, "kwargs", {}) or {}
    if problem := call_problem(fn, kwargs, columns, environment):
        report.problems.append(f"{code.where}: {problem}")
        return
    # A function may check its own kwargs and what it needs of the host (the code verifier:
    # a sandbox that can run here), so the recipe is refused before any stage starts.
    check = getattr(fn, "check_kwargs", None)
    if check is not None and (problem := check(dict(kwargs))):
        report.problems.append(f"{code.where.removesuffix('.fn')}.kwargs: {problem}")
        return
    report.lines.append(f"{code.where}: {_short(code.ref)}: takes posttrain's call")


def _tool_line(code: Any, report: Any, rewarded: bool, columns: list[str] | None) -> bool:
    """Checks a tool or an environment; True when it gives the model tools to call.
    `rewarded`: its stage lists reward functions (an environment then needs no reward);
    `columns`: the data's columns (None: not known now), which `reset` takes."""
    from posttrain.agents.environment import ROUTE, load_environment, no_reward, reset_problem
    from posttrain.agents.tools import load_tools

    try:
        if code.kind == "tool":
            (tool,) = load_tools([code.ref])
            report.lines.append(f"{code.where}: {_short(code.ref)}: tool '{tool.name}'")
            return True
        env = load_environment(code.ref)
    except (ToolLoadError, RewardLoadError) as exc:
        report.problems.append(f"{code.where}: {_message(code.ref, exc)}")
        return False
    if code.index is not None and columns is not None:  # a routed class: reset never gets it
        columns = [c for c in columns if c != ROUTE]
    if columns is not None and (problem := reset_problem(env, columns)):
        report.problems.append(f"{code.where}: {problem}")
        return False
    if not env.rewards and not rewarded:
        where = code.where.split(".rollout.")[0]
        report.problems.append(f"{code.where}: {no_reward(env, f'{where}.rewards')}")
        return False
    tools = f"tools {', '.join(env.tool_names)}" if env.tool_names else "step() environment"
    report.lines.append(f"{code.where}: {_short(code.ref)}: {tools}")
    return bool(env.tool_names)


def check_code(recipe: Recipe, refs: list[Any], peeks: dict[str, Any], report: Any) -> set[str]:
    """Check every piece of code in `refs` (`loader.code_refs`); the field paths of the stages
    whose episodes give the model tools (their template must render tool calls)."""
    needs_tools: set[str] = set()
    rewarded = {s.where for s in recipe.graph() if getattr(s.section, "rewards", None)}
    rollouts = {s.where: getattr(s.section, "rollout", None) for s in recipe.graph()}
    with_env = {w for w, r in rollouts.items() if r is not None and r.environment is not None}
    for code in refs:
        stage = code.where.split(".rewards.")[0].split(".rollout.")[0]
        peek = peeks.get(stage)
        # The columns reward functions and reset() get are the prompt rows' (`check_prompt_row`).
        columns = None
        if peek is not None and peek.rows and all("columns" in r for _, r in peek.rows):
            columns = sorted({k for _, r in peek.rows for k in r["columns"]})
        if code.kind == "reward":
            _reward_line(code, columns, report, stage in with_env)
        elif _tool_line(code, report, stage in rewarded, columns):
            needs_tools.add(stage)
    for where, rollout in rollouts.items():
        if rollout is not None and isinstance(rollout.environment, dict) and where in peeks:
            _route_lines(where, rollout.environment, peeks[where], report)
    return needs_tools


def _route_lines(stage: str, envs: dict[str, str], peek: Any, report: Any) -> None:
    """Each row a stage with several environment classes read must name one of them."""
    from posttrain.agents.environment import route_problem

    for where, row in peek.rows:
        if problem := route_problem(envs, row.get("columns", {})):
            report.problems.append(f"{where}: {problem} ({stage}.rollout.environment)")
