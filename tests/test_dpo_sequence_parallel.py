"""DPO under sequence parallelism trains as on one rank: 2 ranks splitting every micro-batch's
tokens (`infra.sequence_parallel: 2`, one data-parallel group, so the same global batch) give
the per-step loss and the trained adapter of one rank to 1e-5, through the precomputed
reference table (its pairs' sums all-reduced over the group, written once) and the held-out
figures. About a minute on two CPU cores (a torchrun of 2 ranks): slow tier."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from tests.sp_compare import in_place, one_then_two
from tests.stage_helpers import (
    TINY,
    run_shared,
    write_recipe,
)

pytestmark = pytest.mark.slow

PAIRS = {"eval_fraction": 0.2, "max_seq_len": 64, "max_prompt_len": 40}
RECIPE = {k: copy.deepcopy(v) for k, v in TINY.items() if k != "evaluate"}
RECIPE["dpo"] = {
    "data": {**PAIRS, "synthetic": {"n_examples": 60, "seed": 5}},
    "optim": {"lr": 2e-3},
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 2},
    "max_steps": 3,
    "checkpoint_every": 0,
    "sft_weight": 0.5,
    "precompute_reference": True,
}


def test_dpo_sequence_parallel_matches_one_rank(tmp_path: Path, shared_parents: Path) -> None:
    recipe = write_recipe(tmp_path, RECIPE)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    runs = one_then_two("dpo", recipe)
    assert len(runs.two_train) == len(runs.one_train) == 3
    for a, b in zip(runs.one_train, runs.two_train, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        # Each rank counts its shards' tokens: the world's are the rows' (+ a padding token).
        assert b["tokens"] == a["tokens"] and 0 <= b["padding_frac"] < 0.01
        assert b["ref_chosen_logps"] == pytest.approx(a["ref_chosen_logps"], abs=1e-4)
    assert (worst := runs.worst_weight_gap()) < 1e-5, worst
    for a, b in zip(runs.one_eval, runs.two_eval, strict=True):
        for k in ("eval_accuracy", "eval_margin", "eval_loss"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
    reference = json.loads((runs.folder / "reference.json").read_text())
    assert reference["precomputed"] == "miss"  # its own table: sums taken in another order


def test_two_by_two_matches_four_data_parallel_ranks(tmp_path: Path, shared_parents: Path) -> None:
    """4 ranks as 2 data-parallel groups x 2 sequence-parallel ranks (micro 2 pairs a group)
    train as 4 data-parallel ranks of micro 1: the same global batch of 2 x 2 x 2 = 1 x 2 x 4 = 8
    pairs, the same losses and adapter. Two steps: 4 ranks on 2 cores."""
    recipe = write_recipe(tmp_path, {**RECIPE, "dpo": {**RECIPE["dpo"], "max_steps": 2}})
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    # The sft parent keeps its global batch of 8 (its fingerprint) on either layout.
    dp4 = (
        "infra.devices_per_node=4",
        "dpo.batch.micro_batch_size=1",
        "sft.batch.micro_batch_size=2",
    )
    dp2_sp2 = (
        "infra.devices_per_node=4",
        "infra.sequence_parallel=2",
        "dpo.batch.micro_batch_size=2",
        "sft.batch.micro_batch_size=4",
    )
    runs = in_place("dpo", recipe, (4, dp4), (4, dp2_sp2))
    assert "sequence parallel: 2 ranks per group, 2 data-parallel groups" in runs.output
    assert len(runs.two_train) == len(runs.one_train) == 2
    for a, b in zip(runs.one_train, runs.two_train, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
        assert b["tokens"] == a["tokens"]
    assert (worst := runs.worst_weight_gap()) < 1e-5, worst
    for a, b in zip(runs.one_eval, runs.two_eval, strict=True):
        for k in ("eval_accuracy", "eval_margin", "eval_loss"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
