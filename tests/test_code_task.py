"""The code demo's generated task (posttrain.data.code_tasks): every reference program passes its
own tests through the code verifier and wrong ones fail them, RL prompts are combinations SFT and
the warm-up corpus never hold, rows are seeded; the code corpus reaches the from-config
tokenizer; and recipes/code.yaml run end to end, shrunk (slow)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from stage_helpers import run_inprocess

from posttrain.data.code_tasks import (
    OPS,
    all_specs,
    code_corpus,
    code_prompts,
    code_sft_rows,
)
from posttrain.data.prompts import PROMPT_TASKS
from posttrain.kinds.ingest import IngestConfig
from posttrain.rewards import code, counters
from posttrain.rewards.code import code_tests
from posttrain.stages.ingest import from_config_tokenizer
from posttrain.telemetry.records import read_metrics

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_cache():
    code._cache.clear()
    counters.take(0)
    yield


def _verify(programs: list[str], tests: list[list[str]]) -> list[float | None]:
    replies = [f"```python\n{p}```" for p in programs]
    return code_tests([[]] * len(replies), replies, sandbox="none", timeout_s=5, test_list=tests)


def test_every_reference_program_passes_its_tests_and_wrong_ones_fail() -> None:
    # One spec of each operation, each with three asserts the reference program passes.
    specs = list({s.op: s for s in all_specs()}.values())
    assert {s.op for s in specs} == set(OPS)
    tests = [s.tests() for s in specs]
    assert all(
        len(t) == 3 and all(a.startswith(f"assert {s.name}(") for a in t)
        for s, t in zip(specs, tests, strict=True)
    )
    assert _verify([s.program() for s in specs], tests) == [1.0] * len(specs)
    # A program of the right name that returns nothing fails every test of every operation.
    nothing = [f"def {s.name}({', '.join(s.args)}):\n    return None\n" for s in specs]
    assert _verify(nothing, tests) == [0.0] * len(specs)
    # The constant off by one: at least one of the three asserts tells it apart.
    const = [s for s in specs if s.k is not None]
    wrong = [s.program().replace(f" {s.k}\n", f" {s.k + 1}\n") for s in const]
    assert all(w != s.program() for w, s in zip(wrong, const, strict=True))
    assert all(v < 1.0 for v in _verify(wrong, [s.tests() for s in const]))


def test_the_rows_say_what_users_see() -> None:
    row = code_sft_rows(1, 0)[0]
    user, reply = row["messages"]
    assert user["content"].startswith("Write a function ") and user["content"].endswith(".")
    assert reply["content"].startswith("```python\ndef ") and reply["content"].endswith("\n```")
    prompt = code_prompts(1, 0)[0]
    assert [m["role"] for m in prompt["messages"]] == ["user"]
    assert set(prompt["columns"]) == {"test_list", "task"} and prompt["columns"]["task"] == "code"
    assert PROMPT_TASKS["code"] is code_prompts


def test_rl_prompts_are_combinations_sft_and_the_corpus_never_hold() -> None:
    sft = {r["messages"][0]["content"] for r in code_sft_rows(5000, 1)}
    corpus = {doc.split("\n")[0] for doc in code_corpus(5000, 2)}
    prompts = [r["messages"][0]["content"] for r in code_prompts(1000, 3)]
    assert len(prompts) == len(set(prompts))  # distinct: no RL prompt is also a held-out one
    assert not set(prompts) & (sft | corpus)
    # ... each made of parts SFT saw: every operation, name, argument and constant.
    words = {w for p in sft for w in re.findall(r"\w+", p)}
    assert all(set(re.findall(r"\w+", p)) <= words for p in prompts)
    assert 300 <= len(prompts) < 1000  # all the fresh specs there are
    assert {s.op for s in all_specs() if s.fresh} == set(OPS)


def test_rows_are_deterministic_in_the_seed() -> None:
    assert code_sft_rows(50, 7) == code_sft_rows(50, 7) != code_sft_rows(50, 8)
    assert code_prompts(50, 7) == code_prompts(50, 7) != code_prompts(50, 8)
    assert code_corpus(20, 7) == code_corpus(20, 7)
    spec = all_specs()[0]
    assert spec.tests() == spec.tests()


def test_the_code_corpus_gives_code_its_own_tokens() -> None:
    def tokenizer(task: str):
        fc = IngestConfig(
            source="from_config",
            from_config={"vocab_size": 400, "corpus_examples": 400, "corpus_task": task},
        ).from_config
        return from_config_tokenizer(fc, 0)[0]

    program = "```python\ndef solve(x):\n    return x + 5\n```"
    coded, plain = tokenizer("code"), tokenizer("quickstart")
    ids = coded(program, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(plain(program, add_special_tokens=False)["input_ids"])
    assert {"```", "def", "Ġsolve", "ĊĠĠĠ", "Ġreturn"} <= set(coded.convert_ids_to_tokens(ids))


def _bwrap_or_skip() -> None:
    """The recipe's verifier runs in bubblewrap: skipped where it cannot run, failed instead
    under POSTTRAIN_REQUIRE_BWRAP=1 (as tests/test_sandbox.py)."""
    import os

    if (reason := code.unavailable()) is not None:
        if os.environ.get("POSTTRAIN_REQUIRE_BWRAP") == "1":
            pytest.fail(f"{reason} [POSTTRAIN_REQUIRE_BWRAP=1]", pytrace=False)
        pytest.skip(reason)


@pytest.mark.slow
def test_the_code_recipe_runs_shrunk(tmp_path: Path) -> None:
    """recipes/code.yaml as shipped (bubblewrap included), a few steps of each stage: GRPO's
    step and held-out records count the programs run and the verifier's seconds, and evaluate's
    verifier report has greedy pass@1 for the base, SFT and GRPO and pass@k for GRPO."""
    _bwrap_or_skip()
    data = yaml.safe_load((ROOT / "recipes" / "code.yaml").read_text())
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"]["device"] = "cpu"
    data["ingest"]["from_config"] |= {"pretrain_steps": 60, "corpus_examples": 400}
    data["sft"]["data"]["synthetic"]["n_examples"] = 400
    data["sft"] |= {"max_steps": 20, "checkpoint_every": 0}
    grpo = data["grpo"]
    grpo["data"]["synthetic"]["n_examples"] = 40
    grpo["rollout"] |= {"prompts_per_step": 2, "samples_per_prompt": 4}
    grpo |= {"max_steps": 2, "checkpoint_every": 0, "eval_prompts": 4, "max_kl": None}
    grpo["batch"] = {"micro_batch_size": 8, "grad_accum_steps": 1}
    data["evaluate"] |= {"pass_prompts": 4, "pass_samples": 2, "pass_k": 2, "num_prompts": 2}
    data.pop("export")
    recipe = tmp_path / "code.yaml"
    recipe.write_text(yaml.safe_dump(data))
    for stage in ("ingest", "sft"):
        run_inprocess(stage, recipe)
    out = run_inprocess("grpo", recipe)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 2
    for record in train:
        # 2 prompts x 4 samples x 3 asserts at most (a reply without a program runs nothing)
        assert 0 <= record["code_runs"] + record["code_cache_hits"] <= 24, record
        assert record["code_errors"] <= record["code_runs"]
        assert record["code_timeouts"] == 0 and record["code_sandbox_failures"] == 0
        assert 0 < record["reward_fn_s"] <= record["scoring_s"]
        assert "reward_fn_code_tests" in record
    held = {k: v for r in read_metrics(out / "metrics.jsonl", "eval") for k, v in r.items()}
    assert {"eval_code_runs", "eval_reward_fn_s", "sft_code_runs"} <= set(held)
    ev = run_inprocess("evaluate", recipe)
    v = json.loads((ev / "eval.json").read_text())["verifier"]
    assert set(v["policies"]) == {"ingest", "sft", "grpo"} and v["sampled"] == ["grpo"]
    for name, m in v["policies"].items():
        assert m["prompts"] == 4 and 0.0 <= m["pass@1"] <= 1.0
        assert ("pass@2" in m) == (name == "grpo")
    samples = [json.loads(x) for x in (ev / "verify_samples.jsonl").read_text().splitlines()]
    assert all(s["test_list"] and s["prompt"][-1]["content"].startswith("Write a") for s in samples)
