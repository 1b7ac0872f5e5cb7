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
from posttrain.config.loader import RecipeError, load_for_deployment, load_recipe, resolve
from posttrain.kinds.ingest import TOKENIZER_FIELDS, IngestConfig
from posttrain.models.vocab import vocab_digest
from posttrain.plan.planner import plan
from tests.test_bases import DATA, HEAD, REWARDS, TEACHER_SFT, planned, recipe, teacher

DISTILL = {"kind": "distill", "name": "distill", "from": "sft", "teacher": "teacher_sft"}
DISTILL |= {**DATA, **REWARDS}


def refused(*stages: dict[str, Any]) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        resolve(recipe(*stages))
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
    assert set(TOKENIZER_FIELDS) == {
        "vocab_size",
        "fill_vocab",
        "corpus_examples",
        "corpus_task",
        "template",
    }
    for changed in (
        {"vocab_size": 600},
        {"fill_vocab": True, "vocab_size": 2048},
        {"corpus_examples": 500},
        {"corpus_task": "code"},
        {"template": "chatml_tools"},
    ):
        assert digest(**changed) != same, changed
    assert digest(seed=1) != same


def test_a_distill_teacher_of_another_from_config_vocabulary_is_refused_at_plan() -> None:
    wide = teacher(hidden_size=128, intermediate_size=512)
    assert "distill" in planned(recipe(wide, TEACHER_SFT, DISTILL))
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
    plan(resolve(recipe(teacher(vocab_size=4096), TEACHER_SFT, off_policy)))


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
    load_for_deployment(_path_recipe(tmp_path, str(a), str(same)))
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


# --- the memory pre-flight counts the teacher ---------------------------------------------------


def _qwen(teacher_shape: str, world: int = 1, **distill: Any) -> Any:
    """A 0.5B-shaped student distilled from a `teacher_shape` teacher's SFT, bf16 on GPUs."""
    data = {
        **copy.deepcopy(HEAD),
        "ingest": {"source": "from_config", "from_config": {"shape": "qwen2.5-0.5b"}},
        "infra": {
            "device": "cuda",
            "precision": "bf16",
            "base_dtype": "bf16",
            "devices_per_node": world,
            "parallel_stages": 1,
        },
        "sft": DATA,
        "stages": [teacher(shape=teacher_shape), TEACHER_SFT, {**DISTILL, **distill}],
    }
    del data["stages"][0]["from_config"]["hidden_size"]
    from posttrain.config.loader import validate_recipe

    return validate_recipe(data)


def test_distill_chunk_rows_are_the_loss_modules() -> None:
    from posttrain.memory.estimate import DISTILL_CHUNK_TOKENS
    from posttrain.rl.distill_losses import DEFAULT_CHUNK_TOKENS

    assert DISTILL_CHUNK_TOKENS == DEFAULT_CHUNK_TOKENS


def test_a_7b_teacher_on_a_half_b_student_is_counted_in_its_own_rows() -> None:
    from posttrain.memory.estimate import GIB
    from posttrain.runtime.preflight import Capacity, preflight

    cap = Capacity(80 * GIB, "test")
    one = preflight(_qwen("qwen2.5-7b"), "distill", capacity=cap)
    two = preflight(_qwen("qwen2.5-7b", world=2), "distill", capacity=cap)
    # Qwen2.5-7B: 7.6B parameters in bf16, its own row, halved over two ranks.
    weights = one.estimate.component("teacher weights")
    assert 15.0e9 < weights < 15.4e9
    assert two.estimate.component("teacher weights") == weights // 2
    text = one.text()
    assert "teacher weights" in text and "7,615,616,512 params, frozen, bf16, not sharded" in text
    assert "teacher adapter" in text  # teacher_sft's LoRA, frozen
    assert "1/2 per device" in two.estimate.table().split("teacher weights")[1].splitlines()[0]
    rows = {r.name: r for r in one.estimate.rows}
    # The loss's logits: the student's with their gradient, the teacher's, and the chunks.
    micro, new = 8, 32  # the distill defaults: 8 prompts x 1 sample a step, 32 new tokens
    assert rows["distillation logits"].bytes == 2 * micro * new * 151_936 * 2
    assert rows["teacher logits (kept)"].bytes == micro * new * 152_064 * 2
    assert rows["distillation chunks"].bytes == 8 * micro * new * 152_064 * 4  # 256 rows < 1024
    assert "teacher gathered weights" not in rows  # one device: not wrapped
    assert "teacher gathered weights" in {r.name for r in two.estimate.rows}
    jsd = preflight(_qwen("qwen2.5-7b", loss="jsd"), "distill", capacity=cap).estimate
    assert jsd.component("distillation chunks") == 12 * micro * new * 152_064 * 4


def test_an_estimate_with_a_teacher_exceeds_one_without_by_about_its_bytes() -> None:
    from dataclasses import replace

    from posttrain.memory.estimate import estimate
    from posttrain.runtime.preflight import device_layout, model_shape, stage_shape

    r = _qwen("qwen2.5-1.5b")
    shape = stage_shape(r, "distill")
    assert shape.teacher is not None and shape.teacher.model.hidden == 1536
    student, layout = model_shape(r), device_layout(r)
    est = estimate(student, shape, layout)
    without = estimate(student, replace(shape, teacher=None), layout)
    teacher_bytes = shape.teacher.model.base_params("lm") * 2
    # Its weights and adapter, plus what it adds to the update (the peak phase either way): its
    # kept logits, the student's logits with their gradient, the loss's chunks.
    assert est.peak_phase == without.peak_phase == "update"
    added = [r for r in est.rows if r.phase in ("", "update") and r not in without.rows]
    assert {r.name for r in added} == {
        "teacher weights", "teacher adapter", "teacher logits (kept)", "distillation logits",
        "distillation chunks",
    }  # fmt: skip
    assert est.total - without.total == sum(r.bytes for r in added)
    assert teacher_bytes < est.total - without.total < 1.6 * teacher_bytes
    # An sft teacher writes text before training, then is freed: its weights are a phase of
    # their own (answering), beside the step's rather than added to it; no distillation logits.
    off = {"kind": "sft", "name": "s2", "from": "sft", "teacher": "teacher_sft", **DATA}
    r = _qwen("qwen2.5-1.5b")
    data = r.model_dump(mode="json", exclude_unset=True)
    data["stages"][2] = off
    from posttrain.config.loader import validate_recipe

    sft = stage_shape(validate_recipe(data), "s2")
    assert sft.teacher is not None and sft.teacher.positions is None
    est = estimate(student, sft, layout)
    alone = estimate(student, replace(sft, teacher=None), layout)
    phases = est.phase_totals()
    assert phases["answering"] == teacher_bytes + est.component("teacher adapter")
    assert phases["step"] == alone.phase_totals()["step"]
    assert est.total == alone.static + max(phases["answering"], phases["step"])
    assert est.component("teacher weights") == teacher_bytes
    assert est.component("distillation") == 0


def test_the_teacher_shape_is_read_from_its_base_folder(tmp_path: Path) -> None:
    from posttrain.runtime.preflight import stage_shape

    config = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 3}
    config |= {"intermediate_size": 512, "vocab_size": 2048, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = stage_shape(_qwen("qwen2.5-1.5b"), "distill", teacher_dir=tmp_path)
    assert shape.teacher is not None
    assert (shape.teacher.model.hidden, shape.teacher.model.layers) == (256, 3)


# --- evaluate scores the teacher ----------------------------------------------------------------


def test_evaluate_of_a_distilled_policy_reads_its_teacher_and_the_teachers_base() -> None:
    wide = teacher(hidden_size=128, intermediate_size=512)
    p = planned(recipe(wide, TEACHER_SFT, DISTILL))
    roles = p["evaluate"].roles
    assert roles["policy"] == "distill" and roles["parent"] == "sft" and roles["base"] == "ingest"
    assert (roles["teacher"], roles["teacher_base"]) == ("teacher_sft", "teacher")
    assert {"teacher_sft", "teacher", "sft"} <= set(p["evaluate"].parents)
    assert "teacher" not in p["export"].roles  # export ships the student alone
    # Its fingerprint follows the teacher (by role): another teacher, another evaluation; the
    # export's does not move.
    other_sft = {**TEACHER_SFT, "max_steps": 7}
    q = planned(recipe(wide, other_sft, DISTILL))
    assert q["teacher_sft"].fingerprint != p["teacher_sft"].fingerprint
    assert q["distill"].fingerprint != p["distill"].fingerprint  # it reads the teacher too
    assert q["evaluate"].fingerprint != p["evaluate"].fingerprint
    # A policy trained without a teacher is evaluated as before.
    plain = planned(recipe(wide, TEACHER_SFT))
    assert "teacher" not in plain["evaluate"].roles


def test_evaluate_fingerprint_changes_with_the_teachers_base_alone() -> None:
    base_only = {**DISTILL, "teacher": "teacher"}  # the teacher is a base: only its weights
    a = planned(recipe(teacher(hidden_size=128), base_only))
    b = planned(recipe(teacher(hidden_size=96), base_only))
    assert a["evaluate"].roles["teacher"] == a["evaluate"].roles["teacher_base"] == "teacher"
    assert a["evaluate"].fingerprint != b["evaluate"].fingerprint
    assert a["sft"].fingerprint == b["sft"].fingerprint


def test_report_md_shows_the_teacher_line() -> None:
    from flows.report.tables import StageRecord, markdown_report
    from posttrain.store.summary import Summary

    roles = {"base": "ingest", "policy": "distill", "parent": "sft", "teacher": "teacher_sft"}
    roles["teacher_base"] = "teacher"
    headline = {"exact_match_base": 0.0, "exact_match_tuned": 0.5, "exact_match_parent": 0.25}
    headline |= {"exact_match_teacher": 0.75, "teacher_gap_closed": 0.5}
    summary = Summary(headline=headline)
    ev = StageRecord("evaluate", "f", "ran", 1.0, summary=summary, roles=roles, kind="evaluate")
    text = markdown_report("r", "id", [ev])
    assert (
        "## Teacher\n\nDistilled from `teacher_sft` (base `teacher`): greedy exact match parent "
        "0.25 -> `distill` 0.5, teacher 0.75: closed 0.5 of the gap." in text
    )
    del summary.headline["teacher_gap_closed"]
    assert "no gap to close" in markdown_report("r", "id", [ev])
    assert "## Teacher" not in markdown_report(
        "r", "id", [StageRecord("evaluate", "f", "ran", 1.0)]
    )


@pytest.mark.slow
def test_a_tiny_run_with_a_teacher_reports_the_gap_closed(tmp_path: Path) -> None:
    """Real stages in process: a student base and a wider teacher base (one tokenizer), an SFT
    on each, a stage with a teacher link (an sft from the student's sft), then evaluate: its
    headline holds the parent's and the teacher's exact match and the gap closed, which is the
    formula on the report's numbers; the teacher's pass@1 stands beside the others'."""
    from posttrain.rl.distill_losses import teacher_gap_closed
    from tests.stage_helpers import SMALL_EVALUATE, TINY, run_inprocess, write_recipe

    data = copy.deepcopy(TINY)
    wide = copy.deepcopy(data["ingest"])
    wide["from_config"] |= {"hidden_size": 96, "intermediate_size": 192}
    sft = {k: v for k, v in data["sft"].items() if k != "max_steps"} | {"max_steps": 8}
    data["sft"] = sft
    # The teacher trains as long as it must to answer one held-out prompt exactly (1 of 24), so
    # that the gap closed is defined and its formula checked; its answers to the taught entry's
    # 216 training prompts need not be long (the default is 128 tokens), nor pass@k's samples.
    answers = {"teacher_sampling": {"max_new_tokens": 16}}
    data["stages"] = [
        {"kind": "ingest", "name": "teacher", **wide},
        {"kind": "sft", "name": "teacher_sft", "base": "teacher", **sft, "max_steps": 24},
        {"kind": "sft", "name": "taught", "from": "sft", "teacher": "teacher_sft", **sft,
         **answers},
    ]  # fmt: skip
    data["evaluate"] |= {
        "speed": None,
        "verifiers": [{"fn": "posttrain.rewards.match:exact_match"}],
    }
    data["evaluate"] |= {"pass_samples": 2, "pass_k": 2, "pass_prompts": 8}
    data["evaluate"]["pass_sampling"] = SMALL_EVALUATE["pass_sampling"]
    data["export"] = None
    path = write_recipe(tmp_path, data)
    for name in ("ingest", "teacher"):
        run_inprocess("ingest", path, name=name)
    for name in ("sft", "teacher_sft", "taught"):
        run_inprocess("sft", path, name=name)
    ev = run_inprocess("evaluate", path)
    spec = json.loads((ev / "logs" / "spec.json").read_text())
    assert (
        spec["stage"]["roles"]["teacher"] == "teacher_sft"
        and spec["stage"]["roles"]["teacher_base"] == "teacher"
    )
    report = json.loads((ev / "eval.json").read_text())
    assert report["teacher"] == {"stage": "teacher_sft", "base": "teacher"}
    exact = report["exact_match"]
    assert set(exact) == {"base", "tuned", "parent", "teacher"}
    headline = json.loads((ev / "manifest.json").read_text())["summary"]["headline"]
    for k in ("parent", "teacher", "tuned"):
        assert headline[f"exact_match_{k}"] == round(exact[k], 4)
    gap = teacher_gap_closed(exact["parent"], exact["tuned"], exact["teacher"])
    if gap is None:
        assert "teacher_gap_closed" not in headline and "teacher_gap_closed" not in report
    else:
        assert (
            headline["teacher_gap_closed"]
            == round(gap, 4)
            == round(report["teacher_gap_closed"], 4)
        )
    by = report["verifier"]["policies"]
    assert set(by) == {"ingest", "sft", "taught", "teacher_sft"}
    # Only the final policy is sampled by default: the teacher has its greedy pass@1 alone.
    assert report["verifier"]["sampled"] == ["taught"] and "pass@2" not in by["teacher_sft"]
    assert headline["pass@1_teacher"] == round(by["teacher_sft"]["pass@1"], 4)
    print("exact match", exact, "gap", gap, "pass@1", {k: v["pass@1"] for k, v in by.items()})


def test_sequence_parallel_splits_the_teacher_forward_and_both_heads() -> None:
    """At N = 2 a rank runs both models on its slice of the packed rows and both heads on the
    answer tokens in it: ceil(micro x seq_len / 2) positions at most, and never more than the
    answers' tokens (one rank's slice may hold a whole answer)."""
    from dataclasses import replace

    from posttrain.memory.estimate import DeviceLayout, estimate
    from posttrain.runtime.preflight import model_shape, stage_shape

    r = _qwen("qwen2.5-1.5b", world=2, rollout={"max_new_tokens": 4096})
    shape, student = stage_shape(r, "distill"), model_shape(r)
    assert shape.teacher is not None and shape.teacher.positions == 4096
    micro, seq = shape.micro_batch, shape.seq_len  # prompt + 4096 new tokens
    at = {n: estimate(student, shape, DeviceLayout(world=2, sequence_parallel=n)) for n in (1, 2)}
    rows = {n: {row.name: row.bytes for row in at[n].rows} for n in (1, 2)}
    half = -(-micro * seq // 2)
    assert half < micro * 4096  # long answers: the slice is the bound
    t_vocab, s_vocab = shape.teacher.model.vocab, student.vocab
    assert rows[1]["teacher logits (kept)"] == micro * 4096 * t_vocab * 2
    assert rows[2]["teacher logits (kept)"] == half * t_vocab * 2
    assert rows[2]["distillation logits"] == 2 * half * s_vocab * 2
    tm = shape.teacher.model
    assert rows[2]["teacher forward"] == half * (3 * tm.hidden + 3 * tm.intermediate) * 2
    # Few answer tokens in long rows: every one of them may lie in one slice.
    short = replace(shape, teacher=replace(shape.teacher, positions=8))
    two = {
        row.name: row.bytes
        for row in estimate(student, short, DeviceLayout(2, sequence_parallel=2)).rows
    }
    assert two["teacher logits (kept)"] == micro * 8 * t_vocab * 2
