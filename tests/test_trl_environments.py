"""TRL's environment contract end to end: a GRPO stage whose rows each name one of two
environment classes (TRL's `environment_factory` mapping and `environment` column), one written
as TRL's docs write one (tools as documented methods, `reset(**kwargs)`, no `get_reward`, scored
by a reward function taking `environments`), the other scoring itself (a game's `step`
rewards) and taking only its own columns in `reset`. `validate` accepts the recipe first."""

from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path

import pytest

from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import TINY, run_inprocess, write_recipe

pytestmark = pytest.mark.slow

# As TRL's docs write an environment_factory class and a reward function that reads it.
CALC = '''
class CalcEnv:
    def reset(self, **kwargs):
        self.used = False

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.used = True
        return a + b


def calc_reward(environments, **kwargs):
    return [float(env.used) if isinstance(env, CalcEnv) else None for env in environments]
'''
GUESS = '''
import re


class Guess:
    """Higher or lower; reset takes its own column only (never `environment`)."""

    def reset(self, target):
        self.target = int(target)

    def step(self, message):
        found = re.search(r"\\d+", message["content"] or "")
        if found is not None and int(found.group()) == self.target:
            return [], 1.0, True
        return "Say the number.", -0.1, False
'''


def _recipe(folder: Path) -> Path:
    (folder / "calc_env.py").write_text(CALC)
    (folder / "guess_env.py").write_text(GUESS)
    rows = []
    for i in range(24):
        if i % 2:
            rows.append(
                {"prompt": f"Guess my number ({i}).", "environment": "guess", "target": i % 9}
            )
        else:
            rows.append({"prompt": f"What is {i} plus 3?", "environment": "calc"})
    (folder / "multi.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = copy.deepcopy(TINY)
    data["ingest"]["from_config"] |= {
        "template": "chatml_tools",
        "max_position_embeddings": 512,
        "pretrain_steps": 20,
        "corpus_examples": 100,
    }
    data["sft"] |= {"max_steps": 4}
    data["sft"]["data"]["synthetic"]["n_examples"] = 60
    data.pop("evaluate", None)
    data["grpo"] = {
        "data": {"path": str(folder / "multi.jsonl"), "eval_fraction": 0.25, "max_prompt_len": 256},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 2,
        "checkpoint_every": 0,
        "eval_prompts": 6,
        "max_kl": None,
        "rollout": {
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "max_new_tokens": 8,
            "max_turns": 2,
            "max_episode_tokens": 96,
            "environment": {"calc": "calc_env:CalcEnv", "guess": "guess_env:Guess"},
        },
        "rewards": [{"fn": "calc_env:calc_reward"}],
    }
    return write_recipe(folder, data)


def test_grpo_with_two_environment_classes_chosen_per_row(tmp_path: Path) -> None:
    from flows.cli_checks import cmd_validate

    recipe = _recipe(tmp_path)
    out = io.StringIO()
    assert cmd_validate(str(recipe), [], out, io.StringIO()) == 0, out.getvalue()
    said = out.getvalue()
    assert "grpo.rollout.environment.calc: calc_env.py:CalcEnv: tools add" in said
    assert "grpo.rollout.environment.guess: guess_env.py:Guess: step() environment" in said
    assert "grpo.rewards.0.fn: calc_env.py:calc_reward: takes posttrain's call" in said
    for stage in ("ingest", "sft"):
        run_inprocess(stage, recipe)
    grpo = run_inprocess("grpo", recipe)
    train = read_metrics(grpo / "metrics.jsonl", "train")
    assert len(train) == 2
    for row in train:  # each class's reward is averaged over its own episodes only
        assert {"reward_fn_calc_reward", "reward_fn_environment"} <= set(row), row
        assert math.isfinite(row["loss"])
    samples = [json.loads(x) for x in (grpo / "eval_samples.jsonl").read_text().splitlines()]
    by_env = {e: [s for s in samples if s["environment"] == e] for e in ("calc", "guess")}
    assert by_env["calc"] and by_env["guess"], samples
    for s in by_env["calc"]:  # scored by the function that reads its instance, not by itself
        assert s["reward_calc_reward"] in (0.0, 1.0) and s["reward_environment"] is None
        assert s["reward"] == s["reward_calc_reward"]
    for s in by_env["guess"]:  # scored by its own step rewards; the function said None
        assert s["reward_calc_reward"] is None and s["reward_environment"] is not None
        assert s["reward"] == pytest.approx(s["reward_environment"])
        assert all(m["role"] != "tool" for m in s["episode"])  # the calculator is not its tool
