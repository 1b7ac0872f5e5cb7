"""GRPO and PPO under sequence parallelism train as on one rank: 2 ranks splitting every scoring and
update forward's packed rows (`infra.sequence_parallel: 2`, one data-parallel group: the same
prompts dealt, the same samples drawn with the same seed) give the per-step loss and rewards
of one rank to 1e-5 and its trained adapter to 5e-5, through the policy's and the reference's
scoring passes (or the update's own log-probs) and the held-out samples; PPO's critic too (its
values in the scoring pass and its value loss in the update, its trained adapter and head). A
torchrun of 2 ranks on two CPU cores: slow tier."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from posttrain.telemetry.records import read_metrics
from tests.sp_compare import one_then_two
from tests.stage_helpers import (
    TINY,
    run_shared,
    write_recipe,
)
from tests.test_preference_stages import PREF

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


@pytest.mark.parametrize(
    ("accum", "engine"),
    [(1, "hf"), (2, "hf"), (1, "fast")],
    ids=["policy-scored", "own-logps", "fast-engine"],
)
def test_grpo_sequence_parallel_matches_one_rank(
    tmp_path: Path, shared_parents: Path, accum: int, engine: str
) -> None:
    """accum 1: two updates per rollout, so the policy's scoring pass runs; accum 2: one
    update, whose own log-probs (summed over the group) are the old ones. The `fast` engine
    samples on the group's first rank only, from its merged copy."""
    data = copy.deepcopy(RECIPE)
    data["grpo"]["batch"]["grad_accum_steps"] = accum
    data["grpo"]["rollout"]["engine"] = engine
    recipe = write_recipe(tmp_path, data)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    runs = one_then_two("grpo", recipe)
    assert "sequence parallel: 2 ranks per group, 1 data-parallel group" in runs.output
    assert (f"rollout engine {engine}:" in runs.output) == (engine == "fast")
    assert read_metrics(runs.folder / "metrics.jsonl", "start")[0]["world_size"] == 2
    assert len(runs.two_train) == len(runs.one_train) == 2
    for a, b in zip(runs.one_train, runs.two_train, strict=True):
        for k in ("loss", "score_mean", "score_std", "kl", "response_len", "entropy"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])
        assert b["tokens"] == a["tokens"]  # the group's rows counted once
    assert (worst := runs.worst_weight_gap()) < 5e-5, worst
    assert len(runs.two_eval) == len(runs.one_eval)
    for a, b in zip(runs.one_eval, runs.two_eval, strict=True):
        for k in (k for k in a if k.endswith(("reward", "kl", "prompts"))):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k


PPO = {k: copy.deepcopy(v) for k, v in TINY.items() if k != "evaluate"}
PPO["reward"] = copy.deepcopy(PREF["reward"])  # the shared reward model
PPO["ppo"] = {
    "data": RECIPE["grpo"]["data"],
    "optim": {"lr": 5e-3},
    # 8 sequences per rollout, 4 per update: two updates, so the policy's scoring pass runs.
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 1, "padding_free": True},
    "rollout": {"prompts_per_step": 8, "max_new_tokens": 8},
    "max_steps": 2,
    "checkpoint_every": 0,
    "eval_prompts": 4,
}
POLICY_AND_CRITIC = ("adapter/adapter_model.safetensors", "critic/critic.safetensors")


def test_ppo_sequence_parallel_matches_one_rank(tmp_path: Path, shared_parents: Path) -> None:
    """The critic's values (scoring pass), GAE and whitening on them, and the value loss on
    each rank's own tokens: the same step figures, policy adapter and critic as one rank."""
    recipe = write_recipe(tmp_path, copy.deepcopy(PPO))
    for stage in ("ingest", "sft", "reward"):
        run_shared(stage, recipe, shared_parents)
    runs = one_then_two("ppo", recipe, POLICY_AND_CRITIC)
    assert "sequence parallel: 2 ranks per group, 1 data-parallel group" in runs.output
    assert len(runs.two_train) == len(runs.one_train) == 2
    for a, b in zip(runs.one_train, runs.two_train, strict=True):
        for k in ("loss", "value_loss", "value_clip_frac", "explained_var", "score_mean", "kl"):
            assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])
        assert b["tokens"] == a["tokens"]
    assert set(runs.two_files) == set(POLICY_AND_CRITIC)
    assert (worst := runs.worst_weight_gap()) < 5e-5, worst
    assert len(runs.two_eval) == len(runs.one_eval)
    for a, b in zip(runs.one_eval, runs.two_eval, strict=True):
        for k in (k for k in a if k.endswith(("reward", "kl", "prompts"))):
            assert b[k] == pytest.approx(a[k], abs=1e-5), k
