"""What a served run may read: the worker decides the reach, a recipe may only narrow it.

`run.allowed_paths` is a field of the recipe, so for a recipe that arrives through a served
deployment (the Prefect UI's Run form, an API call, an event trigger, `posttrain submit`) it is
whatever the sender typed: `/` would let anyone who can open the form train on, and echo into
samples and reports, any file the worker can read. So for a served run the folders come from the
process that runs the flow, never from the recipe:

  - `POSTTRAIN_ALLOWED_PATHS` (os.pathsep-separated absolute folders) in the worker's environment;
  - `posttrain serve --allow-path DIR` (repeatable) adds DIR to it in the serve process;
  - `posttrain serve RECIPE...` adds each served recipe's workspace and `run.allowed_paths` (as
    resolved when it loaded the file): the operator wrote those files, so their folders are
    trusted; the runs it executes are its subprocesses and inherit the variable.

A served recipe's `run.workspace` and each of its `run.allowed_paths` must lie inside one of
those folders, and each input path inside its own workspace or allowed paths (the recipe's folder
and the current directory, which `posttrain run` allows implicitly, are not allowed here: a
served flow runs wherever the worker was started). `posttrain run` trusts its own recipe file,
as before. No Prefect here: the flow decides which runs are served.

A server `command` (`rollout.server.command`, a judge's `command`) is a shell command the stage
starts: a served run may start only the commands its worker allows, exactly as written
(`POSTTRAIN_ALLOWED_COMMANDS`, a JSON list; `posttrain serve --allow-command CMD`, and the
commands of the recipes it serves).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from posttrain.config.loader import RecipeError, _inside, _real, input_paths
from posttrain.config.schema import Recipe

ALLOWED_ENV = "POSTTRAIN_ALLOWED_PATHS"
# Reward functions run code: the folders a served run may import reward modules from are a list
# of their own (reading a data file is not executing it), set the same way as ALLOWED_ENV.
REWARDS_ENV = "POSTTRAIN_REWARD_PATHS"
# Server commands a served run may start (a JSON list of the exact command texts).
COMMANDS_ENV = "POSTTRAIN_ALLOWED_COMMANDS"


def parse_roots(value: str | None) -> list[Path]:
    """Absolute folders from an os.pathsep-separated list; relative or empty entries are
    ignored (a root relative to wherever a flow happens to run would be a guess)."""
    roots: list[Path] = []
    for part in (value or "").split(os.pathsep):
        part = part.strip()
        if not part or not part.startswith(("/", "~")):
            continue
        try:
            root = Path(part).expanduser().resolve()
        except (RuntimeError, ValueError, OSError):
            continue
        if root not in roots:
            roots.append(root)
    return roots


def worker_roots(env: Mapping[str, str] | None = None) -> list[Path]:
    """The folders this worker allows served runs to read from (`POSTTRAIN_ALLOWED_PATHS`)."""
    return parse_roots((os.environ if env is None else env).get(ALLOWED_ENV))


def reward_roots(env: Mapping[str, str] | None = None) -> list[Path]:
    """The folders this worker allows served runs to import reward functions from
    (`POSTTRAIN_REWARD_PATHS`; `posttrain serve --allow-rewards DIR`)."""
    return parse_roots((os.environ if env is None else env).get(REWARDS_ENV))


def served_reward_roots(recipe: Recipe) -> list[str]:
    """The folders holding a served recipe file's own reward modules (resolved by
    `resolve_paths`): the operator wrote that file, so its code folders are trusted."""
    from posttrain.config.loader import code_refs
    from posttrain.rewards.loader import source_file
    from posttrain.sections.rewards import is_builtin

    return [str(source_file(c.ref).parent) for c in code_refs(recipe) if not is_builtin(c.ref)]


def check_served_rewards(recipe: Recipe, roots: list[Path]) -> list[str]:
    """`field: message` lines for each piece of user code of a served recipe (reward function,
    tool, environment) that is neither a built-in (`posttrain.rewards.*`) nor a module inside
    the worker's reward folders."""
    from posttrain.config.loader import code_refs
    from posttrain.rewards.loader import RewardLoadError, locate
    from posttrain.sections.rewards import is_builtin

    errors = []
    for code in code_refs(recipe):
        if is_builtin(code.ref):
            continue
        if not roots:
            errors.append(
                f"{code.where}: {code.ref} is not a built-in (posttrain.rewards.*) and this "
                f"worker allows no {code.kind} code of its own: start `posttrain serve "
                f"--allow-rewards DIR` or set {REWARDS_ENV}"
            )
            continue
        try:
            locate(code.ref, roots, code.kind)
        except RewardLoadError as exc:
            errors.append(f"{code.where}: {exc} (this worker's reward folders, {REWARDS_ENV})")
    return errors


def command_text(command: str | list[str]) -> str:
    """A server command as one text, however the recipe wrote it (a string, or argv)."""
    return command if isinstance(command, str) else shlex.join(command)


def served_commands(recipe: Recipe) -> dict[str, str]:
    """`field: command` of every server command in the recipe: each section that says where a
    model is served (`posttrain.sections.served`: a `url` or a `command`), wherever it lies."""
    found: dict[str, str] = {}

    def walk(node: Any, where: str) -> None:
        if isinstance(node, BaseModel):
            fields = type(node).model_fields
            if {"url", "command"} <= fields.keys() and node.command is not None:
                found[f"{where}.command"] = command_text(node.command)
            for name in fields:
                walk(getattr(node, name), f"{where}.{name}" if where else name)
        elif isinstance(node, list | tuple):
            for i, item in enumerate(node):
                walk(item, f"{where}.{i}")
        elif isinstance(node, dict):
            for key, item in node.items():
                walk(item, f"{where}.{key}")

    walk(recipe, "")
    return found


def worker_commands(env: Mapping[str, str] | None = None) -> list[str]:
    """The server commands this worker allows served runs to start (`POSTTRAIN_ALLOWED_COMMANDS`;
    a value that is not a JSON list of strings allows none)."""
    try:
        value = json.loads((os.environ if env is None else env).get(COMMANDS_ENV) or "[]")
    except ValueError:
        return []
    return [c for c in value if isinstance(c, str)] if isinstance(value, list) else []


def with_commands(current: str | None, extra: Iterable[str]) -> str:
    """`current` (a POSTTRAIN_ALLOWED_COMMANDS value) with `extra` commands appended."""
    commands = worker_commands({COMMANDS_ENV: current or "[]"})
    commands += [c for c in dict.fromkeys(extra) if c not in commands]
    return json.dumps(commands)


def check_served_commands(recipe: Recipe, allowed: list[str]) -> list[str]:
    """`field: message` lines for each server command of a served recipe its worker does not
    allow. Compared as the argv the stage starts (`shlex.split`), so quoting and spacing of
    the same command do not matter; a command that does not split is not allowed."""
    argvs = [argv for c in allowed if (argv := _argv(c)) is not None]
    return [
        f"{where}: `{command}` is not a command this worker lets served runs start: serve a "
        f"recipe with it, start `posttrain serve --allow-command {shlex.quote(command)}`, or "
        f"add it to {COMMANDS_ENV}"
        for where, command in served_commands(recipe).items()
        if _argv(command) not in argvs
    ]


def _argv(command: str) -> list[str] | None:
    try:
        return shlex.split(command)
    except ValueError:  # an unclosed quote
        return None


def with_roots(current: str | None, extra: Iterable[str | os.PathLike[str]]) -> str:
    """`current` (a POSTTRAIN_ALLOWED_PATHS value) with `extra` folders appended, resolved."""
    roots = parse_roots(current)
    for root in parse_roots(os.pathsep.join(str(p) for p in extra)):
        if root not in roots:
            roots.append(root)
    return os.pathsep.join(str(r) for r in roots)


def served_roots(recipe: Recipe) -> list[str]:
    """The folders a served recipe file (resolved by `resolve_paths`) trusts: its workspace and
    its `run.allowed_paths`, the recipe's folder included when a path needed it."""
    return [recipe.run.workspace, *recipe.run.allowed_paths]


def _describe(roots: list[Path]) -> str:
    if not roots:
        return f"none: start `posttrain serve --allow-path DIR` or set {ALLOWED_ENV}"
    return ", ".join(str(r) for r in roots)


@dataclass(frozen=True)
class ServedReach:
    """What the worker running a served flow allows: the folders its runs may read from, those
    they may import reward code from, and the server commands they may start (from its
    environment, never from the recipe)."""

    roots: list[Path]
    reward_roots: list[Path]
    commands: list[str] = field(default_factory=list)

    @classmethod
    def of_worker(cls, env: Mapping[str, str] | None = None) -> ServedReach:
        return cls(worker_roots(env), reward_roots(env), worker_commands(env))

    def check(self, recipe: Recipe) -> None:
        """Refuse a recipe that reaches outside these folders or starts another command
        (RecipeError, one line a field)."""
        check_served_reach(recipe, self.roots, self.reward_roots, self.commands)


def check_served_reach(
    recipe: Recipe, roots: list[Path], code_roots: list[Path], commands: list[str] | None = None
) -> None:
    """Refuse a served recipe that reaches outside the worker's folders or starts a server
    command it does not allow (`commands`; None: none). Raises RecipeError with one
    `field: message` line per problem; reads no file (paths are only resolved)."""
    errors: list[str] = []

    def inside_worker(where: str, value: str) -> Path | None:
        real = _real(value, where, errors)
        if real is None:
            return None
        if not any(_inside(real, root) for root in roots):
            errors.append(
                f"{where}: {value} is outside the folders this worker allows ({_describe(roots)})"
            )
            return None
        return real

    own = [inside_worker("run.workspace", recipe.run.workspace)]
    own += [
        inside_worker(f"run.allowed_paths.{i}", p) for i, p in enumerate(recipe.run.allowed_paths)
    ]
    mine = [p for p in own if p is not None]
    for where, value in input_paths(recipe).items():
        real = _real(value, where, errors)
        if real is None:
            continue
        if not any(_inside(real, root) for root in mine):
            via = "" if value == str(real) else f" (given as {value})"
            errors.append(
                f"{where}: {real}{via} is outside this served run's run.workspace and "
                f"run.allowed_paths ({', '.join(str(p) for p in mine) or 'none allowed'})"
            )
    errors += check_served_rewards(recipe, code_roots)
    errors += check_served_commands(recipe, commands or [])
    if errors:
        raise RecipeError(errors, "served recipe")
