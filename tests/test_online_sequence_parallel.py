"""Online DPO and distillation under sequence parallelism train as on one rank: 2 ranks of one
sequence-parallel group (`infra.sequence_parallel: 2`, one data-parallel group: the same prompts
dealt, the same samples drawn with the same seed) split every scoring and update forward's
packed rows, and give one rank's per-step figures to 1e-5, its trained adapter to 5e-5 and its
held-out figures to 1e-5. A torchrun of 2 ranks on two CPU cores: slow tier. And (fast) the
distillation teacher's base is checked for heads that split like the student's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from posttrain.config.loader import RecipeError, apply_overrides, resolve, validate_recipe
from posttrain.telemetry.records import read_metrics
from tests.sp_compare import SP, Runs, one_then_two
from tests.stage_helpers import TINY, run_inprocess, run_shared, write_recipe

BASE = {k: copy.deepcopy(v) for k, v in TINY.items() if k != "evaluate"}
ONLINE = {
    "data": {
        "synthetic": {"n_examples": 40, "seed": 7},
        "eval_fraction": 0.1,
        "max_prompt_len": 40,
    },
    "optim": {"lr": 5e-3},
    # 8 sequences per rollout, 4 per forward: 2 pairs (or 4 rows) each, so two forwards.
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 1, "padding_free": True},
    "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "max_new_tokens": 12},
    "max_steps": 3,
    "checkpoint_every": 0,
    "eval_prompts": 4,
}


def _same(a: dict, b: dict, keys: tuple[str, ...]) -> None:
    for k in keys:
        assert b[k] == pytest.approx(a[k], abs=1e-5), (k, a[k], b[k])


def _check(runs: Runs, train_keys: tuple[str, ...]) -> None:
    """Both runs' records and adapters agree; the group's rows are counted once."""
    assert "sequence parallel: 2 ranks per group, 1 data-parallel group" in runs.output
    assert read_metrics(runs.folder / "metrics.jsonl", "start")[0]["world_size"] == 2
    assert len(runs.two_train) == len(runs.one_train) == 3
    for a, b in zip(runs.one_train, runs.two_train, strict=True):
        _same(a, b, train_keys)
        assert b["tokens"] == a["tokens"]
    assert (worst := runs.worst_weight_gap()) < 5e-5, worst
    assert len(runs.two_eval) == len(runs.one_eval)
    for a, b in zip(runs.one_eval, runs.two_eval, strict=True):
        held = tuple(k for k in a if k.endswith(("reward", "kl", "prompts", "agreement", "rate")))
        assert held
        _same(a, b, held)


@pytest.mark.slow
def test_online_dpo_sequence_parallel_matches_one_rank(
    tmp_path: Path, shared_parents: Path
) -> None:
    """Judged by graded rewards (overlap, and length: answers of different lengths differ),
    so steps after the first (where policy and reference agree) train on pairs with a margin:
    the pairs' log-prob sums are summed over the group, and the pairs, loss and statistics
    counted once per group."""
    data = copy.deepcopy(BASE)
    data["online_dpo"] = copy.deepcopy(ONLINE) | {
        "rewards": [
            {"fn": "posttrain.rewards.match:token_similarity"},
            {
                "fn": "posttrain.rewards.length:length_penalty",
                "kwargs": {"max_tokens": 12, "buffer": 12},
            },
        ],
    }
    recipe = write_recipe(tmp_path, data)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    runs = one_then_two("online_dpo", recipe)
    keys = ("loss", "pairs", "all_equal", "informative_frac", "margin", "accuracy")
    keys += ("chosen_reward", "rejected_reward", "score_mean", "score_std", "response_len")
    assert all(r["pairs"] > 0 for r in runs.one_train[1:]), runs.one_train
    assert any(r["margin"] != 0 for r in runs.one_train[1:]), runs.one_train
    _check(runs, keys)


# A teacher on a wider base of the same tokenizer, trained by its own SFT (tests/test_distill.py).
TEACHER_STAGES = [
    {"kind": "ingest", "name": "teacher_base", "source": "from_config",
     "from_config": {**TINY["ingest"]["from_config"], "hidden_size": 96}},
    {"kind": "sft", "name": "teacher_sft", "base": "teacher_base", **copy.deepcopy(TINY["sft"])},
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_distill_sequence_parallel_matches_one_rank(
    tmp_path: Path, shared_parents: Path, reduction: str
) -> None:
    """Student and teacher take the same shard of each forward's rows: the divergence of each
    rank's own tokens adds up over the group, counted once; `sequence_mean` divides a shard's
    sum by its answer's whole length."""
    data = copy.deepcopy(BASE)
    section = copy.deepcopy(ONLINE) | {
        "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}],
        "reduction": reduction,
        # One row per forward, answers as long as the prompts: the cut between the ranks'
        # shards falls inside answers, which `sequence_mean` must divide by their whole length.
        "batch": {"micro_batch_size": 1, "grad_accum_steps": 1, "padding_free": True},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 32},
    }
    entry = {"kind": "distill", "name": "distill", "from": "sft", "teacher": "teacher_sft"}
    data["stages"] = [*copy.deepcopy(TEACHER_STAGES), entry | section]
    recipe = write_recipe(tmp_path, data)
    for stage in ("ingest", "sft"):
        run_shared(stage, recipe, shared_parents)
    for kind, name in (("ingest", "teacher_base"), ("sft", "teacher_sft")):
        run_inprocess(kind, recipe, name=name)
    runs = one_then_two("distill", recipe)
    keys = ("loss", "teacher_kl", "teacher_agreement", "score_mean", "response_len")
    assert all(r["loss"] > 0 for r in runs.one_train)
    _check(runs, keys)
    teacher = [r for r in runs.two_eval if "teacher_reward" in r]
    assert len(teacher) == 1  # measured once


def test_the_teachers_base_must_split_its_heads_too() -> None:
    """sp_check reads every base of the graph: a teacher's base with 3 heads cannot split over
    2 ranks, though the student's 4 can; online DPO and distill themselves are wired."""
    head = {"ingest": {"source": "from_config"}, "sft": {"data": {"synthetic": {}}}}
    tbase = {"kind": "ingest", "name": "tbase", "source": "from_config",
             "from_config": {"hidden_size": 96, "num_heads": 3}}  # fmt: skip
    entry = {"kind": "distill", "name": "distill", "data": {"synthetic": {}}, "teacher": "tbase"}
    odpo = {"kind": "online_dpo", "name": "odpo", "data": {"synthetic": {}},
            "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}]}  # fmt: skip
    data = head | {"stages": [tbase, entry, odpo]}
    with pytest.raises(RecipeError) as exc:
        resolve(validate_recipe(apply_overrides(data, list(SP))))
    assert exc.value.errors == [
        "infra.sequence_parallel: 2 cannot split the attention of base 'tbase': its 3 attention "
        "heads are not divisible by 2"
    ]
    tbase["from_config"]["num_heads"] = 4
    resolve(validate_recipe(apply_overrides(data, list(SP))))
