"""RL with verifiable rewards on a tiny model: GRPO and PPO scored by reward functions alone (no
reward model), a misbehaving function failing the stage by name, and evaluate's pass@k."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import TINY, planned_dir, run_inprocess, run_shared, write_recipe

pytestmark = pytest.mark.slow

REWARDS = """
import re


def _norm(s):
    return re.sub(r"\\s+", " ", str(s).strip().casefold()).rstrip(".")


def exact(prompts, completions, answer=None, **kwargs):
    return [
        None if a is None else float(_norm(c[0]["content"]) == _norm(a))
        for c, a in zip(completions, answer)
    ]


def longish(prompts, completions, completion_ids, **kwargs):
    return [min(len(ids), 8) / 8 for ids in completion_ids]


def boom(prompts, completions, task=None, **kwargs):
    if any(t != "count" for t in task):  # a bug only some rows trigger
        raise KeyError("only counting here")
    return [0.0] * len(completions)


def short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)
"""
GRPO = {
    "data": {
        "synthetic": {"n_examples": 120, "seed": 7},
        "eval_fraction": 0.1,
        "max_prompt_len": 40,
    },
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 12},
    "optim": {"lr": 5e-3},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "max_steps": 4,
    "checkpoint_every": 0,
    "eval_prompts": 8,
    # A longish-answer bonus every response can earn: the reward moves even for a tiny model.
    "rewards": [{"fn": "qs_rewards:exact"}, {"fn": "qs_rewards:longish", "weight": 0.5}],
}


@pytest.fixture(scope="module")
def parents(tmp_path_factory, shared_parents: Path) -> dict:
    folder = tmp_path_factory.mktemp("vrl")
    (folder / "qs_rewards.py").write_text(REWARDS)
    data = copy.deepcopy(TINY)
    data["evaluate"] |= {"pass_prompts": 6, "pass_k": 2, "pass_samples": 3, "policies": ["sft"]}
    data["evaluate"]["pass_sampling"] = {
        "name": "pass@k",
        "strategy": "sample",
        "max_new_tokens": 12,
    }
    recipe = write_recipe(folder, data)
    out = {"folder": folder, "recipe": recipe, "data": data}
    for stage in ("ingest", "sft"):  # TINY's, built once per session
        out[stage] = run_shared(stage, recipe, shared_parents)
    return out


def recipe_with(parents: dict, tag: str, **sections: dict) -> Path:
    data = copy.deepcopy(parents["data"]) | sections
    data["run"]["workspace"] = str(parents["folder"] / "ws")
    path = parents["folder"] / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def summary(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["summary"]


def test_grpo_with_reward_functions_only_then_pass_at_k(parents) -> None:
    recipe = recipe_with(parents, "grpo", grpo=GRPO)
    out = run_inprocess("grpo", recipe)
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["roles"] == "policy,reference" and start["reward_functions"] == "exact,longish"
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 4
    for row in train:
        assert 0.0 <= row["reward_fn_exact"] <= 1.0 and 0.0 < row["reward_fn_longish"] <= 1.0
        # The summed reward is the weighted sum of the two means (every row applicable).
        assert row["score_mean"] == pytest.approx(
            row["reward_fn_exact"] + 0.5 * row["reward_fn_longish"], abs=1e-5
        )
    s = summary(out)
    assert {"reward_fn_exact", "reward_fn_longish"} <= set(s["eval_final"])
    assert {"reward_fn_exact", "reward_fn_longish"} <= set(s["eval_sft"])
    held = [json.loads(x) for x in (out / "data" / "eval.jsonl").read_text().splitlines()]
    assert held and all({"prompt", "answer", "task"} <= set(r) for r in held)
    ref = json.loads((out / "reference.json").read_text())
    assert "reward_model" not in ref
    assert [f["label"] for f in ref["reward_functions"]] == ["exact", "longish"]
    assert all(len(f["sha256"]) == 64 for f in ref["reward_functions"])
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert {"reward_exact", "reward_longish", "answer"} <= set(samples[0])

    ev = run_inprocess("evaluate", recipe)
    report = json.loads((ev / "eval.json").read_text())
    v = report["verifier"]
    assert [f["label"] for f in v["verifiers"]] == ["exact"]  # the first function by default
    assert v["k"] == 2 and v["samples"] == 3 and v["source"] == "grpo held-out prompts"
    assert set(v["policies"]) == {"ingest", "sft", "grpo"}
    # Every policy compared gets the greedy pass@1; by default (evaluate.pass_k_policies: final)
    # only the final policy is sampled, and the others hold no pass@k at all.
    assert v["sampled"] == ["grpo"]
    for name, m in v["policies"].items():
        assert m["prompts"] == min(6, len(held)) and 0.0 <= m["pass@1"] <= 1.0
        assert ("pass@2" in m) == ("sampled_pass@1" in m) == (name == "grpo")
        assert "failures" not in m  # a verifier that runs no code: no failure reasons
    g = v["policies"]["grpo"]
    assert 0.0 <= g["sampled_pass@1"] <= g["pass@2"] <= 1.0
    head = summary(ev)["headline"]
    assert head["pass@1"] == round(v["policies"]["grpo"]["pass@1"], 4)
    assert {"pass@2", "pass@1_parent", "pass@1_base"} <= set(head)
    lines = (ev / "verify_samples.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert len(lines) == min(6, len(held)) and {"passed", "response", "answer"} <= set(first)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            "boom",
            r"grpo\.rewards\.0\.fn qs_rewards\.py:boom raised KeyError\('only counting "
            r"here'\) on row \d+ \(synthetic row \d+\): prompt '(?!How many words).*; the "
            r"row's columns are: answer, task \(beside prompts",
        ),
        ("short", r"grpo\.rewards\.0\.fn qs_rewards\.py:short returned 15 values for 16 rows"),
    ],
)
def test_a_misbehaving_function_fails_the_stage_naming_it(parents, fn, message, capfd) -> None:
    section = {**GRPO, "max_steps": 2, "rewards": [{"fn": f"qs_rewards:{fn}"}]}
    recipe = recipe_with(parents, fn, grpo=section)
    with pytest.raises(SystemExit) as exc:
        run_inprocess("grpo", recipe)
    assert exc.value.code == 1
    # One line naming the function and the row, no traceback wall (that is in error.txt).
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"POSTTRAIN_ERROR stage grpo failed: RewardFunctionError: " + message, err)
    logged = (planned_dir("grpo", recipe) / "logs" / "error.txt").read_text()
    assert re.search(message, logged) and "Traceback" in logged


def test_ppo_with_reward_functions_and_no_reward_model(parents) -> None:
    ppo = {k: v for k, v in GRPO.items() if k != "rollout"}
    ppo["rollout"] = {"prompts_per_step": 8, "max_new_tokens": 12}
    out = run_inprocess("ppo", recipe_with(parents, "ppo", ppo=ppo))
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert start["roles"] == "policy,reference,value"
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 4 and all(r["value_loss"] >= 0 for r in train)
    assert (out / "critic" / "critic.safetensors").exists()


def test_dapo_dynamic_sampling_refills_groups_that_all_score_the_same(parents) -> None:
    """Exact-match rewards are 0 for most samples of a tiny model: many groups carry no signal.
    DAPO drops them and samples more prompts (up to 3 rounds), topping up with dropped groups
    only when the rounds run out; the batch keeps its shape either way."""
    section = {
        **GRPO,
        "algorithm": "dapo",
        "max_steps": 3,
        "max_sampling_rounds": 3,
        "rewards": [{"fn": "qs_rewards:exact"}],
    }
    out = run_inprocess("grpo", recipe_with(parents, "dapo", grpo=section))
    assert read_metrics(out / "metrics.jsonl", "start")[0]["kl_placement"] == "loss"
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 3
    for row in train:
        assert 0.0 <= row["informative_frac"] <= 1.0
        assert 1 <= row["sampling_rounds"] <= 3 and row["topped_up_groups"] >= 0
        if row["informative_frac"] == 1.0:
            assert row["sampling_rounds"] == 1 and row["topped_up_groups"] == 0
        else:  # a group was dropped: another round, or the rounds ran out and it was topped up
            assert row["sampling_rounds"] > 1 or row["topped_up_groups"] > 0
        # Kept groups score differently, so unless topped up, the reward varies in the batch.
        if row["topped_up_groups"] == 0:
            assert row["score_std"] > 0


CODE = "posttrain.rewards.code:code_tests"
MBPP_TESTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]
CODE_COUNTERS = ("passed", "wrong_answers", "timeouts", "errors", "sandbox_failures")
# The tiny model writes no fenced block: `whole` runs its replies as programs (they crash or
# fail), `fenced` finds no program at all.
WHOLE = {"fn": CODE, "name": "whole", "kwargs": {"extract": "whole", "sandbox": "none"}}
FENCED = {"fn": CODE, "name": "fenced", "kwargs": {"sandbox": "none", "timeout_s": 2}}
WHOLE["kwargs"]["timeout_s"] = 2
OUTCOMES = ("passed", "wrong_answer", "timeout", "error", "sandbox_failure")


def test_code_verifier_counts_held_out_and_says_why_programs_failed(parents) -> None:
    """GRPO against MBPP-style tests: the held-out metrics hold the code counters; evaluate's
    report says, per policy, how the tests ended and which answers had no program."""
    from flows.report.tables import StageRecord, markdown_report
    from posttrain.store.summary import Summary

    rows = [
        {"prompt": f"Write add(a, b) returning a + b (task {i}).", "test_list": MBPP_TESTS}
        for i in range(16)
    ]
    data_path = parents["folder"] / "mbpp.jsonl"
    data_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = {**GRPO, "max_steps": 2, "rewards": [WHOLE], "eval_prompts": 4}
    section["data"] = {"path": str(data_path), "eval_fraction": 0.25, "max_prompt_len": 40}
    evaluate = parents["data"]["evaluate"] | {"verifiers": [FENCED, WHOLE], "policies": []}
    recipe = recipe_with(parents, "code", grpo=section, evaluate=evaluate)
    out = run_inprocess("grpo", recipe)
    for row in read_metrics(out / "metrics.jsonl", "eval"):
        for who in [w for w in ("eval", "sft") if f"{w}_reward" in row]:
            settled = sum(row[f"{who}_code_{c}"] for c in CODE_COUNTERS)
            # One sample of each of the 4 held-out prompts, 2 tests each: run, or cached (the
            # policy answering as the starting policy did).
            assert settled == row[f"{who}_code_runs"] + row[f"{who}_code_cache_hits"] == 8

    ev = run_inprocess("evaluate", recipe)
    v = json.loads((ev / "eval.json").read_text())["verifier"]
    prompts = v["policies"]["grpo"]["prompts"]
    samples = [json.loads(x) for x in (ev / "verify_samples.jsonl").read_text().splitlines()]
    blocks = sum("```" in s["response"] for s in samples)
    for name, m in v["policies"].items():
        for answers, per_prompt in (("greedy", 1), ("sampled", v["samples"])):
            if answers == "sampled" and name not in v["sampled"]:
                assert "sampled" not in m["failures"]
                continue
            f = m["failures"][answers]
            # `whole` runs every answer's 2 tests; `fenced` finds a block in (almost) none.
            assert f["tests"] == sum(f[o] for o in OUTCOMES) >= 2 * prompts * per_prompt
            assert f["no_program"] <= prompts * per_prompt and len(f["top_errors"]) <= 3
            assert sum(e["count"] for e in f["top_errors"]) <= f["error"]
    greedy = v["policies"]["grpo"]["failures"]["greedy"]
    assert greedy["no_program"] == prompts - blocks

    record = StageRecord("evaluate", "fp", "ran", 1.0, summary=Summary.model_validate(summary(ev)))
    report = markdown_report("r", "id", [record])
    assert "## Why programs failed (`evaluate`)" in report
    cells = [str(greedy[c]) for c in ("tests", *OUTCOMES, "no_program")]
    assert "| grpo | greedy | " + " | ".join(cells) + " |" in report
