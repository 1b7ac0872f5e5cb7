"""The teacher at plan time (issue 31): a token-level teacher (distill) must tokenize like its
student, refused when the recipe is resolved (validate, plan and run refuse before anything
runs); the memory pre-flight counts the teacher; evaluate scores it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.config import vocab_check
from posttrain.config.loader import RecipeError, load_recipe
from posttrain.kinds.ingest import TOKENIZER_FIELDS, IngestConfig
from posttrain.models.vocab import vocab_digest
from posttrain.planner import plan
from tests.test_bases import DATA, HEAD, REWARDS, TEACHER_SFT, recipe, teacher

DISTILL = {"kind": "distill", "name": "distill", "from": "sft", "teacher": "teacher_sft"}
DISTILL |= {**DATA, **REWARDS}


def refused(*stages: dict[str, Any]) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        plan(recipe(*stages))
    return exc.value.errors


# --- the vocabulary check -----------------------------------------------------------------------


def test_from_config_tokenizer_depends_on_its_fields_and_seed_not_the_width() -> None:
    """The experiment behind the from_config rule: ingest's BPE is the same for two widths, and
    differs when any tokenizer field or the seed differs."""
    from posttrain.stages.ingest import from_config_tokenizer

    small = {"vocab_size": 512, "corpus_examples": 400, "hidden_size": 64}

    def digest(seed: int = 0, **fields: Any) -> str:
        fc = IngestConfig(source="from_config", from_config={**small, **fields}).from_config
        return vocab_digest(from_config_tokenizer(fc, seed)[0])

    same = digest()
    assert digest(hidden_size=128, intermediate_size=512, num_layers=6, num_heads=8) == same
    assert digest(architecture="qwen2", embedding_rows=600) == same
    assert set(TOKENIZER_FIELDS) == {"vocab_size", "fill_vocab", "corpus_examples", "template"}
    for changed in (
        {"vocab_size": 600},
        {"fill_vocab": True, "vocab_size": 2048},
        {"corpus_examples": 500},
        {"template": "chatml_tools"},
    ):
        assert digest(**changed) != same, changed
    assert digest(seed=1) != same


def test_a_distill_teacher_of_another_from_config_vocabulary_is_refused_at_plan() -> None:
    wide = teacher(hidden_size=128, intermediate_size=512)
    assert "distill" in [s.name for s in plan(recipe(wide, TEACHER_SFT, DISTILL)).stages]
    (err,) = refused(teacher(hidden_size=128, vocab_size=4096), TEACHER_SFT, DISTILL)
    assert err.startswith(
        "stages.distill.teacher: the teacher 'teacher_sft' (base 'teacher') tokenizes with "
        "another vocabulary than the student 'distill' (base 'ingest') (both from_config, "
        "their tokenizer fields differ: vocab_size 2048 vs 4096; seed 0): token-level "
        "distillation needs one vocabulary"
    )
    # A base as the teacher is named once.
    (err,) = refused(teacher(template="chatml_tools"), {**DISTILL, "teacher": "teacher"})
    assert err.startswith("stages.distill.teacher: the teacher 'teacher' tokenizes with")
    assert "template 'chatml' vs 'chatml_tools'" in err
    # An SFT teacher writes text: any tokenizer may teach it.
    off_policy = {"kind": "sft", "name": "s2", "from": "sft", "teacher": "teacher_sft", **DATA}
    plan(recipe(teacher(vocab_size=4096), TEACHER_SFT, off_policy))


def _tokenizer_folder(folder: Path, vocab_size: int) -> Path:
    from posttrain.models.tiny import train_tokenizer

    corpus = [f"the number {i} plus {i * 7} is {i * 8}" for i in range(300)]
    folder.mkdir(parents=True)
    train_tokenizer(corpus, vocab_size).save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _path_recipe(tmp_path: Path, student: str | None, teacher_path: str) -> Path:
    data = copy.deepcopy(HEAD)
    if student is not None:
        data["ingest"] = {"source": "path", "path": student}
    data |= {
        "sft": DATA,
        "stages": [
            {"kind": "ingest", "name": "teacher", "path": teacher_path},
            TEACHER_SFT,
            DISTILL,
        ],
    }
    data["run"]["workspace"] = str(tmp_path / "ws")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_local_bases_are_compared_by_their_token_tables(tmp_path: Path) -> None:
    a = _tokenizer_folder(tmp_path / "a", 400)
    same = _tokenizer_folder(tmp_path / "same", 400)
    other = _tokenizer_folder(tmp_path / "other", 420)
    load_recipe(_path_recipe(tmp_path, str(a), str(same)), devices=False)
    with pytest.raises(RecipeError) as exc:
        load_recipe(_path_recipe(tmp_path, str(a), str(other)))
    (err,) = exc.value.errors
    assert err.startswith(
        "stages.distill.teacher: the teacher 'teacher_sft' (base 'teacher') tokenizes with "
        "another vocabulary than the student 'distill' (base 'ingest') (420 tokens vs 400; "
    )
    # A checkpoint never shares a from_config base's vocabulary.
    with pytest.raises(RecipeError) as exc:
        load_recipe(_path_recipe(tmp_path, None, str(a)))
    assert "the base of 'distill' (base 'ingest') is built from_config" in exc.value.errors[0]


def test_a_hub_teacher_is_read_from_the_cache_only_else_left_to_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _tokenizer_folder(tmp_path / "a", 400)
    cached = _tokenizer_folder(tmp_path / "cache" / "snapshot", 420)
    hub = IngestConfig(source="path", path="org/teacher", revision="main")
    local = IngestConfig(source="path", path=str(a))
    names = ("'s'", "'t'")
    asked: list[tuple[str, str]] = []

    def snapshot(repo: str, revision: str, repo_type: str = "model") -> Path | None:
        asked.append((repo, revision))
        return cached if "cached" in asked[0][1] else None

    monkeypatch.setattr(vocab_check, "cached_snapshot", snapshot)
    assert vocab_check._mismatch(local, hub, 0, names) is None  # not cached: the stage checks
    asked.clear()
    hub = IngestConfig(source="path", path="org/teacher", revision="cached")
    problem = vocab_check._mismatch(local, hub, 0, names)
    assert problem is not None and "(420 tokens vs 400;" in problem
    assert asked == [("org/teacher", "cached")]


def test_an_unreadable_tokenizer_is_left_to_the_stage(tmp_path: Path) -> None:
    a = _tokenizer_folder(tmp_path / "a", 400)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "tokenizer.json").write_text("not json")
    sections = [IngestConfig(source="path", path=str(p)) for p in (a, broken)]
    assert vocab_check._mismatch(*sections, 0, ("'s'", "'t'")) is None
