"""Reward functions from the recipe (posttrain.rewards spec/loader/combine): where their code may
come from, the fingerprint of that code, and what happens when one misbehaves. Fast, real files."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.config.loader import RecipeError, load_recipe
from posttrain.config.served_access import (
    REWARDS_ENV,
    check_served_reach,
    reward_roots,
    served_reward_roots,
)
from posttrain.plan.planner import plan
from posttrain.rewards.combine import (
    RewardFunction,
    RewardFunctionError,
    function_means,
    load_rewards,
    score_functions,
)
from posttrain.rewards.loader import RewardLoadError, load_function, locate
from posttrain.sections.rewards import RewardSpec
from tests.stage_helpers import TINY

PROMPTS = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(3)]


def _fn(label: str, fn, weight: float = 1.0) -> RewardFunction:
    return RewardFunction(label, f"test:{label}", weight, fn, "0" * 64)


def _score(funcs, completions=("1", "2", "3"), columns=None):
    n = len(completions)
    return score_functions(
        funcs,
        PROMPTS[:n],
        list(completions),
        columns or [{"answer": str(i + 1)} for i in range(n)],
        [[5, 6]] * n,
        [True] * n,
        [f"data.jsonl:{i + 1}" for i in range(n)],
    )


def test_weighted_sum_none_is_not_applicable_and_means_skip_it() -> None:
    def right(prompts, completions, answer, **kw):
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]

    def short(prompts, completions, completion_ids, stopped, **kw):
        assert stopped == [True] * 3 and completion_ids == [[5, 6]] * 3
        return [None, -1.0, 0.5]  # not applicable to the first row

    total, per = _score([_fn("right", right, 2.0), _fn("short", short, 0.5)], ("1", "x", "3"))
    # row 0: 2*1 + (None) ; row 1: 2*0 + 0.5*-1 ; row 2: 2*1 + 0.5*0.5
    assert total.tolist() == pytest.approx([2.0, -0.5, 2.25])
    assert math.isnan(per["short"][0]) and per["right"].tolist() == [1.0, 0.0, 1.0]
    assert function_means(per) == {"right": (2.0, 3), "short": (-0.5, 2)}


def test_a_raising_function_names_itself_and_the_row_it_fails_on() -> None:
    def picky(prompts, completions, **kw):
        return [1 / (int(c[0]["content"]) - 2) for c in completions]  # row 1 divides by zero

    with pytest.raises(RewardFunctionError) as exc:
        _score([_fn("picky", picky)])
    msg = str(exc.value)
    assert msg.startswith("reward function picky (test:picky) raised ZeroDivisionError")
    assert "row 1 (data.jsonl:2): prompt 'What is 1 + 1?', response '2'" in msg


def test_a_key_error_lists_the_columns_the_function_could_have_read(tmp_path: Path) -> None:
    """The issue's reward module reads a column by a misspelt name: the stage's verdict starts
    with the field path, and names the row's columns and the one probably meant."""
    (tmp_path / "my_rewards.py").write_text(
        "def fn(prompts, completions, **columns):\n"
        "    return [float(c[0]['content'] == a) for c, a in zip(completions, columns['answr'])]\n"
    )
    (func,) = load_rewards(
        [RewardSpec(fn=f"{tmp_path / 'my_rewards.py'}:fn")], [tmp_path], "grpo.rewards"
    )
    columns = [{"answer": str(i + 1), "task": "sum"} for i in range(3)]
    with pytest.raises(RewardFunctionError) as exc:
        _score([func], columns=columns)
    assert str(exc.value) == (
        "grpo.rewards.0.fn my_rewards.py:fn raised KeyError('answr') on row 0 (data.jsonl:1): "
        "prompt 'What is 0 + 1?', response '1'; the row's columns are: answer, task (beside "
        "prompts, completions, completion_ids, stopped); did you mean answer?"
    )


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, 1.0], "returned 2 values for 3 rows"),
        (7.0, "returned float; expected a list of 3 floats"),
        ([1.0, float("nan"), 0.0], "returned nan for row 1 (data.jsonl:2)"),
        ([1.0, 0.0, float("inf")], "returned inf for row 2 (data.jsonl:3)"),
        ([1.0, "yes", 0.0], "returned 'yes' (str), not a number, for row 1"),
    ],
)
def test_ill_shaped_results_fail_naming_the_function(values, expected) -> None:
    with pytest.raises(RewardFunctionError, match="reward function bad") as exc:
        _score([_fn("bad", lambda prompts, completions, **kw: values)])
    assert expected in str(exc.value)


def test_tensor_results_and_column_clashes() -> None:
    total, _ = _score([_fn("t", lambda prompts, completions, **kw: torch.ones(3))])
    assert total.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(RewardFunctionError, match=r"data columns \['stopped'\] collide"):
        _score([_fn("t", lambda **kw: [0.0] * 3)], columns=[{"stopped": 1}] * 3)


def _module(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(body)
    return path


ONE = "def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"


def test_user_modules_come_only_from_the_allowed_folders(tmp_path: Path) -> None:
    home = tmp_path / "recipes"
    _module(home / "helpers", "__init__", "")
    _module(home, "base_score", "VALUE = 0.25\n")
    _module(home, "mine", "from base_score import VALUE\n\n" + ONE.replace("1.0", "VALUE"))
    fn, sha = load_function("mine:one", [home])
    assert fn(prompts=[1], completions=["a"]) == [0.25] and len(sha) == 64
    # Built-ins need no folder; installed modules and the standard library are not reachable.
    assert callable(load_function("posttrain.rewards.combine:score_functions")[0])
    with pytest.raises(RewardLoadError, match="no module 'os' in the folders"):
        locate("os:system", [home])
    with pytest.raises(RewardLoadError, match="no function 'two'"):
        load_function("mine:two", [home])
    # A symlink out of the allowed folder is followed and refused.
    outside = _module(tmp_path / "elsewhere", "evil", ONE)
    (home / "evil.py").symlink_to(outside)
    with pytest.raises(RewardLoadError, match="is outside the folders reward code may come"):
        locate("evil:one", [home])
    with pytest.raises(RewardLoadError, match="importing .* failed: ZeroDivisionError"):
        _module(home, "broken", "1 / 0\n")
        load_function("broken:one", [home])


def _rl_recipe(folder: Path, rewards: list, **run) -> Path:
    data = copy.deepcopy(TINY)
    data["run"] |= {"workspace": str(folder / "ws"), **run}
    data["grpo"] = {
        "data": {"synthetic": {"n_examples": 40}, "eval_fraction": 0.1},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2},
        "rewards": rewards,
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _fp(recipe: Path, stage: str = "grpo") -> str:
    return next(s.fingerprint for s in plan(load_recipe(recipe)).stages if s.name == stage)


def test_recipe_functions_resolve_to_their_file_and_code_enters_the_fingerprint(
    tmp_path: Path,
) -> None:
    home = tmp_path / "a"
    mod = _module(home, "mine", ONE)
    recipe = load_recipe(_rl_recipe(home, [{"fn": "mine:one", "weight": 0.5}]))
    spec = recipe.grpo.rewards[0]
    assert spec.fn == f"{mod}:one" and spec.label == "one"
    assert str(home) in recipe.run.allowed_paths  # the stage process, elsewhere, finds it too
    assert [f.label for f in load_rewards(recipe.grpo.rewards)] == ["one"]
    before = _fp(home / "recipe.yaml")
    # Moving the folder keeps the print (the code, not its path, counts) ...
    moved = tmp_path / "b"
    home.rename(moved)
    assert _fp(_rl_recipe(moved, [{"fn": "mine:one", "weight": 0.5}])) == before
    a = plan(load_recipe(moved / "recipe.yaml")).stages
    # ... editing the function's source changes it.
    _module(moved, "mine", ONE + "# tuned\n")
    b = plan(load_recipe(moved / "recipe.yaml")).stages
    fa, fb = ({s.name: s.fingerprint for s in p} for p in (a, b))
    assert fa["sft"] == fb["sft"] and fa["grpo"] != fb["grpo"]


def test_missing_or_unallowed_modules_are_refused_naming_the_field(tmp_path: Path) -> None:
    _module(tmp_path / "other", "theirs", ONE)
    (tmp_path / "r").mkdir()
    path = _rl_recipe(
        tmp_path / "r",
        [
            {"fn": "posttrain.rewards.combine:score_functions"},
            {"fn": "nope:one"},
            {"fn": "os:system"},
            {"fn": f"{tmp_path / 'other' / 'theirs.py'}:one", "name": "theirs"},
        ],
    )
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    errs = exc.value.errors
    assert [e.split(":")[0] for e in errs] == [
        "grpo.rewards.1.fn",
        "grpo.rewards.2.fn",
        "grpo.rewards.3.fn",
    ]
    assert "no module 'nope'" in errs[0] and "no module 'os'" in errs[1]
    assert "is outside the folders reward code may come from" in errs[2]
    # run.allowed_paths widens it: the operator's own decision, in the recipe it runs.
    allowed = _rl_recipe(
        tmp_path / "r",
        [{"fn": f"{tmp_path / 'other' / 'theirs.py'}:one"}],
        allowed_paths=[str(tmp_path / "other")],
    )
    assert load_recipe(allowed).grpo.rewards[0].fn.endswith("theirs.py:one")


def test_bad_specs_and_duplicate_labels_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not `module:function`"):
        RewardSpec(fn="just_a_name")
    path = _rl_recipe(
        tmp_path,
        [
            {"fn": "posttrain.rewards.combine:score_functions"},
            {"fn": "posttrain.rewards.combine:score_functions", "weight": 2},
        ],
    )
    with pytest.raises(RecipeError, match="grpo: .*two functions share a label"):
        load_recipe(path)


def test_served_recipes_import_reward_code_only_from_the_worker_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from posttrain.config.schema import Recipe

    ws = tmp_path / "ws"
    code = tmp_path / "code"
    _module(code, "ours", ONE)
    _module(tmp_path / "sent", "theirs", ONE)

    def served(rewards: list) -> Recipe:
        data = copy.deepcopy(TINY)
        data["run"]["workspace"] = str(ws)
        data["grpo"] = {"data": {"synthetic": {"n_examples": 40}}, "rewards": rewards}
        return Recipe.model_validate(data)

    builtin = served([{"fn": "posttrain.rewards.combine:score_functions"}])
    mine = served([{"fn": "ours:one"}])
    theirs = served([{"fn": f"{tmp_path / 'sent' / 'theirs.py'}:one"}])
    monkeypatch.delenv(REWARDS_ENV, raising=False)
    check_served_reach(builtin, [tmp_path], reward_roots())
    with pytest.raises(RecipeError, match="allows no reward code of its own"):
        check_served_reach(mine, [tmp_path], reward_roots())
    monkeypatch.setenv(REWARDS_ENV, str(code))
    check_served_reach(mine, [tmp_path], reward_roots())
    with pytest.raises(RecipeError) as exc:
        check_served_reach(theirs, [tmp_path], reward_roots())
    assert exc.value.errors[0].startswith("grpo.rewards.0.fn: ")
    assert "outside the folders reward code may come from" in exc.value.errors[0]
    # `posttrain serve RECIPE` trusts the served file's own reward folders.
    own = load_recipe(_rl_recipe(tmp_path / "sent", [{"fn": "theirs:one"}]))
    assert served_reward_roots(own) == [str(tmp_path / "sent")]
    assert os.environ[REWARDS_ENV] == str(code)


TOOL = 'def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: A.\n        b: B.\n    """\n    return a + b\n'


def test_tools_and_environments_come_from_the_same_folders_as_reward_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool beside the recipe resolves to its file; one that is not there, or (served) one
    outside the worker's folders, fails naming its field."""
    from posttrain.config.schema import Recipe

    home = tmp_path / "r"
    _module(home, "calc", TOOL)
    path = _rl_recipe(home, [{"fn": "posttrain.rewards.match:exact_match"}])
    data = yaml.safe_load(path.read_text())
    data["ingest"]["from_config"]["template"] = "chatml_tools"
    data["grpo"]["rollout"]["tools"] = ["calc:add", "nope:add"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as exc:
        load_recipe(path)
    assert [e.split(":")[0] for e in exc.value.errors] == ["grpo.rollout.tools.1"]
    assert "no module 'nope' in the folders tool code may come from" in exc.value.errors[0]
    data["grpo"]["rollout"]["tools"] = ["calc:add"]
    path.write_text(yaml.safe_dump(data))
    assert load_recipe(path).grpo.rollout.tools == [f"{home / 'calc.py'}:add"]
    served = copy.deepcopy(data)
    served["grpo"]["rollout"] |= {"tools": [], "environment": f"{home / 'calc.py'}:add"}
    recipe = Recipe.model_validate(served)
    monkeypatch.setenv(REWARDS_ENV, str(tmp_path / "elsewhere"))
    with pytest.raises(RecipeError) as exc:
        check_served_reach(recipe, [tmp_path], reward_roots())
    assert exc.value.errors[0].startswith("grpo.rollout.environment: ")
    assert "outside the folders environment code may come from" in exc.value.errors[0]


def test_environments_reach_the_functions_that_take_them_as_trl_passes_them() -> None:
    """A function written as TRL's docs write one (`def f(environments, **kwargs)`) gets each
    episode's environment instance, in order; one that names neither `environments` nor
    **kwargs is called without it, as before."""

    class Env:
        def __init__(self, solved: bool) -> None:
            self.solved = solved

    def env_reward(environments, **kwargs):
        return [1.0 if e.solved else 0.0 for e in environments]

    def plain(prompts, completions, completion_ids, stopped, answer):
        return [0.5] * len(completions)

    envs = [Env(True), Env(False), Env(True)]
    n = 3
    _, per = score_functions(
        [_fn("env", env_reward), _fn("plain", plain)],
        PROMPTS[:n],
        ["1", "2", "3"],
        [{"answer": str(i + 1)} for i in range(n)],
        [[5, 6]] * n,
        [True] * n,
        [f"data.jsonl:{i + 1}" for i in range(n)],
        environments=envs,
    )
    assert per["env"].tolist() == [1.0, 0.0, 1.0] and per["plain"].tolist() == [0.5] * 3
