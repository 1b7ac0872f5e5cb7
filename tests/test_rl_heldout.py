"""Step 5 of online RL (posttrain.rl.heldout): the held-out sums and means and the
quality gate by hand; on a tiny real model, the samples each policy is judged on (the same
prompts under the same seeds for the policy and the starting policy) and what `evaluate`
writes."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from fixtures_tiny import TinyAssets, one_torch_thread, tiny_assets
from rl_tiny import prompt_rows, role_model, rollout_setup, section

from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.rl.heldout import (
    evaluate,
    heldout,
    heldout_means,
    quality_gate,
)
from posttrain.rl.metrics import add_rollout_sums
from posttrain.rl.rollout.sample import decode_responses, sample
from posttrain.telemetry.metrics import MetricsWriter
from posttrain.telemetry.records import read_metrics
from tests.test_rl_losses import _rollout

L2 = math.log(2)


def test_heldout_sums_and_means_by_hand() -> None:
    # Responses of 3 and 2 tokens (the first stopped), rewards 1 and 3, KL (k1) log 2 each; a
    # function `exact` applicable to the first only.
    ro = _rollout([1.0, 3.0], [True, False])
    ro.scored["fn:exact"] = torch.tensor([1.0, math.nan])
    filler = _rollout([50.0, 70.0], [False, False])  # a rank out of prompts: weight 0
    filler.scored["fn:exact"] = torch.tensor([9.0, 9.0])
    sums: Counter[str] = Counter()
    add_rollout_sums(sums, ro, kl="k1", weight=1.0)
    add_rollout_sums(sums, filler, kl="k1", weight=0.0)
    means = heldout_means(sums, torch.device("cpu"), kl=True)
    assert means == {
        "reward": 2.0,
        "reward_std": 1.0,  # sqrt((1 + 9) / 2 - 2 ** 2)
        "response_len": 2.5,
        "stop_rate": 0.5,
        "prompts": 2.0,
        "kl": pytest.approx(L2),
        "reward_fn_exact": 1.0,
    }
    sums = Counter()
    add_rollout_sums(sums, ro, kl=None, weight=1.0)  # the starting policy: no KL to itself
    assert "kl" not in sums and "kl" not in heldout_means(sums, torch.device("cpu"), kl=False)


def test_heldout_kl_is_the_recipe_s_estimator_and_the_gate_reads_it() -> None:
    # The policy less likely than the reference on the tokens it sampled: per-token log-ratio
    # log p - log ref of -log 2 on response 1's first token and response 2's second, 0
    # elsewhere. k1 sums to -log 2 per response (negative, as a user saw in `eval_kl`); k3,
    # exp(log 2) - 1 - log 2 per such token, to 1 - log 2 (>= 0).
    ro = _rollout([1.0, 3.0], [True, False])
    ro.scored["logps"], ro.scored["ref_logps"] = ro.scored["ref_logps"], ro.scored["logps"]
    cfg = section("grpo", max_kl=0.25)  # GRPO's estimator: k3
    assert cfg.kl.estimator == "k3"
    by = {}
    for estimator in ("k1", cfg.kl.estimator):
        sums: Counter[str] = Counter()
        add_rollout_sums(sums, ro, kl=estimator)
        by[estimator] = heldout_means(sums, torch.device("cpu"), kl=True)["kl"]
    assert by["k3"] == pytest.approx(1 - L2) and by["k3"] >= 0
    assert by["k1"] == pytest.approx(-L2)
    # Gated on k3: 0.307 is over max_kl 0.25, where k1's -0.693 would have passed.
    gate = quality_gate(cfg, {"reward": 2.0, "kl": by["k3"]}, {"reward": 1.0})
    assert gate == {"passed": False, "message": "held-out KL (k3) 0.307 exceeds max_kl 0.25"}
    assert quality_gate(cfg, {"reward": 2.0, "kl": by["k1"]}, {"reward": 1.0})["passed"]


def test_quality_gate_by_hand() -> None:
    cfg = SimpleNamespace(max_kl=1.0, min_reward_gain=0.5, kl=SimpleNamespace(estimator="k1"))
    sft = {"reward": 1.0}
    assert quality_gate(cfg, {"reward": 1.5, "kl": 1.0}, sft) == {"passed": True}
    gate = quality_gate(cfg, {"reward": 1.25, "kl": 1.5}, sft)
    assert gate["passed"] is False
    assert gate["message"] == (
        "held-out KL (k1) 1.500 exceeds max_kl 1.0; held-out reward gain 0.2500 over the "
        "starting policy is below min_reward_gain 0.5"
    )
    off = SimpleNamespace(max_kl=None, min_reward_gain=None)
    assert quality_gate(off, {"reward": -9.0, "kl": 99.0}, sft) == {"passed": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyAssets:
    return tiny_assets(tmp_path_factory)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


def _setup(tiny: TinyAssets):
    cfg = section(
        "grpo", rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 6}
    )
    # Sampling batches of 4: 6 prompts are batches [0..3] and [4, 5], seeds 3 + 0 and 3 + 4.
    return rollout_setup(role_model(tiny, critic=False), tiny.tokenizer, cfg, "length", 4)


def test_heldout_samples_each_prompt_batch_with_its_seed_and_scores_it(tiny) -> None:
    s, rows = _setup(tiny), prompt_rows(tiny.tokenizer, 6)
    means, examples = heldout(s, rows, POLICY)
    want = []
    for first, batch in ((0, rows[:4]), (4, rows[4:])):
        ro = sample(
            s.engines[POLICY],
            [r["ids"] for r in batch],
            [r["messages"] for r in batch],
            s.cfg.rollout,
            tiny.tokenizer.pad_token_id,
            s.stop_ids,
            3 + first,
        )
        texts, lengths = decode_responses(tiny.tokenizer, ro), ro.mask.sum(1).tolist()
        want += list(zip(texts, lengths, strict=True))
    assert [(e["response"], e["reward"]) for e in examples] == want
    assert [e["prompt"] for e in examples] == [r["messages"] for r in rows]
    assert all(e["reward_length"] == e["reward"] for e in examples)
    assert [(e["answer"], e["task"]) for e in examples] == [
        (r["columns"]["answer"], r["columns"]["task"]) for r in rows
    ]
    assert means["prompts"] == 6.0
    # `length` counts each response's tokens: its mean reward is the mean response length.
    assert means["reward"] == pytest.approx(sum(w[1] for w in want) / 6)
    assert means["reward"] == pytest.approx(means["response_len"])
    assert means["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference


def _untimed(figures: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in figures.items() if k != "reward_fn_s"}


def test_evaluate_judges_the_starting_policy_once_on_the_same_samples(
    tiny, tmp_path, caplog
) -> None:
    s, rows = _setup(tiny), prompt_rows(tiny.tokenizer, 6)
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    samples = tmp_path / "eval_samples.jsonl"
    with caplog.at_level(logging.INFO, logger="posttrain.rl"):
        pol, sft = evaluate(s, rows, 2, None, metrics, samples)
    # The log line names the estimator (GRPO's k3) the KL figure is measured by.
    assert "), KL (k3) to the reference 0.000" in caplog.text
    # Equal but for the seconds spent in the reward functions (`reward_fn_s`, measured).
    assert _untimed(sft) == _untimed(heldout(s, rows, REFERENCE)[0]) and "kl" not in sft
    # The policy starts as the reference, and both sample the same prompts with the same seeds.
    assert pol["reward"] == sft["reward"] and pol["reward_gain"] == 0.0
    again, sft_again = evaluate(s, rows, 4, sft, metrics, None)
    assert sft_again is sft and _untimed(again) == _untimed(pol)
    metrics.close()
    records = read_metrics(tmp_path / "metrics.jsonl", "eval")
    assert [r["step"] for r in records] == [2, 2, 4]  # sft once, then the policy at each call
    assert {k for k in records[0] if k.startswith("sft_")} == {f"sft_{k}" for k in sft}
    assert records[1]["eval_reward_gain"] == 0.0 and records[2]["eval_reward"] == pol["reward"]
    lines = [json.loads(x) for x in samples.read_text().splitlines()]
    assert len(lines) == 6 and {"prompt", "response", "reward", "reward_length"} <= set(lines[0])
