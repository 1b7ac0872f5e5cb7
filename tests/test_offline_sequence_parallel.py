"""The offline stages beside DPO under sequence parallelism train as on one rank: 2 ranks
splitting every micro-batch's tokens (`infra.sequence_parallel: 2`, one data-parallel group, so
the same global batch) give the per-step loss to 1e-5, the trained adapter to 5e-5 per element
and the held-out figures of one rank. About a minute a stage on two CPU cores (a torchrun of 2
ranks): slow tier."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests import sp_compare
from tests.stage_helpers import (
    TINY,
    run_inprocess,
    run_shared,
    write_recipe,
)

pytestmark = pytest.mark.slow

PAIRS = {"eval_fraction": 0.2, "max_seq_len": 64, "max_prompt_len": 40}
STEP = {
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 2},
    "max_steps": 3,
    "checkpoint_every": 0,
}


def recipe_with(tmp_path: Path, kind: str, section: dict) -> Path:
    data = {k: copy.deepcopy(v) for k, v in TINY.items() if k != "evaluate"}
    data[kind] = {**copy.deepcopy(STEP), **section}
    return write_recipe(tmp_path, data)


def one_then_two(
    kind: str, recipe: Path, eval_keys: tuple[str, ...], files: tuple[str, ...]
) -> tuple[list[dict], list[dict]]:
    """Run `kind` on 1 rank, then on 2 ranks at N = 2 in the same folder; assert the per-step
    losses, the trained `files` (under the stage folder) and the held-out `eval_keys` agree. Returns
    both runs' train records for the caller's own checks."""
    runs = sp_compare.one_then_two(kind, recipe, files)
    assert len(runs.two_train) == len(runs.one_train) == 3
    for a, b in zip(runs.one_train, runs.two_train, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        # Each rank counts its shards' tokens: the world's are the rows' (+ a padding token).
        assert b["tokens"] == a["tokens"] and 0 <= b["padding_frac"] < 0.01
    assert (worst := runs.worst_weight_gap()) < 5e-5, worst
    assert len(runs.two_eval) == len(runs.one_eval) == 2
    for a, b in zip(runs.one_eval, runs.two_eval, strict=True):
        for k in eval_keys:
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
    return runs.one_train, runs.two_train


def test_orpo_sequence_parallel_matches_one_rank(tmp_path: Path, shared_parents: Path) -> None:
    recipe = recipe_with(
        tmp_path,
        "orpo",
        {
            "data": {**PAIRS, "synthetic": {"n_examples": 60, "seed": 5}},
            "beta": 1.0,
            "optim": {"lr": 2e-3},
        },
    )
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    one, two = one_then_two(
        "orpo",
        recipe,
        ("eval_accuracy", "eval_margin", "eval_loss", "eval_nll"),
        ("adapter/adapter_model.safetensors",),
    )
    for a, b in zip(one, two, strict=True):
        # The NLL term and the rows' log-probs: the group's sums, counted once.
        assert b["nll"] == pytest.approx(a["nll"], abs=1e-5)
        assert b["policy_chosen_logps"] == pytest.approx(a["policy_chosen_logps"], abs=1e-4)


def test_kto_sequence_parallel_matches_one_rank(tmp_path: Path, shared_parents: Path) -> None:
    # The reference is SFT trained 6 steps further, the policy SFT itself: at the first step the
    # policy's log-probs of the mismatched completions lie above the reference's (the further
    # trained model ties completions to their own prompts), so z0 is off its clamp at 0 there
    # and its sum and count over the groups are tested (it then falls back to 0).
    data = {k: copy.deepcopy(v) for k, v in TINY.items() if k != "evaluate"}
    more = {**copy.deepcopy(TINY["sft"]), "max_steps": 6, "optim": {"lr": 1e-2}}
    kto = {"data": {**PAIRS, "synthetic": {"n_examples": 60, "seed": 5}}, "optim": {"lr": 2e-3}}
    data["stages"] = [
        {"kind": "sft", "name": "sft_more", "from": "sft", **more},
        {"kind": "kto", "name": "kto", "from": "sft", "reference": "sft_more", **STEP, **kto},
    ]
    recipe = write_recipe(tmp_path, data)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    run_inprocess("sft", recipe, name="sft_more")
    one, two = one_then_two(
        "kto",
        recipe,
        ("eval_loss", "eval_margin", "eval_kl", "eval_pair_accuracy"),
        ("adapter/adapter_model.safetensors",),
    )
    for a, b in zip(one, two, strict=True):
        # z0 from the mismatched partners' shards, and the rows counted once per group.
        assert b["kl"] == pytest.approx(a["kl"], abs=1e-5)
        assert b["margin"] == pytest.approx(a["margin"], abs=1e-5)
        assert (b["n_desirable"], b["n_undesirable"]) == (a["n_desirable"], a["n_undesirable"])
    assert two[0]["kl"] > 0.005, [r["kl"] for r in two]


def test_reward_sequence_parallel_matches_one_rank(tmp_path: Path, shared_parents: Path) -> None:
    section = {
        "data": {**PAIRS, "synthetic": {"n_examples": 60, "seed": 5}},
        "lora": {"r": 8, "alpha": 16},
        "optim": {"lr": 1e-2},
    }
    recipe = recipe_with(tmp_path, "reward", section)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    one, two = one_then_two(
        "reward",
        recipe,
        ("eval_accuracy", "eval_margin", "eval_loss", "eval_chosen_mean", "eval_rejected_std"),
        ("adapter/adapter_model.safetensors",),  # the LoRA and the score head
    )
    for a, b in zip(one, two, strict=True):
        # Each row's score read on the rank holding its last token, counted once per group.
        assert b["reward_chosen"] == pytest.approx(a["reward_chosen"], abs=1e-5)
        assert b["margin"] == pytest.approx(a["margin"], abs=1e-5)
