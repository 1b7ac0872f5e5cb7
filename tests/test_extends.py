"""`extends:` recipes (deep merge, lists replaced, later wins; cycles and missing files refused
by name; fingerprints those of the recipe written out in full), and relative paths resolved
against the folder of the recipe file that wrote them (the current directory for overrides)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml

from flows.cli import cmd_validate
from posttrain.config.extends import read_recipe
from posttrain.config.loader import RecipeError, load_recipe
from posttrain.plan.planner import plan

ROOT = Path(__file__).resolve().parents[1]
TINY_INGEST = {
    "source": "from_config",
    "from_config": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
}


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_maps_merge_lists_are_replaced_and_the_extending_recipe_wins(tmp_path: Path) -> None:
    _write(
        tmp_path / "base.yaml",
        {
            "run": {"name": "base", "seed": 3},
            "sft": {"optim": {"lr": 0.1, "warmup_steps": 5}, "lora": {"target_modules": ["q"]}},
            "evaluate": {"policies": ["sft"], "num_prompts": 2},
            "schedule": {"cron": "0 3 * * *"},
        },
    )
    child = _write(
        tmp_path / "child.yaml",
        {
            "extends": "base.yaml",
            "run": {"name": "child"},
            "sft": {"optim": {"lr": 0.2}, "lora": {"target_modules": ["k", "v"]}},
            "evaluate": {"policies": ["sft", "dpo"]},
            "schedule": None,
        },
    )
    data, _ = read_recipe(child)
    assert data == {
        "run": {"name": "child", "seed": 3},
        "sft": {"optim": {"lr": 0.2, "warmup_steps": 5}, "lora": {"target_modules": ["k", "v"]}},
        "evaluate": {"policies": ["sft", "dpo"], "num_prompts": 2},
        "schedule": None,  # null sets the key to null: what the schema sees
    }


def test_a_list_of_recipes_merges_in_order_and_chains_recurse(tmp_path: Path) -> None:
    _write(tmp_path / "a.yaml", {"run": {"name": "a", "seed": 1}, "sft": {"epochs": 1}})
    _write(tmp_path / "lib" / "b.yaml", {"extends": "../a.yaml", "run": {"seed": 2}})
    _write(tmp_path / "c.yaml", {"run": {"name": "c"}, "sft": {"epochs": 3, "max_steps": 7}})
    top = _write(tmp_path / "top.yaml", {"extends": ["lib/b.yaml", "c.yaml"], "sft": {"epochs": 4}})
    data, _ = read_recipe(top)
    assert data == {"run": {"name": "c", "seed": 2}, "sft": {"epochs": 4, "max_steps": 7}}


def test_a_cycle_is_refused_naming_each_file(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    _write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(RecipeError) as exc:
        load_recipe(a)
    assert exc.value.errors == ["extends: cycle a.yaml -> b.yaml -> a.yaml"]
    itself = _write(tmp_path / "self.yaml", {"extends": "self.yaml"})
    with pytest.raises(RecipeError) as exc:
        load_recipe(itself)
    assert exc.value.errors == ["extends: cycle self.yaml -> self.yaml"]


def test_a_missing_or_malformed_extends_is_refused_by_name(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.yaml", {"extends": "other.yaml"})
    with pytest.raises(RecipeError) as exc:
        load_recipe(a)
    assert exc.value.errors == [
        f"extends: other.yaml: no such recipe file (extended by {a.resolve()})"
    ]
    bad = _write(tmp_path / "bad.yaml", {"extends": {"file": "a.yaml"}})
    with pytest.raises(RecipeError) as exc:
        load_recipe(bad)
    assert exc.value.errors == [
        f"extends: {{'file': 'a.yaml'}} is not a recipe file name or a list of them "
        f"(in {bad.resolve()})"
    ]


def test_fingerprints_equal_those_of_the_recipe_written_out(tmp_path: Path) -> None:
    base = {
        "run": {"name": "base", "workspace": str(tmp_path / "ws")},
        "infra": {"device": "cpu", "devices_per_node": 1},
        "ingest": TINY_INGEST,
        "sft": {"data": {"synthetic": {"n_examples": 40}}, "max_steps": 3},
        "dpo": {"data": {"synthetic": {"n_examples": 40}}, "beta": 0.1},
    }
    _write(tmp_path / "base.yaml", base)
    child = _write(
        tmp_path / "child.yaml",
        {"extends": "base.yaml", "run": {"name": "child"}, "dpo": {"beta": 0.3}},
    )
    full = {**base, "run": {**base["run"], "name": "child"}, "dpo": {**base["dpo"], "beta": 0.3}}
    written = _write(tmp_path / "full.yaml", full)
    fps = {s.name: s.fingerprint for s in plan(load_recipe(child)).stages}
    assert fps == {s.name: s.fingerprint for s in plan(load_recipe(written)).stages}
    assert "extends" not in load_recipe(child).model_dump()


def _project(work: Path) -> Path:
    """work/proj/my.yaml reading data/x.jsonl, a file beside it (work/proj/data/x.jsonl)."""
    rows = work / "proj" / "data" / "x.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text('{"prompt": "a", "completion": "b"}\n')
    return _write(
        work / "proj" / "my.yaml",
        {
            "infra": {"device": "cpu", "devices_per_node": 1},
            "ingest": TINY_INGEST,
            "sft": {"data": {"path": "data/x.jsonl"}},
        },
    )


def test_relative_paths_are_the_recipe_folder_s_and_overrides_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    _project(work)
    monkeypatch.chdir(work)
    out, err = io.StringIO(), io.StringIO()
    assert cmd_validate("proj/my.yaml", [], out, err, resolved=True) == 0, err.getvalue()
    printed = yaml.safe_load(out.getvalue().split("--- # resolved recipe\n")[1])
    assert printed["sft"]["data"]["path"] == str(work / "proj" / "data" / "x.jsonl")
    assert printed["run"]["workspace"] == str(work / "proj" / "workspace")  # the default's too
    # A path typed on the command line is the typist's: relative to the current directory.
    (work / "other.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    recipe = load_recipe("proj/my.yaml", ["sft.data.path=other.jsonl", "run.workspace=ws"])
    assert (recipe.sft.data.path, recipe.run.workspace) == (
        str(work / "other.jsonl"),
        str(work / "ws"),
    )


def test_a_missing_relative_folder_is_reported_under_the_recipe_s_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    _project(work)
    (work / "tasks").mkdir()  # in the current directory, not beside the recipe
    monkeypatch.chdir(work)
    data = yaml.safe_load((work / "proj" / "my.yaml").read_text())
    data["evaluate"] = {"lm_eval": {"tasks": ["t"], "include_path": "tasks"}}
    _write(work / "proj" / "my.yaml", data)
    with pytest.raises(RecipeError) as exc:
        load_recipe("proj/my.yaml")
    assert exc.value.errors == [
        f"evaluate.lm_eval.include_path: {work / 'proj' / 'tasks'} is not a folder of task YAMLs"
    ]


def test_paths_in_an_extended_recipe_are_its_folder_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shared/base.yaml names data/x.jsonl and my_rewards (beside it); proj/my.yaml extends it
    from another folder: both are found in shared/, which is allowed like the recipe's own."""
    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    (shared / "data" / "x.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (shared / "my_rewards.py").write_text("def score(prompts, completions, **kw):\n    return 0\n")
    _write(
        shared / "base.yaml",
        {
            "run": {"workspace": "ws"},
            "infra": {"device": "cpu", "devices_per_node": 1},
            "ingest": TINY_INGEST,
            "sft": {"data": {"path": "data/x.jsonl"}},
            "grpo": {"data": {"path": "data/x.jsonl"}, "rewards": [{"fn": "my_rewards:score"}]},
        },
    )
    mine = _write(tmp_path / "proj" / "my.yaml", {"extends": "../shared/base.yaml"})
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(mine)
    assert recipe.grpo.data.path == str(shared / "data" / "x.jsonl")
    assert recipe.grpo.rewards[0].fn == f"{shared / 'my_rewards.py'}:score"
    assert recipe.run.workspace == str(shared / "ws")
    assert str(shared) in recipe.run.allowed_paths  # so the resolved recipe passes again


SHIPPED = ["chain", "grpo", "grpo-verifiable", "kto", "orpo", "ppo"]


def _fps(name: str) -> dict[str, str]:
    return {s.name: s.fingerprint for s in plan(load_recipe(ROOT / f"recipes/{name}.yaml")).stages}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipes_extend_the_quickstart_and_reuse_its_stages(name: str) -> None:
    raw = yaml.safe_load((ROOT / f"recipes/{name}.yaml").read_text())
    assert raw["extends"] == "quickstart.yaml"
    quickstart, mine = _fps("quickstart"), _fps(name)
    shared = [s for s in ("ingest", "sft", "reward", "dpo") if s in mine]
    assert shared[:2] == ["ingest", "sft"]
    assert {s: mine[s] for s in shared} == {s: quickstart[s] for s in shared}
    recipe = load_recipe(ROOT / f"recipes/{name}.yaml")
    # Its own pipeline: not the quickstart's name, nor its nightly schedule.
    assert recipe.run.name != "quickstart" and recipe.schedule is None
    assert recipe.run.workspace == str(ROOT / "workspace")


def test_a_data_file_beside_inherited_synthetic_data_says_which_to_null(tmp_path: Path) -> None:
    """The quickstart's sft.data is synthetic: a recipe extending it with its own file gets the
    merge of both, and the error says that the other half came from the extended recipe."""
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    mine = _write(
        tmp_path / "mine.yaml",
        {
            "extends": str(ROOT / "recipes" / "quickstart.yaml"),
            "run": {"name": "mine"},
            "sft": {"data": {"path": "rows.jsonl"}},
        },
    )
    with pytest.raises(RecipeError) as exc:
        load_recipe(mine)
    assert exc.value.errors == [
        "sft.data: give exactly one of data.path or data.synthetic (one of them may come from "
        "the recipe this one extends: set the other to null, e.g. synthetic: null)"
    ]
    written = yaml.safe_load(mine.read_text())
    written["sft"]["data"]["synthetic"] = None
    _write(mine, written)
    assert load_recipe(mine).sft.data.path == str(tmp_path / "rows.jsonl")
