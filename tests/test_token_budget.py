"""`batch.by_tokens: auto`: the largest token budget the memory pre-flight says fits
(posttrain.runtime.token_budget), and what it falls back to on CPU."""

from __future__ import annotations

import logging

import pytest

from posttrain.memory.estimate import GIB, Adapter, DeviceLayout, ModelShape, StageShape, estimate
from posttrain.runtime.preflight import Capacity, PreflightReport
from posttrain.runtime.token_budget import (
    ROUND,
    largest_budget,
    resolve_token_budget,
    row_tokens,
    say,
    shape_at,
    sized_report,
)
from posttrain.sections.shared import BatchConfig, RolloutBatchConfig

# Qwen2.5-0.5B's shape, LoRA r16 all-linear, bf16, chunked head: what a GPU SFT runs.
QWEN_05B = ModelShape(896, 24, 14, 2, 64, 4864, 151936, tied=True, qkv_bias=True)
LORA = (Adapter("policy", 16, "all-linear", True),)
SFT = StageShape("lm", 8, 1024, LORA, precision="bf16", base_dtype="bf16", logits_chunk_tokens=1024)
CUDA = DeviceLayout(device="cuda")


def _report(shape: StageShape, layout: DeviceLayout, gib: float, fraction: float = 0.9):
    est = estimate(QWEN_05B, shape, layout)
    cap = Capacity(int(gib * GIB), "test capacity")
    return PreflightReport(
        "sft", est, est, cap, fraction, model=QWEN_05B, shape=shape, layout=layout
    )


def test_the_largest_budget_fits_and_one_step_more_does_not() -> None:
    limit = int(20 * GIB)
    tokens, est = largest_budget(QWEN_05B, SFT, CUDA, limit, step_rows=1024)
    assert tokens % ROUND == 0 and tokens >= 4 * 1024
    assert est == estimate(QWEN_05B, shape_at(SFT, tokens), CUDA).total <= limit
    assert estimate(QWEN_05B, shape_at(SFT, tokens + ROUND), CUDA).total > limit


def test_the_budget_never_exceeds_a_steps_rows() -> None:
    """A budget over all of a rank's rows of a step would change nothing: capped there."""
    tokens, _ = largest_budget(QWEN_05B, SFT, CUDA, int(1000 * GIB), step_rows=4)
    assert tokens == 4 * 1024


def test_a_pair_counts_both_replies() -> None:
    pairs = StageShape("pairs", 4, 512, LORA)
    assert row_tokens(pairs) == 1024
    assert shape_at(pairs, 3000).micro_batch == 3  # ceil(3000 / 1024) pairs
    assert row_tokens(SFT) == 1024 and shape_at(SFT, 1024).micro_batch == 1


def test_auto_on_cuda_takes_the_preflights_budget(caplog) -> None:
    report = _report(SFT, CUDA, 40)
    budget = resolve_token_budget("auto", report, step_rows=1024)
    assert budget.tokens == largest_budget(QWEN_05B, SFT, CUDA, report.budget, 1024)[0]
    record = budget.record()
    assert record["by_tokens"] == budget.tokens and record["by_tokens_asked"] == "auto"
    assert 0 < record["by_tokens_estimate_gib"] <= 0.9 * 40
    assert "estimated peak" in budget.why and "90% of 40.00 GiB" in budget.why
    with caplog.at_level(logging.INFO, logger="posttrain.memory"):
        say(budget)
    assert caplog.messages[0].startswith(f"batch.by_tokens auto = {budget.tokens} tokens a forward")


def test_an_auto_budget_re_estimates_the_preflight_at_that_budget() -> None:
    """The recipe's 64 rows of 1024 tokens do not fit 40 GiB; auto finds a budget that does,
    and the report (verdict, records, the summary's estimate) is the budget's."""
    big = StageShape("lm", 64, 1024, LORA, precision="bf16", base_dtype="bf16")
    report = _report(big, CUDA, 40)
    assert not report.fits
    budget = resolve_token_budget("auto", report, step_rows=64)
    sized = sized_report(report, budget)
    assert sized.fits and sized.estimate.total == budget.estimate_bytes
    assert sized.shape.micro_batch == budget.tokens // 1024
    assert sized.record()["estimate_bytes"] == budget.estimate_bytes
    assert sized_report(report, resolve_token_budget(4096, report, 64)) is report


def test_auto_on_cpu_keeps_the_rows_micro_batches(caplog) -> None:
    budget = resolve_token_budget("auto", _report(SFT, DeviceLayout(), 40, 0.5), 1024)
    assert budget.tokens is None
    with caplog.at_level(logging.INFO, logger="posttrain.memory"):
        say(budget)
    assert caplog.messages == [
        "batch.by_tokens auto: on CPU auto keeps the rows' own micro-batches "
        "(micro_batch_size rows a forward)"
    ]


def test_auto_without_a_preflight_or_room_keeps_the_rows() -> None:
    off = resolve_token_budget("auto", None, 8)
    assert off.tokens is None and off.why.startswith("no memory pre-flight")
    tiny = resolve_token_budget("auto", _report(SFT, CUDA, 0.5), 8)
    assert tiny.tokens is None and tiny.why.startswith(f"not even {ROUND} tokens")


def test_a_number_or_nothing_is_taken_as_given() -> None:
    assert resolve_token_budget(4096, None, 8).record() == {
        "by_tokens": 4096,
        "by_tokens_asked": 4096,
    }
    assert resolve_token_budget(None, None, 8).tokens is None


@pytest.mark.parametrize("cls", [BatchConfig, RolloutBatchConfig])
def test_the_field_takes_a_number_auto_or_nothing(cls) -> None:
    assert cls(by_tokens="auto").by_tokens == "auto"
    assert cls(by_tokens=2048).by_tokens == 2048
    assert cls().by_tokens is None
    for bad in (0, "most"):
        with pytest.raises(ValueError, match="by_tokens"):
            cls(by_tokens=bad)
