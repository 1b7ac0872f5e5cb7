"""Hub ids for models and datasets, resolved offline through the real huggingface_hub and
datasets code against cache layouts built by hand exactly as huggingface_hub writes them
(tests/hub_cache.py). Nothing is mocked and nothing is downloaded (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from posttrain import hub
from posttrain.config.loader import RecipeError, load_recipe
from posttrain.data.loading import DataError, DataSource, load_sft_rows
from posttrain.data.preference import read_preference_rows
from posttrain.data.prompts import read_prompt_rows
from posttrain.plan.planner import plan
from tests.fixtures_tiny import tiny_assets
from tests.hub_cache import add_snapshot, commit_sha, folder_files
from tests.stage_helpers import TINY, planned_dir, run_inprocess

MODEL = "tiny-org/tiny-chat"
SHA_1, SHA_2 = commit_sha("model v1"), commit_sha("model v2")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache that huggingface_hub and posttrain both read (HF_HUB_CACHE)."""
    folder = tmp_path / "hf-cache"
    folder.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    return folder


def parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


def add_dataset(cache: Path, repo: str, splits: dict[str, list[dict]], sha: str) -> Path:
    """A hub-layout parquet dataset: data/<split>-00000-of-00001.parquet, refs/main."""
    files = {f"data/{s}-00000-of-00001.parquet": parquet(rows) for s, rows in splits.items()}
    return add_snapshot(cache, repo, files, sha, repo_type="dataset")


# ---------------------------------------------------------------- resolution and errors


def test_revision_resolves_from_refs_and_a_full_sha(cache: Path) -> None:
    add_snapshot(cache, MODEL, {"config.json": b"{}"}, SHA_1, refs=("main",))
    add_snapshot(cache, MODEL, {"config.json": b'{"a": 1}'}, SHA_2, refs=("v2", "dev"))
    assert hub.resolve_sha(MODEL, "main") == SHA_1
    assert hub.resolve_sha(MODEL, "v2") == hub.resolve_sha(MODEL, "dev") == SHA_2
    assert hub.resolve_sha(MODEL, SHA_2) == SHA_2
    snap = hub.snapshot(MODEL, "v2")
    assert snap.folder == cache / "models--tiny-org--tiny-chat" / "snapshots" / SHA_2
    assert json.loads((snap.folder / "config.json").read_text()) == {"a": 1}
    assert (snap.folder / "config.json").is_symlink()


def test_missing_model_and_revision_say_what_where_and_offline(cache: Path) -> None:
    add_snapshot(cache, MODEL, {"config.json": b"{}"}, SHA_1)
    with pytest.raises(hub.HubError) as exc:
        hub.snapshot("tiny-org/absent")
    msg = str(exc.value)
    for part in (
        "'tiny-org/absent'",
        "'main'",
        str(cache),
        "HF_HUB_OFFLINE=on",
        "not in the cache",
    ):
        assert part in msg, msg
    with pytest.raises(hub.HubError) as exc:
        hub.snapshot(MODEL, "v9")
    msg = str(exc.value)
    for part in (f"'{MODEL}'", "'v9'", str(cache), "HF_HUB_OFFLINE=on", "cached refs: ['main']"):
        assert part in msg, msg
    with pytest.raises(hub.HubError, match="revision not in the cache"):
        hub.snapshot(MODEL, commit_sha("never fetched"))


def test_hub_ids_are_not_local_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert not hub.is_hub_id("data/train.jsonl")  # a missing file stays a missing file
    assert not hub.is_hub_id("../x/y") and not hub.is_hub_id("/abs/path")
    assert not hub.is_hub_id("a/b/c") and not hub.is_hub_id("justname")
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert not hub.is_hub_id("org/local")  # an existing folder wins


def test_pinned_commit_wins_over_a_moved_branch(cache: Path) -> None:
    add_snapshot(cache, MODEL, {"config.json": b"{}"}, SHA_1)
    hub.pin([{"repo_type": "model", "hub_repo": MODEL, "revision": "main", "commit_sha": SHA_1}])
    try:
        add_snapshot(cache, MODEL, {"config.json": b'{"a": 1}'}, SHA_2)  # main moves on
        assert hub.resolve_sha(MODEL, "main") == SHA_2
        assert hub.snapshot(MODEL, "main").commit_sha == SHA_1
    finally:
        hub._PINS.clear()


# ---------------------------------------------------------------- hub datasets


def test_hub_dataset_split_columns_and_row_names(cache: Path) -> None:
    sha = commit_sha("ds")
    add_dataset(
        cache,
        "org/qa",
        {
            "train": [{"question": f"q{i}", "answer": f"a{i}"} for i in range(3)],
            "test": [{"question": "tq", "answer": "ta"}],
        },
        sha,
    )
    cols = {"question": "prompt", "answer": "completion"}
    rows = load_sft_rows(DataSource("org/qa", split="test", columns=cols))
    assert rows == [
        {"messages": [{"role": "user", "content": "tq"}, {"role": "assistant", "content": "ta"}]}
    ]
    assert len(load_sft_rows(DataSource("org/qa", columns=cols))) == 3
    with pytest.raises(DataError, match=r"org/qa\[train\] row 0: expected one of"):
        load_sft_rows(DataSource("org/qa"))  # without the renames: no shape we know
    with pytest.raises(DataError, match=r"org/qa\[validation\].*Unknown split"):
        load_sft_rows(DataSource("org/qa", split="validation", columns=cols))
    with pytest.raises(DataError, match=r"dataset 'org/qa' at revision 'v2'.*HF_HUB_OFFLINE=on"):
        load_sft_rows(DataSource("org/qa", revision="v2", columns=cols))


def test_hub_preference_and_prompt_data_with_message_lists(cache: Path) -> None:
    def turn(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    pairs = [
        {
            "chosen": [turn("user", f"q{i}"), turn("assistant", "good")],
            "rejected": [turn("user", f"q{i}"), turn("assistant", "bad")],
            "id": i,
        }
        for i in range(3)
    ]
    pairs[2]["rejected"] = pairs[2]["chosen"]
    add_dataset(cache, "org/prefs", {"train": pairs}, commit_sha("prefs"))
    with pytest.raises(DataError, match=r"org/prefs\[train\] row 2: chosen and rejected are ident"):
        read_preference_rows(DataSource("org/prefs"))
    located, dropped = read_preference_rows(DataSource("org/prefs"), on_invalid="skip")
    assert dropped == {"identical": 1}
    assert located[0] == (
        "org/prefs[train] row 0",
        {"prompt": [turn("user", "q0")], "chosen": "good", "rejected": "bad"},
    )
    # The same files as prompts for RL, through a rename: `chosen` read as `messages`.
    prompts, _ = read_prompt_rows(DataSource("org/prefs", columns={"chosen": "messages"}))
    where, row = prompts[1]
    assert (where, row["messages"]) == ("org/prefs[train] row 1", [turn("user", "q1")])


def test_preference_config_reads_hub_splits_with_renamed_columns(cache: Path) -> None:
    """A preference section with split / eval_split / columns, through the stage's reader."""
    from posttrain.data.pref_prepare import read_and_split
    from posttrain.data.preference import quickstart_preference_rows
    from posttrain.sections.shared import PreferenceDataConfig

    def pairs(n: int, tag: str) -> list[dict]:
        return [{"q": f"{tag}{i}", "better": "yes", "worse": "no"} for i in range(n)]

    add_dataset(cache, "org/pairs", {"train": pairs(4, "t"), "eval": pairs(2, "e")}, SHA_2)
    cfg = PreferenceDataConfig(
        path="org/pairs",
        eval_path="org/pairs",
        eval_split="eval",
        columns={"q": "prompt", "better": "chosen", "worse": "rejected"},
    )
    train, held, dropped = read_and_split(cfg, 0, read_preference_rows, quickstart_preference_rows)
    assert [w for w, _ in train] == [f"org/pairs[train] row {i}" for i in range(4)]
    assert [w for w, _ in held] == ["org/pairs[eval] row 0", "org/pairs[eval] row 1"]
    assert held[1][1] == {
        "prompt": [{"role": "user", "content": "e1"}],
        "chosen": "yes",
        "rejected": "no",
    }
    assert dropped == {}


def test_hub_dataset_subset_from_the_card_configs(cache: Path) -> None:
    """Subsets as the hub declares them: `configs` in the dataset card's YAML header."""
    card = (
        "---\nconfigs:\n"
        "- config_name: easy\n  data_files:\n  - split: train\n    path: easy/train-*.parquet\n"
        "- config_name: hard\n  data_files:\n  - split: train\n    path: hard/train-*.parquet\n"
        "---\n# qa\n"
    )
    files = {
        "README.md": card.encode(),
        "easy/train-00000-of-00001.parquet": parquet([{"prompt": "1+1?", "completion": "2"}]),
        "hard/train-00000-of-00001.parquet": parquet([{"prompt": "7*8?", "completion": "56"}]),
    }
    add_snapshot(cache, "org/levels", files, SHA_1, repo_type="dataset")
    rows = load_sft_rows(DataSource("org/levels", subset="hard"))
    assert rows[0]["messages"][0]["content"] == "7*8?"
    with pytest.raises(DataError, match=r"org/levels\[train\] \(subset 'medium'"):
        load_sft_rows(DataSource("org/levels", subset="medium"))


def test_cache_folder_follows_hf_home_and_hf_hub_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / "hub"
    add_snapshot(tmp_path / "home" / "hub", MODEL, {"config.json": b"{}"}, SHA_1)
    assert hub.snapshot(MODEL).commit_sha == SHA_1
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(hub.HubError, match="elsewhere"):
        hub.snapshot(MODEL)


def test_columns_rename_local_files_too(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"q": "x", "a": "y"}) + "\n" + json.dumps({"q": "x", "other": "y"}) + "\n"
    )
    with pytest.raises(DataError) as exc:
        load_sft_rows(DataSource(str(path), columns={"q": "prompt", "a": "completion"}))
    assert str(exc.value).startswith(f"{path}:2: columns ['a']"), exc.value


# ---------------------------------------------------------------- recipes and fingerprints


def _recipe(tmp_path: Path, **sections: dict) -> Path:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["run"]["workspace"] = str(tmp_path / "ws")
    for name, value in sections.items():
        data[name] = {**data[name], **value}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_fingerprints_follow_the_resolved_commit(cache: Path, tmp_path: Path) -> None:
    sha_a, sha_b = commit_sha("data a"), commit_sha("data b")
    rows = [{"prompt": "p", "completion": "c"}]
    add_dataset(cache, "org/sft", {"train": rows}, sha_a)
    sft = {"data": {"path": "org/sft", "eval_fraction": 0.0}}
    recipe = _recipe(tmp_path, sft=sft)

    def sft_stage() -> tuple[str, dict]:
        s = next(s for s in plan(load_recipe(recipe)).stages if s.name == "sft")
        return s.fingerprint, s.inputs["hub"]

    fp_a, record = sft_stage()
    assert record == {
        "data.path": {
            "repo_type": "dataset",
            "hub_repo": "org/sft",
            "revision": "main",
            "commit_sha": sha_a,
        }
    }
    assert sft_stage()[0] == fp_a  # same commit, same run
    add_dataset(cache, "org/sft", {"train": rows}, sha_b)  # main moves to a new commit
    fp_b, record = sft_stage()
    assert fp_b != fp_a and record["data.path"]["commit_sha"] == sha_b


def test_unresolvable_hub_ids_are_recipe_errors(cache: Path, tmp_path: Path) -> None:
    recipe = _recipe(
        tmp_path,
        ingest={"source": "path", "path": "org/no-model", "revision": "v1"},
        sft={"data": {"path": "org/no-data", "synthetic": None}},
    )
    with pytest.raises(RecipeError) as exc:
        load_recipe(recipe)
    lines = exc.value.errors
    assert any(x.startswith("ingest.path: model 'org/no-model' at revision 'v1'") for x in lines)
    assert any(x.startswith("sft.data.path: dataset 'org/no-data'") for x in lines), lines


# ---------------------------------------------------------------- ingest from the hub cache


@pytest.fixture()
def hub_model(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base as commit SHA_1 (main) and SHA_2 (tag v2: another chat template)."""
    base = tiny_assets(tmp_path_factory).base_dir
    files = folder_files(base)
    add_snapshot(cache, MODEL, files, SHA_1, refs=("main",))
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    files_2 = {**files, "tokenizer_config.json": json.dumps({**tok_cfg, "v": 2}).encode()}
    add_snapshot(cache, MODEL, files_2, SHA_2, refs=("v2",))
    return cache


def test_ingest_a_hub_id_at_main_a_tag_and_a_sha(hub_model: Path, tmp_path: Path) -> None:
    recipe = _recipe(tmp_path, ingest={"source": "path", "path": MODEL})
    seen = {}
    for revision, sha in (("main", SHA_1), ("v2", SHA_2), (SHA_1, SHA_1)):
        out = run_inprocess("ingest", recipe, f"ingest.revision={revision}")
        m = json.loads((out / "manifest.json").read_text())
        s = m["summary"]
        assert (s["hub_repo"], s["revision"], s["commit_sha"]) == (MODEL, revision, sha)
        assert s["model_dir"] == str(hub_model / "models--tiny-org--tiny-chat" / "snapshots" / sha)
        assert m["section"]["hub"]["path"]["commit_sha"] == sha
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(s["source_files"])
        seen[revision] = out.name
    assert len(set(seen.values())) == 3  # each revision is its own run


def test_ingest_hub_snapshot_goes_through_the_local_checks(hub_model: Path, tmp_path: Path) -> None:
    # A commit whose config needs custom code: refused exactly as a local folder is.
    snap = hub_model / "models--tiny-org--tiny-chat" / "snapshots" / SHA_1
    cfg = json.loads((snap / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Model"}
    files = {**folder_files(snap), "config.json": json.dumps(cfg).encode()}
    add_snapshot(hub_model, MODEL, files, commit_sha("evil"), refs=("evil",))
    recipe = _recipe(tmp_path, ingest={"source": "path", "path": MODEL, "revision": "evil"})
    with pytest.raises(SystemExit):
        run_inprocess("ingest", recipe)
    err = (planned_dir("ingest", recipe) / "logs" / "error.txt").read_text()
    assert "needs custom code (auto_map)" in err and str(hub_model) in err


@pytest.mark.slow
def test_ingest_and_sft_from_hub_ids_offline(hub_model: Path, tmp_path: Path) -> None:
    """The whole path a user takes: a model id and a dataset id (Q/A columns renamed,
    train and test splits), both served offline from the hub cache, through ingest and a short LoRA SFT."""
    from posttrain.data.synthetic import quickstart_sft_rows

    def qa(rows: list[dict]) -> list[dict]:
        out = []
        for r in rows:
            user = next(m["content"] for m in r["messages"] if m["role"] == "user")
            out.append({"q": user, "a": r["messages"][-1]["content"]})
        return out

    data_sha = commit_sha("sft data")
    splits = {"train": qa(quickstart_sft_rows(96, 1)), "test": qa(quickstart_sft_rows(16, 2))}
    add_dataset(hub_model, "org/qa-sft", splits, data_sha)
    sft = {
        "data": {
            "path": "org/qa-sft",
            "eval_path": "org/qa-sft",
            "columns": {"q": "prompt", "a": "completion"},
            "max_seq_len": 64,
        },
        "max_steps": 4,
    }
    recipe = _recipe(tmp_path, ingest={"source": "path", "path": MODEL}, sft=sft)
    ingest = run_inprocess("ingest", recipe)
    out = run_inprocess("sft", recipe)
    m = json.loads((out / "manifest.json").read_text())
    assert m["section"]["hub"]["data.path"]["commit_sha"] == data_sha
    assert m["section"]["hub"]["data.eval_path"]["commit_sha"] == data_sha
    s = m["summary"]
    assert s["train_rows"] == 96 and s["eval_rows"] == 16, s
    assert s["eval_loss_final"] < s["eval_loss_start"], s
    ingest_summary = json.loads((ingest / "manifest.json").read_text())["summary"]
    assert ingest_summary["commit_sha"] == SHA_1
    # The export's model card names the hub base (front matter base_model) and its commit.
    run_inprocess("evaluate", recipe)
    card = (run_inprocess("export", recipe) / "model" / "README.md").read_text()
    assert f"base_model: {MODEL}" in card and SHA_1 in card


def test_a_hub_id_enters_the_inputs_by_its_commit(cache: Path, tmp_path: Path) -> None:
    """A local recipe has no hub records; a hub dataset id is in by the commit its revision
    resolved to, the record the stage process pins."""
    add_dataset(cache, "org/sft", {"train": [{"prompt": "p", "completion": "c"}]}, SHA_1)
    local = {s.name: s.inputs for s in plan(load_recipe(_recipe(tmp_path))).stages}
    assert not any("hub" in inputs for inputs in local.values())
    hub_recipe = load_recipe(_recipe(tmp_path, sft={"data": {"path": "org/sft"}}))
    inputs = next(s.inputs for s in plan(hub_recipe).stages if s.name == "sft")
    assert inputs["section"]["data"]["split"] == "train"
    assert inputs["hub"]["data.path"]["commit_sha"] == SHA_1


def test_ingest_error_for_a_missing_hub_model(cache: Path) -> None:
    from posttrain.kinds.ingest import IngestConfig
    from posttrain.stages.ingest import IngestError, hub_model_folder

    with pytest.raises(IngestError) as exc:
        hub_model_folder(IngestConfig(path="org/gone", revision="v3"))
    msg = str(exc.value)
    assert msg.startswith("ingest.path: model 'org/gone' at revision 'v3' (cache ")
    assert str(cache) in msg and "HF_HUB_OFFLINE=on" in msg and "\n" not in msg
