"""GRPO under sequence parallelism trains as on one rank: 2 ranks splitting every scoring and
update forward's packed rows (`infra.sequence_parallel: 2`, one data-parallel group: the same
prompts dealt, the same samples drawn with the same seed) give the per-step loss and rewards
of one rank to 1e-5 and its trained adapter to 5e-5, through the policy's and the reference's
scoring passes (or the update's own log-probs) and the held-out samples. A torchrun of 2 ranks
on two CPU cores: slow tier."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import (
    TINY,
    planned_dir,
    run_inprocess,
    run_shared,
    run_torchrun,
    write_recipe,
)

pytestmark = pytest.mark.slow

RECIPE = {k: copy.deepcopy(v) for k, v in TINY.items() if k != "evaluate"}
RECIPE["grpo"] = {
    "data": {
        "synthetic": {"n_examples": 40, "seed": 7},
        "eval_fraction": 0.1,
        "max_prompt_len": 40,
    },
    "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}],
    "optim": {"lr": 5e-3},
    # 8 sequences per rollout, 4 per update: two updates, so the policy's scoring pass runs.
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 1, "padding_free": True},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
    "kl": {"coef": 0.05},
    "max_steps": 2,
    "checkpoint_every": 0,
    "eval_prompts": 4,
}
SP = ("infra.devices_per_node=2", "infra.sequence_parallel=2")


def adapter(folder: Path) -> dict:
    return load_file(folder / "adapter" / "adapter_model.safetensors")


@pytest.mark.parametrize("accum", [1, 2], ids=["policy-scored", "own-logps"])
def test_grpo_sequence_parallel_matches_one_rank(
    tmp_path: Path, shared_parents: Path, accum: int
) -> None:
    """accum 1: two updates per rollout, so the policy's scoring pass runs; accum 2: one
    update, whose own log-probs (summed over the group) are the old ones."""
    data = copy.deepcopy(RECIPE)
    data["grpo"]["batch"]["grad_accum_steps"] = accum
    recipe = write_recipe(tmp_path, data)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    one = run_inprocess("grpo", recipe)
    one_train = read_metrics(one / "metrics.jsonl", "train")
    one_eval = read_metrics(one / "metrics.jsonl", "eval")
    one_adapter = adapter(one)
    assert planned_dir("grpo", recipe, *SP) == one
    shutil.rmtree(one)
    proc = run_torchrun("grpo", recipe, 2, *SP)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "sequence parallel: 2 ranks per group, 1 data-parallel group" in proc.stdout + proc.stderr
    )
    assert read_metrics(one / "metrics.jsonl", "start")[0]["world_size"] == 2
    two_train = read_metrics(one / "metrics.jsonl", "train")
    assert len(two_train) == len(one_train) == 2
    for a, b in zip(one_train, two_train, strict=True):
        for k in ("loss", "score_mean", "score_std", "kl", "response_len", "entropy"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])
        assert b["tokens"] == a["tokens"]  # the group's rows counted once
    two_adapter = adapter(one)
    assert two_adapter.keys() == one_adapter.keys()
    worst = max((two_adapter[k] - one_adapter[k]).abs().max().item() for k in one_adapter)
    assert worst < 5e-5, worst
    two_eval = read_metrics(one / "metrics.jsonl", "eval")
    assert len(two_eval) == len(one_eval)
    for a, b in zip(one_eval, two_eval, strict=True):
        for k in (k for k in a if k.endswith(("reward", "kl", "prompts"))):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
