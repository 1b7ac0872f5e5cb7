"""bench/vs_trl.py: its figures, its pair conversion and its command line without trl; and
bench/vs_trl_check.py's verdicts on a comparison's rows. The comparison itself needs the `bench`
extra (trl==1.16.0), which the test command does not install: `bench/vs_trl_check.py` runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_trl, vs_trl_check, vs_trl_trainers
from posttrain.data.chat import IGNORE

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "vs_trl.py"
CHECK = ROOT / "bench" / "vs_trl_check.py"


def test_summarize_skips_warmup_steps() -> None:
    steps = [
        {"tokens": 1000.0, "step_time_s": 10.0, "loss": 5.0},  # warm-up: left out
        {"tokens": 1000.0, "step_time_s": 10.0, "loss": 4.0},
        {"tokens": 1000.0, "step_time_s": 10.0, "loss": 3.0},
        {"tokens": 300.0, "step_time_s": 1.0, "loss": 2.5},
        {"tokens": 500.0, "step_time_s": 3.0, "loss": 2.0},
    ]
    s = vs_trl.summarize(steps)
    assert s["tokens_per_s"] == pytest.approx(800 / 4)  # (300 + 500) tokens / (1 + 3) s
    assert s["step_time_s"] == pytest.approx(2.0)
    assert s["median_tokens_per_s"] == pytest.approx((300 / 1 + 500 / 3) / 2)
    assert s["fast_tokens_per_s"] == pytest.approx(500 / 3 + 0.75 * (300 - 500 / 3))
    assert (s["first_loss"], s["last_loss"], s["timed_steps"]) == (5.0, 2.0, 2)


def test_rl_summary_skips_warmup_steps() -> None:
    steps = [
        {"step_time_s": 9.0, "completion_len": 1.0, "loss": 0.5, "generation_s": 9.0},  # warm-up
        {"step_time_s": 9.0, "completion_len": 1.0, "loss": 0.4, "generation_s": 9.0},
        {"step_time_s": 9.0, "completion_len": 1.0, "loss": 0.3, "generation_s": 9.0},
        {"step_time_s": 2.0, "completion_len": 30.0, "loss": 0.2, "generation_s": 1.0},
        {"step_time_s": 4.0, "completion_len": 32.0, "loss": 0.1, "generation_s": 2.0},
        {"step_time_s": 9.0, "completion_len": 28.0, "loss": 0.0, "generation_s": 3.0},
    ]
    s = vs_trl.rl_summary(steps)
    assert s["step_time_s"] == pytest.approx(5.0)  # (2 + 4 + 9) / 3
    assert s["median_step_time_s"] == pytest.approx(4.0)
    assert s["fast_step_time_s"] == pytest.approx(3.0)  # inclusive lower quartile: 2 + 0.5 x 2
    assert s["completion_len"] == pytest.approx(30.0)
    # Only phases every timed step carries: generation_s; scoring_s and training_s absent.
    assert s["split"] == {"generation_s": 2.0}
    assert (s["last_loss"], s["steps"], s["timed_steps"]) == (0.0, 6, 3)
    # No more steps than the warm-up: all of them count.
    short = vs_trl.rl_summary(steps[:2])
    assert short["step_time_s"] == 9.0 and short["timed_steps"] == 2


def test_time_ratios_are_posttrain_over_trl() -> None:
    pt = {
        "step_time_s": 3.0,
        "median_step_time_s": 2.0,
        "fast_step_time_s": 1.5,
        "completion_len": 31.0,
    }
    trl = {
        "step_time_s": 4.0,
        "median_step_time_s": 4.0,
        "fast_step_time_s": 3.0,
        "completion_len": 32.0,
    }
    r = vs_trl.time_ratios(pt, trl)
    assert (r["time_ratio"], r["median_time_ratio"], r["fast_time_ratio"]) == (0.75, 0.5, 0.5)
    assert r["completion_len_rel_diff"] == pytest.approx(1 / 32)
    assert r["lengths_comparable"]
    assert not vs_trl.time_ratios(pt | {"completion_len": 20.0}, trl)["lengths_comparable"]
    row = {"size": "tiny", "stage": "grpo", "ratio": 9.0, **r}
    assert vs_trl.headline(row) == {
        "size": "tiny",
        "stage": "grpo",
        "time_ratio": 0.75,
        "median_time_ratio": 0.5,
        "fast_time_ratio": 0.5,
    }


def test_grpo_row_recipe_and_trl_fields(tmp_path: Path) -> None:
    """The bench's grpo stage starts from sft (not dpo), rolls out 8 x 8 into one optimizer
    step, and TRL gets the same shape, sampling and clipped loss."""
    import yaml

    from posttrain.config.loader import load_recipe, section_batch
    from posttrain.plan.planner import plan

    path = tmp_path / "recipe.yaml"
    recipe = vs_trl.recipe_for(vs_trl.SIZES["tiny"], 3, tmp_path / "ws", 1)
    path.write_text(yaml.safe_dump(recipe))
    loaded = load_recipe(path)
    assert plan(loaded).stage("grpo").roles["policy"] == "sft"
    assert section_batch(loaded, "grpo").global_batch_size == 64
    kw = vs_trl_trainers.grpo_kw(vs_trl.grpo_section(loaded))
    assert kw["num_generations"] == 8 and kw["max_completion_length"] == 32
    assert (kw["temperature"], kw["top_k"], kw["top_p"]) == (1.0, 0, 1.0)
    assert (kw["beta"], kw["num_iterations"], kw["epsilon"], kw["epsilon_high"]) == (
        0.0,
        1,
        0.2,
        0.2,
    )
    assert kw["scale_rewards"] == "group" and kw["loss_type"] == "dapo"
    assert kw["shuffle_dataset"] is False


def test_grpo_settings_are_read_as_yaml_and_set_by_dotted_path() -> None:
    settings = vs_trl.parse_settings(
        ["rollout.drop_finished=true", "rollout.generation_batch_size=32", "eval_prompts=4"]
    )
    assert settings == {
        "rollout.drop_finished": True,
        "rollout.generation_batch_size": 32,
        "eval_prompts": 4,
    }
    entry = {"rollout": {"max_new_tokens": 32}, "eval_prompts": 8}
    out = vs_trl.with_settings(entry, settings | {"kl.coef": 0.0})
    assert out == {
        "rollout": {"max_new_tokens": 32, "drop_finished": True, "generation_batch_size": 32},
        "eval_prompts": 4,
        "kl": {"coef": 0.0},
    }
    assert entry == {"rollout": {"max_new_tokens": 32}, "eval_prompts": 8}  # not modified
    with pytest.raises(ValueError, match="key.path=value"):
        vs_trl.parse_settings(["rollout.drop_finished"])


def test_trl_pairs_split_at_the_first_scored_token() -> None:
    pair = {
        "chosen_ids": [1, 2, 3, 7, 8, 9],
        "chosen_labels": [IGNORE, IGNORE, IGNORE, 7, 8, 9],
        "rejected_ids": [1, 2, 3, 5],
        "rejected_labels": [IGNORE, IGNORE, IGNORE, 5],
    }
    assert vs_trl_trainers.trl_pairs([pair]) == [
        {"prompt_ids": [1, 2, 3], "chosen_ids": [7, 8, 9], "rejected_ids": [5]}
    ]
    # TRL scores every completion token: an unscored one after the response would differ.
    bad = pair | {"chosen_labels": [IGNORE, IGNORE, IGNORE, 7, 8, IGNORE]}
    with pytest.raises(AssertionError, match="unscored"):
        vs_trl_trainers.trl_pairs([bad])


def test_stage_order_is_the_stages_batches() -> None:
    from posttrain.data.batching import step_indices

    order = vs_trl_trainers.stage_order(10, 3, micro=2, accum=2, seed=5)
    assert len(order) == 12
    assert order[4:8] == [
        i for ix in step_indices(10, 1, micro=2, accum=2, dp_size=1, rank=0, seed=5) for i in ix
    ]


def test_help_and_missing_trl_without_trl(tmp_path: Path) -> None:
    """--help needs nothing heavy; without trl the bench says how to get it in one line."""
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    help_ = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "--steps" in help_.stdout
    (tmp_path / "trl").mkdir()  # shadows an installed trl with one that cannot import
    (tmp_path / "trl" / "__init__.py").write_text("raise ImportError('no trl here')\n")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--sizes", "tiny"], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == vs_trl.TRL_MISSING
    assert "pip install -e .[bench]" in vs_trl.TRL_MISSING

    check = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, env=env)
    assert check.returncode == 1 and check.stderr.strip() == vs_trl.TRL_MISSING


def _rows() -> list[dict]:
    """A 3-step comparison's rows that pass every check."""
    side = {"tokens_per_s": 100.0, "steps": 3, "tokens_per_step": 512}
    row = {"ratio": 1.1, "median_ratio": 1.0, "fast_ratio": 1.2, "first_loss_match": True}
    sft = {
        **row,
        "stage": "sft",
        "posttrain": {**side, "first_loss": 6.2, "last_loss": 5.0},
        "trl": {**side, "first_loss": 6.2, "last_loss": 5.0001, "gradient_checkpointing": True},
    }
    times = {"step_time_s": 2.0, "median_step_time_s": 2.0, "fast_step_time_s": 1.5}
    rl = {**times, "steps": 3, "completion_len": 12.0}
    grpo = {
        "stage": "grpo",
        "time_ratio": 0.8,
        "median_time_ratio": 0.8,
        "fast_time_ratio": 0.9,
        "posttrain": {**rl, "split": dict.fromkeys(vs_trl.RL_SPLIT, 0.5)},
        "trl": {**rl, "split": {"generation_s": 1.0}, "gradient_checkpointing": False},
    }
    return [sft, {**sft, "stage": "dpo"}, grpo]


def test_check_passes_a_good_comparison_and_names_each_failure() -> None:
    sft, dpo, grpo = _rows()
    assert vs_trl_check.throughput_problems(sft) == vs_trl_check.grpo_problems(grpo) == []
    dpo["first_loss_match"] = False
    dpo["trl"] = {**dpo["trl"], "tokens_per_step": 511, "last_loss": 5.1}
    assert [p.split(":")[1].split()[0] for p in vs_trl_check.throughput_problems(dpo)] == [
        "tokens",
        "first",
        "last",
    ]
    grpo["posttrain"] = {**grpo["posttrain"], "split": {"generation_s": 1.0}}
    grpo["trl"] = {**grpo["trl"], "gradient_checkpointing": True, "steps": 2}
    problems = vs_trl_check.grpo_problems(grpo)
    assert len(problems) == 3 and all(p.startswith("grpo: ") for p in problems), problems
