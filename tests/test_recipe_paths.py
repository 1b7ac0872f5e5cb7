"""Recipe paths may only read from allowed folders: `..` and symlinks out of them are refused,
naming the field; `run.allowed_paths` allows a folder explicitly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from posttrain.config.loader import RecipeError, load_for_deployment, load_recipe, resolve
from tests.hub_cache import cache_recipe_hub_ids

FIELDS = (
    "ingest.path",
    "ingest.chat_template",
    "reward.chat_template",
    "sft.data.path",
    "sft.data.eval_path",
    "reward.data.path",
)


def _recipe(
    folder: Path,
    field: str,
    value: str,
    allowed: list[str] | None = None,
    workspace: Path | None = None,
) -> Path:
    """A recipe in `folder` whose `field` is `value`; every other input is a file beside it."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "rows.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (folder / "base").mkdir(exist_ok=True)
    data: dict = {
        "run": {"workspace": str(workspace or folder / "ws")},
        "infra": {"device": "cpu", "devices_per_node": 1},
        "ingest": {"source": "path", "path": str(folder / "base")},
        "sft": {"data": {"path": str(folder / "data" / "rows.jsonl")}},
        "reward": {"data": {"path": str(folder / "data" / "rows.jsonl")}},
    }
    if allowed is not None:
        data["run"]["allowed_paths"] = allowed
    section, *rest = field.split(".")
    node = data[section]
    for part in rest[:-1]:
        node = node[part]
    node[rest[-1]] = value
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("field", FIELDS)
def test_dotdot_out_of_the_recipe_folder_is_refused(tmp_path: Path, field: str) -> None:
    escape = str(tmp_path / "data" / ".." / ".." / ".." / ".." / ".." / ".." / "etc" / "hostname")
    with pytest.raises(RecipeError) as exc:
        load_recipe(_recipe(tmp_path, field, escape))
    [line] = exc.value.errors
    assert line.startswith(f"{field}: /etc/hostname (given as {escape}) is outside the folders")
    assert "add its folder to run.allowed_paths" in line
    assert str(tmp_path / "recipe.yaml") in str(exc.value)


def test_relative_dotdot_escapes_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = _recipe(tmp_path, "sft.data.path", "data/rows.jsonl")
    monkeypatch.chdir(tmp_path)
    assert load_recipe(recipe).sft.data.path == str(tmp_path / "data" / "rows.jsonl")
    depth = len(tmp_path.parts)
    recipe = _recipe(tmp_path, "sft.data.path", "../" * depth + "etc/hostname")
    with pytest.raises(RecipeError, match=r"sft\.data\.path: /etc/hostname \(given as \.\./"):
        load_recipe(recipe)


def test_symlink_in_the_recipe_folder_to_etc_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "system").symlink_to("/etc")
    link = str(tmp_path / "data" / "system" / "hostname")
    with pytest.raises(RecipeError) as exc:
        load_recipe(_recipe(tmp_path, "sft.data.path", link))
    [line] = exc.value.errors
    assert line.startswith(
        f"sft.data.path: /etc/hostname (given as {link}, through a symlink) is outside"
    )
    # A folder linked to as a whole (a model folder symlinked elsewhere) is refused the same way.
    (tmp_path / "etc-link").symlink_to("/etc")
    with pytest.raises(
        RecipeError, match=r"ingest\.path: /etc \(given as .*etc-link, through a symlink\)"
    ):
        load_recipe(_recipe(tmp_path, "ingest.path", str(tmp_path / "etc-link")))


def test_every_escaping_field_is_reported_at_once(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, "ingest.path", "/etc")
    data = yaml.safe_load(recipe.read_text())
    data["sft"]["data"]["eval_path"] = "/etc/hostname"
    recipe.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError) as exc:
        load_for_deployment(recipe)  # what `posttrain serve`/`submit` load
    assert [e.split(":")[0] for e in exc.value.errors] == ["ingest.path", "sft.data.eval_path"]


def test_allowed_paths_admit_a_folder_explicitly(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, "sft.data.eval_path", "/etc/hostname", allowed=["/etc"])
    r = load_recipe(recipe)
    assert r.sft.data.eval_path == "/etc/hostname"
    # A relative allowed folder is the recipe's folder's (like every relative path in it), and
    # the resolved recipe carries it absolute.
    rows = tmp_path / "shared" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text('{"prompt": "a", "completion": "b"}\n')
    recipe = _recipe(tmp_path / "proj", "sft.data.eval_path", "../shared/rows.jsonl")
    with pytest.raises(RecipeError, match=r"sft\.data\.eval_path: .*shared/rows\.jsonl .* outside"):
        load_recipe(recipe)
    recipe = _recipe(tmp_path / "proj", "sft.data.eval_path", str(rows), allowed=["../shared"])
    r = load_recipe(recipe)
    assert (r.sft.data.eval_path, r.run.allowed_paths[0]) == (str(rows), str(rows.parent))


def test_workspace_is_an_allowed_folder(tmp_path: Path) -> None:
    base = tmp_path / "ws" / "artifacts" / "export" / "0123456789abcdef" / "model"
    base.mkdir(parents=True)
    recipe = _recipe(tmp_path / "recipes", "ingest.path", str(base), workspace=tmp_path / "ws")
    r = load_recipe(recipe)
    assert r.ingest.path == str(base)


def test_resolved_recipe_passes_again_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flow (on a server, in another directory) re-resolves what `serve`/`submit` sent: the
    recipe's folder travels in run.allowed_paths, and nothing else is admitted."""
    rows = tmp_path / "proj" / "data" / "rows.jsonl"
    sent = load_for_deployment(_recipe(tmp_path / "proj", "sft.data.path", str(rows)))
    assert sent.run.allowed_paths == [str((tmp_path / "proj").resolve())]
    elsewhere = tmp_path / "worker"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert resolve(sent).sft.data.path == str(rows)
    # A path edited in the UI form to point out of those folders is refused by the flow.
    edited = sent.model_copy(deep=True)
    edited.sft.data.path = "/etc/hostname"
    with pytest.raises(RecipeError, match=r"sft\.data\.path: /etc/hostname is outside"):
        resolve(edited)


def test_shipped_recipes_need_no_allowed_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    for path in sorted((root / "recipes").glob("*.yaml")):
        cache_recipe_hub_ids(path, tmp_path)  # hub ids are no paths, but must resolve to load
        # The folder a recipe's own code (tools, environments: recipes/*.py) is found in is
        # recorded there by the resolver itself; nothing else may be needed.
        allowed = load_recipe(path).run.allowed_paths
        assert set(allowed) <= {str(path.parent.resolve())}, path
        assert "allowed_paths" not in yaml.safe_load(path.read_text())["run"], path


def _judged(folder: Path, model: str) -> Path:
    """A recipe in `folder` whose GRPO stage is scored by a judge naming `model`."""
    data = yaml.safe_load(
        _recipe(folder, "sft.data.path", str(folder / "data" / "rows.jsonl")).read_text()
    )
    del data["reward"]
    judge = {"url": "http://127.0.0.1:1", "model": model, "rubric": "{completion}"}
    data["grpo"] = {
        "data": {"path": str(folder / "data" / "rows.jsonl")},
        "rewards": [{"judge": judge}],
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_judge_model_folder_is_relative_to_the_recipe(tmp_path: Path, monkeypatch) -> None:
    """`judge.model: judge-model` beside the recipe is that folder wherever posttrain runs (and
    its files are what the fingerprint takes); a name no folder has stays a name."""
    folder = tmp_path / "recipes"
    (folder / "judge-model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    got = load_recipe(_judged(folder, "judge-model")).grpo.rewards[0].judge.model
    assert got == str(folder / "judge-model")
    assert load_recipe(_judged(folder, "gpt-judge")).grpo.rewards[0].judge.model == "gpt-judge"


def test_a_judge_model_folder_outside_the_allowed_ones_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "recipes"
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(RecipeError) as exc:
        load_recipe(_judged(folder, str(tmp_path / "recipes" / ".." / "elsewhere")))
    [line] = exc.value.errors
    assert line.startswith(f"grpo.rewards.0.judge.model: {tmp_path / 'elsewhere'} (given as")
