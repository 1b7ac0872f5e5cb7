"""lm-evaluation-harness in evaluate: the `evaluate.lm_eval` section, the score keys, the real
harness on a custom offline task over a tiny base -> SFT -> DPO run, and a promotion rule on
its score."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import random
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.config.loader import RecipeError, load_recipe
from posttrain.data.synthetic import CAPITALS
from posttrain.eval.lm_eval_harness import (
    flat_scores,
    headline,
    metric_key,
    preserved_global_state,
)
from posttrain.plan.planner import plan
from posttrain.workspace.promotion import compare, read_registry, record_decision
from tests.stage_helpers import TINY, run_inprocess, run_shared, write_recipe

TASK = "tiny_capitals"
METRIC = f"lm_eval/{TASK}/acc"


def write_task(folder: Path, rows: int = 12) -> Path:
    """A multiple-choice task over the synthetic capitals (what the tiny base was warmed up
    on): "The capital of X is" + the true capital and three others. YAML + JSONL, no hub."""
    folder.mkdir(parents=True, exist_ok=True)
    caps = sorted(CAPITALS.items())
    docs = []
    for i, (country, capital) in enumerate(caps[:rows]):
        choices = [capital, *(caps[(i + k) % len(caps)][1] for k in (1, 2, 3))]
        random.Random(i).shuffle(choices)
        docs.append(
            {
                "question": f"The capital of {country} is",
                "choices": choices,
                "answer": choices.index(capital),
            }
        )
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {
        "task": TASK,
        "dataset_path": "json",
        # lm-eval reads data_files relative to the current directory: give it an absolute path.
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return folder


def _recipe(tmp_path: Path, lm_eval: dict | None, data: dict | None = None) -> Path:
    data = copy.deepcopy(data or TINY)
    if lm_eval is not None:
        data["evaluate"] = {**data["evaluate"], "lm_eval": lm_eval}
    return write_recipe(tmp_path, data)


def _evaluate_fp(recipe: Path) -> str:
    return next(s for s in plan(load_recipe(recipe)).stages if s.kind == "evaluate").fingerprint


# --- fast: the section, the keys, the global state ------------------------------------------


def test_section_validates_and_names_the_field(tmp_path: Path) -> None:
    ok = load_recipe(_recipe(tmp_path, {"tasks": ["arc_easy"], "limit": 5}))
    cfg = ok.evaluate.lm_eval
    assert cfg is not None and cfg.policies == ["base", "sft", "final"] and cfg.num_fewshot is None
    assert load_recipe(_recipe(tmp_path, None)).evaluate.lm_eval is None  # off by default
    for bad, field in [
        ({"tasks": []}, "evaluate.lm_eval.tasks"),
        ({"tasks": ["a", "a"]}, "evaluate.lm_eval.tasks"),
        ({"tasks": ["a"], "limit": 0}, "evaluate.lm_eval.limit"),
        ({"tasks": ["a"], "policies": ["dpo"]}, "evaluate.lm_eval.policies"),
        ({"tasks": ["a"], "fewshot": 3}, "evaluate.lm_eval.fewshot"),
    ]:
        with pytest.raises(RecipeError) as err:
            load_recipe(_recipe(tmp_path, bad))
        assert field in str(err.value), (bad, str(err.value))


def test_include_path_is_resolved_like_other_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative input paths are read against the current directory
    write_task(tmp_path / "tasks")
    r = load_recipe(_recipe(tmp_path, {"tasks": [TASK], "include_path": "tasks"}))
    assert r.evaluate.lm_eval.include_path == str((tmp_path / "tasks").resolve())
    with pytest.raises(RecipeError, match="evaluate.lm_eval.include_path"):
        load_recipe(_recipe(tmp_path, {"tasks": [TASK], "include_path": "missing"}))


def test_missing_extra_is_one_clear_line(tmp_path: Path, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a)
    )
    recipe = _recipe(tmp_path, {"tasks": ["gsm8k"]})
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe)
    lines = [x for x in str(err.value).splitlines() if "lm_eval" in x]
    assert len(lines) == 1, str(err.value)
    assert "evaluate.lm_eval" in lines[0] and "pip install -e .[lm-eval]" in lines[0]
    assert "Traceback" not in str(err.value)
    load_recipe(_recipe(tmp_path, None))  # a recipe without the section does not need it


def test_fingerprint_follows_the_section_and_the_task_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    off = _evaluate_fp(_recipe(tmp_path, None))
    write_task(tmp_path / "tasks")
    base = {"tasks": [TASK], "include_path": "tasks", "limit": 8}
    on = _evaluate_fp(_recipe(tmp_path, base))
    assert on != off
    assert _evaluate_fp(_recipe(tmp_path, base)) == on  # stable
    assert _evaluate_fp(_recipe(tmp_path, {**base, "limit": 4})) != on
    assert _evaluate_fp(_recipe(tmp_path, {**base, "num_fewshot": 2})) != on
    assert _evaluate_fp(_recipe(tmp_path, {**base, "policies": ["final"]})) != on
    # The task's data changed (same file names): another result, another fingerprint.
    write_task(tmp_path / "tasks", rows=6)
    assert _evaluate_fp(_recipe(tmp_path, base)) != on
    # The section off is the fingerprint the recipe had before the section existed.
    assert _evaluate_fp(_recipe(tmp_path, None)) == off


def test_score_keys() -> None:
    assert metric_key("acc,none") == "acc"
    assert metric_key("exact_match,strict-match") == "exact_match/strict-match"
    assert metric_key("acc_stderr,none") is None
    assert metric_key("alias") is None
    results = {
        "gsm8k": {
            "alias": "gsm8k",
            "exact_match,strict-match": 0.25,
            "exact_match_stderr,strict-match": 0.1,
            "exact_match,flexible-extract": 0.5,
        },
        "mmlu": {"acc,none": 0.4, "acc_stderr,none": "N/A"},
        "mmlu_anatomy": {"acc,none": 0.3},
    }
    scores = flat_scores(results)
    assert scores["gsm8k"] == {
        "exact_match/strict-match": 0.25,
        "exact_match/flexible-extract": 0.5,
    }
    # Only the named tasks (a group's aggregate, not its subtasks) become headline metrics.
    assert headline(scores, ["gsm8k", "mmlu"]) == {
        "lm_eval/gsm8k/exact_match/strict-match": 0.25,
        "lm_eval/gsm8k/exact_match/flexible-extract": 0.5,
        "lm_eval/mmlu/acc": 0.4,
    }


def test_global_state_is_restored() -> None:
    ours = logging.getLogger("posttrain.evaluate")
    before = (ours.level, logging.getLogger().level, torch.get_num_threads())
    random.seed(3)
    torch.manual_seed(3)
    expected = (random.random(), torch.rand(1).item())
    random.seed(3)
    torch.manual_seed(3)
    with preserved_global_state():
        ours.setLevel(logging.ERROR)
        logging.getLogger().setLevel(logging.DEBUG)
        logging.getLogger("made.inside").setLevel(logging.CRITICAL)
        torch.set_num_threads(1 if before[2] > 1 else 2)
        random.seed(99)
        torch.manual_seed(99)
    assert (ours.level, logging.getLogger().level, torch.get_num_threads()) == before
    assert logging.getLogger("made.inside").level == logging.NOTSET
    assert (random.random(), torch.rand(1).item()) == expected


# --- slow: the real harness in the evaluate stage, and the gate on its score -----------------

DPO = {
    "data": {
        "synthetic": {"n_examples": 80, "seed": 5},
        "eval_fraction": 0.2,
        "max_seq_len": 64,
        "max_prompt_len": 40,
    },
    "optim": {"lr": 2e-3},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "max_steps": 3,
    "checkpoint_every": 0,
}


@pytest.mark.slow
def test_evaluate_runs_the_harness_and_the_gate_uses_its_score(
    tmp_path: Path, shared_parents: Path
) -> None:
    """base -> sft -> dpo on the tiny model; evaluate scores the custom task on all three
    (read from local files, offline) and the final policy's accuracy is a headline metric a
    promotion rule compares, in both directions."""
    write_task(tmp_path / "tasks")
    data = copy.deepcopy(TINY)
    data["dpo"] = DPO
    lm = {
        "tasks": [TASK],
        "include_path": str(tmp_path / "tasks"),
        "limit": 8,
        "batch_size": 8,
        "bootstrap_iters": 10,
    }
    recipe = _recipe(tmp_path, lm, data)
    for stage in ("ingest", "sft"):  # TINY's, built once per session
        run_shared(stage, recipe, shared_parents)
    run_inprocess("dpo", recipe)
    ours = logging.getLogger("posttrain.evaluate")
    level = ours.level
    ev = run_inprocess("evaluate", recipe)
    assert ours.level == level

    report = json.loads((ev / "eval.json").read_text())
    block = report["lm_eval"]
    assert block["harness_version"] and block["tasks"] == [TASK] and block["limit"] == 8
    by = block["policies"]
    assert {k: (v["stage"], v["kind"]) for k, v in by.items()} == {
        "base": ("ingest", "base"),
        "sft": ("sft", "sft"),
        "final": ("dpo", "dpo"),
    }
    for row in by.values():
        assert row["n_samples"] == {TASK: 8}
        assert row["seconds"] > 0
        # The harness's closed-form stderr of a mean: sqrt(p (1 - p) / (n - 1)).
        p = row["scores"][TASK]["acc"]
        assert row["stderr"][TASK]["acc"] == pytest.approx((p * (1 - p) / 7) ** 0.5)
        assert set(row["stderr"][TASK]) == {"acc", "acc_norm"}
        assert set(row["scores"][TASK]) == {"acc", "acc_norm"}
        assert all(0.0 <= v <= 1.0 for v in row["scores"][TASK].values())
    head = json.loads((ev / "manifest.json").read_text())["summary"]["headline"]
    final_acc = by["final"]["scores"][TASK]["acc"]
    assert head[METRIC] == round(final_acc, 4)
    assert head[f"lm_eval/{TASK}/acc_norm"] == round(by["final"]["scores"][TASK]["acc_norm"], 4)

    # Each policy's scores are those of its own merged weights, and reproducible: the harness
    # run again outside the stage, on the base and on base + adapter merged, gives the same.
    from peft import PeftModel

    from posttrain.eval.lm_eval_harness import run_tasks, task_manager
    from posttrain.models.loading import load_base
    from tests.fixtures_tiny import one_torch_thread

    dirs = {s.name: s.out_dir for s in plan(load_recipe(recipe)).stages}
    manager = task_manager([TASK], str(tmp_path / "tasks"))
    for label, stage in (("base", "ingest"), ("sft", "sft"), ("final", "dpo")):
        model, tok = load_base(
            dirs["ingest"], json.loads((dirs["ingest"] / "manifest.json").read_text())
        )
        if stage != "ingest":
            model = PeftModel.from_pretrained(model, str(dirs[stage] / "adapter"))
            model = model.merge_and_unload()
        with one_torch_thread():
            again = run_tasks(
                model.eval(),
                tok,
                [TASK],
                manager,
                limit=8,
                num_fewshot=None,
                batch_size=8,
                seed=0,
                bootstrap_iters=10,
            )
        assert again["scores"] == by[label]["scores"], label
        assert again["stderr"] == by[label]["stderr"], label

    # The gate: a rule on the harness score. A champion that scored higher blocks promotion...
    from posttrain.config.schema import PromotionRule

    rule = PromotionRule(metric=METRIC, direction="max", tolerance=0.0)
    ws = tmp_path / "gate"
    champ = {"run_id": "champ", "metrics": {METRIC: final_acc + 0.25}}
    record_decision(ws, "tiny", champ, compare(champ["metrics"], None, [rule]))
    champion = read_registry(ws, "tiny")["champion"]
    worse = compare(head, champion["metrics"], [rule])
    assert not worse.promoted and METRIC in worse.reason and worse.rows[0].regressed
    assert worse.rows[0].candidate == head[METRIC]
    # ... and one that scored lower does not (nor does a tie within the tolerance).
    better = compare(head, {METRIC: final_acc - 0.25}, [rule])
    assert better.promoted and not better.rows[0].regressed
    within = compare(
        head,
        {METRIC: final_acc + 0.1},
        [PromotionRule(metric=METRIC, direction="max", tolerance=0.125)],
    )
    assert within.promoted
