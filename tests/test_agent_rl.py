"""GRPO and PPO on multi-turn episodes with a stateful environment (a number-guessing game that
answers higher/lower), on the tiny model the other RL tests share: the stages run, their
records count turns, the environment's reward is the score, a crash resumes to the same
trajectory, and two ranks whose episodes take different numbers of turns stay in step."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from posttrain.telemetry.records import read_metrics
from tests.rl_two_rank_worker import two_rank_records
from tests.stage_helpers import crash_after, planned_dir, run_inprocess, run_torchrun
from tests.test_rl_stages import RL, parents  # noqa: F401  (the shared fixture)

pytestmark = pytest.mark.slow

GUESS = '''
import re


class Guess:
    """Guess the number: the reply's first integer is the guess."""

    def reset(self, target, **columns):
        self.target, self.guesses = int(target), 0
        return " Answer with one number."

    def step(self, message):
        self.guesses += 1
        found = re.search(r"-?\\d+", message["content"] or "")
        if found is None:
            return "Say a number from 1 to 9.", -0.2, False
        guess = int(found.group())
        if guess == self.target:
            return [], 1.0, True
        return ("Higher." if guess < self.target else "Lower."), -0.1, False
'''

EPISODES = {
    "data": {"path": "guesses.jsonl", "eval_fraction": 0.25, "max_prompt_len": 40},
    "optim": {"lr": 5e-3},
    "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
    "max_steps": 3,
    "checkpoint_every": 0,
    "eval_prompts": 4,
    "rollout": {
        "prompts_per_step": 4,
        "max_new_tokens": 8,
        "environment": "guess:Guess",
        "max_turns": 3,
        "max_episode_tokens": 64,
    },
}


def episode_recipe(parents: dict, kind: str, section: dict, tag: str) -> Path:  # noqa: F811
    folder = parents["folder"]
    (folder / "guess.py").write_text(GUESS)
    rows = [
        {"prompt": f"I think of a number from 1 to 9 (game {i}).", "target": 1 + i % 9}
        for i in range(32)
    ]
    (folder / "guesses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = copy.deepcopy(section)
    section["data"]["path"] = str(folder / "guesses.jsonl")
    data = copy.deepcopy(RL) | {kind: section}
    data["run"]["workspace"] = str(folder / "ws")
    path = folder / f"{tag}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def check_episode_records(out: Path, turns_max: int) -> list[dict]:
    start = read_metrics(out / "metrics.jsonl", "start")[0]
    assert "reward" not in start["roles"], start["roles"]  # the environment scores
    train = read_metrics(out / "metrics.jsonl", "train")
    for row in train:
        assert 1 <= row["turns_mean"] <= turns_max, row
        assert "reward_fn_environment" in row and math.isfinite(row["loss"])
        assert 0 <= row["generation_share"] <= 1 and row["tool_share"] >= 0
        # The environment's reward is the whole score: no reward model, no functions.
        assert row["score_mean"] == pytest.approx(row["reward_fn_environment"], abs=1e-6)
    samples = [json.loads(x) for x in (out / "eval_samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["ended"] in ("answer", "max_turns", "budget") and 1 <= s["turns"] <= turns_max
        assert s["episode"][0]["role"] == "assistant"
        if s["turns"] > 1:  # the game answered between the turns
            assert s["episode"][1]["role"] == "user"
    return train


def test_grpo_on_episodes_of_a_guessing_game(parents) -> None:  # noqa: F811
    section = copy.deepcopy(EPISODES)
    section["rollout"]["samples_per_prompt"] = 2
    section["batch"]["micro_batch_size"] = 8
    recipe = episode_recipe(parents, "grpo", section, "guess-grpo")
    out = run_inprocess("grpo", recipe)
    check_episode_records(out, 3)
    final = json.loads((out / "manifest.json").read_text())["summary"]["eval_final"]
    assert 1 <= final["turns_mean"] <= 3 and "truncated_rate" in final
    # Evaluate by episode: the game is the verifier (its reward >= pass_threshold 1.0: found
    # at the first guess), for the base, the SFT policy and the GRPO policy alike; sampled
    # pass@k for the GRPO policy and, asked by name, the SFT policy, not the base.
    ev = run_inprocess(
        "evaluate",
        recipe,
        "evaluate.pass_samples=2",
        "evaluate.pass_k=2",
        "evaluate.pass_k_policies=[sft]",
    )
    v = json.loads((ev / "eval.json").read_text())["verifier"]
    assert v["verifiers"] == [] and v["episodes"]["environment"].endswith("guess.py:Guess")
    assert set(v["policies"]) == {"ingest", "sft", "grpo"} and v["sampled"] == ["sft", "grpo"]
    for name, m in v["policies"].items():
        assert m["prompts"] == 8 and 0.0 <= m["pass@1"] <= 1.0
        assert 1 <= m["turns_mean"] <= 3 and m["tool_calls_mean"] == 0
        assert ("pass@2" in m) == (name != "ingest")
        if name != "ingest":
            assert m["pass@1"] <= m["pass@2"] <= 1.0
    samples = [json.loads(x) for x in (ev / "verify_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all(s["episode"][0]["role"] == "assistant" for s in samples)
    assert all(s["prompt"][-1]["content"].endswith("Answer with one number.") for s in samples)


def test_ppo_on_episodes_resumes_to_the_same_trajectory(parents) -> None:  # noqa: F811
    section = copy.deepcopy(EPISODES) | {"max_steps": 4, "checkpoint_every": 2}
    recipe = episode_recipe(parents, "ppo", section, "guess-ppo")
    out = run_inprocess("ppo", recipe)
    full = check_episode_records(out, 3)
    assert all(math.isfinite(r["value_loss"]) for r in full)
    crash_after(out, 3, ("adapter", "critic"))
    run_inprocess("ppo", recipe)
    resumed = read_metrics(out / "metrics.jsonl", "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:], strict=True):
        for key in ("score_mean", "kl", "loss", "value_loss", "turns_mean", "response_len"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key


def test_grpo_episodes_on_two_ranks_with_different_turns(parents) -> None:  # noqa: F811
    section = copy.deepcopy(EPISODES) | {"max_steps": 2}
    section["rollout"] |= {"samples_per_prompt": 2, "prompts_per_step": 4, "max_turns": 4}
    recipe = episode_recipe(parents, "grpo", section, "guess-grpo2")
    over = (
        "infra.devices_per_node=2",
        *(f"{s}.batch.micro_batch_size=4" for s in ("sft", "reward")),
    )
    proc = run_torchrun("grpo", recipe, 2, *over)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = planned_dir("grpo", recipe, *over)
    train = check_episode_records(out, 4)
    assert read_metrics(out / "metrics.jsonl", "start")[0]["world_size"] == 2
    assert all(r["updates"] == 1 for r in train)


def test_two_ranks_play_different_numbers_of_turns_exactly(parents) -> None:  # noqa: F811
    """Rank 0's episodes end after 1 turn, rank 1's after 3: rank 0 keeps generating filler
    turns (without them the collectives mismatch and the run hangs). Greedy tokens are the
    argmax of a forward over the kept ids and the scored log-probs are that forward's. Read off
    the one 2-rank worker launch test_rl_stages's rollouts share (tests/rl_two_rank_worker.py)."""
    parts = (parents[s] for s in ("ingest", "sft", "reward"))
    rows = two_rank_records(*parts, parents["folder"])["episodes"]
    assert rows[0]["turns"] == [1, 1] and rows[1]["turns"] == [3, 3], rows
    for r in rows.values():
        assert r["ended"] == ["answer", "answer"] and r["greedy"] and r["checked"] > 0, r
        assert r["logp_err"] < 1e-2, r


BROKEN = """
class Broken:
    def reset(self, target, **columns):
        self.target = target

    def step(self, message):
        return {"not": "a tuple"}
"""


def test_a_broken_environment_fails_the_stage_in_one_line(parents, capfd) -> None:  # noqa: F811
    (parents["folder"] / "broken.py").write_text(BROKEN)
    section = copy.deepcopy(EPISODES) | {"max_steps": 1}
    section["rollout"] |= {"environment": "broken:Broken", "samples_per_prompt": 2}
    recipe = episode_recipe(parents, "grpo", section, "guess-broken")
    with pytest.raises(SystemExit) as exc:
        run_inprocess("grpo", recipe)
    assert exc.value.code == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    message = (
        r"POSTTRAIN_ERROR stage grpo failed: EnvironmentFailed: rollout.environment Broken.step "
        r"did not return \(observations, reward, done\) \(row .*guesses.jsonl:\d+\)"
    )
    assert re.search(message, err), err[-2000:]
    logged = (planned_dir("grpo", recipe) / "logs" / "error.txt").read_text()
    assert "Traceback" in logged and "Broken.step" in logged
