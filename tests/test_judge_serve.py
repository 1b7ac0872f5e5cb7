"""A model as judge through a REAL `transformers serve` the judge's `command` starts, on the tiny
model the RL tests share: rows scored through it (and nothing of it left running after), and a
GRPO stage scored by a judge that runs to the end with judge counters in its step records, and
evaluate using that judge as its verifier."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from posttrain.rewards import counters
from posttrain.rewards.combine import load_rewards, score_functions
from posttrain.rewards.judge_server import judge_servers
from posttrain.sections.rewards import RewardSpec
from posttrain.serving.weights import servable_base
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import run_inprocess
from tests.test_rl_stages import GRPO, parents, recipe_with  # noqa: F401 (the fixture)
from tests.test_rollout_server import left_running

pytestmark = pytest.mark.slow

SERVE = (
    "transformers serve --host {host} --port {port} --continuous-batching "
    "--cb-num-blocks 64 --cb-block-size 16 --format quiet"
)


def judge_model(parents: dict, folder: Path) -> Path:  # noqa: F811
    """The shared tiny base with its tokenizer, as one folder `transformers serve` loads."""
    manifest = json.loads((parents["ingest"] / "manifest.json").read_text())
    model_dir = Path(manifest["summary"]["model_dir"])
    return servable_base(folder, model_dir, parents["ingest"] / "tokenizer")


def judge(model: Path, **over: object) -> dict:
    return {
        "command": SERVE,
        "model": str(model),
        "rubric": "Rate from 0 to 10.\n{completion}",
        "max_tokens": 4,
        "timeout_s": 120.0,
        "retries": 0,
    } | over


def server_pgid(logs: Path, label: str) -> int:
    lines = (logs / f"judge-{label}.log").read_text().splitlines()
    return int([x for x in lines if x.startswith("== process group ")][-1].split()[-1])


def test_a_judge_command_scores_rows_and_leaves_nothing_running(
    parents,  # noqa: F811
    tmp_path: Path,
) -> None:
    model = judge_model(parents, tmp_path / "judge-model")
    spec = RewardSpec.model_validate({"judge": judge(model), "name": "j"})
    funcs = load_rewards([spec], where="grpo.rewards")
    prompts = [[{"role": "user", "content": f"{i}+{i}?"}] for i in range(4)]
    with judge_servers(funcs, tmp_path):
        counters.take(0)
        _, per = score_functions(
            funcs, prompts, ["2", "4", "6", "8"], [{}] * 4, [[1]] * 4, [True] * 4
        )
        got = counters.take(4)
        _, again = score_functions(
            funcs, prompts, ["2", "4", "6", "8"], [{}] * 4, [[1]] * 4, [True] * 4
        )
        cached = counters.take(4)
    values = per["j"].tolist()
    # A random tiny model rarely writes a number in range: each row is a score or 0 (unparsed).
    assert len(values) == 4 and all(0.0 <= v <= 1.0 for v in values)
    assert got["judge_calls"] == [1.0] * 4 and got["judge_failures"] == [0.0] * 4
    assert sum(got["judge_unparsed"]) == sum(v == 0.0 for v in values) or sum(values) > 0
    assert cached["judge_cache_hits"] == [1.0] * 4 and again["j"].tolist() == values
    pgid = server_pgid(tmp_path / "logs", "j")
    assert not left_running(pgid)
    assert not (tmp_path / "logs" / "judge-j.json").exists()


def test_grpo_scored_by_a_judge_records_its_calls_and_evaluate_verifies_by_it(
    parents,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    # Beside the recipe: a judge's model folder must lie where a recipe may read.
    model = judge_model(parents, parents["folder"] / f"judge-model-{tmp_path.name}")
    section = copy.deepcopy(GRPO) | {"max_steps": 2, "eval_prompts": 8}
    section["rewards"] = [{"judge": judge(model), "name": "j"}]
    recipe = recipe_with(parents, "grpo", section, "judged-grpo")
    out = run_inprocess("grpo", recipe)
    train = read_metrics(out / "metrics.jsonl", "train")
    assert len(train) == 2
    per_step = GRPO["rollout"]["prompts_per_step"] * GRPO["rollout"]["samples_per_prompt"]
    for row in train:
        assert row["judge_calls"] + row["judge_cache_hits"] == per_step
        assert row["judge_failures"] == 0 and "reward_fn_j" in row
    assert not left_running(server_pgid(out / "logs", "j"))
    # Evaluate takes the stage's first reward, the judge, as its verifier (its own server).
    ev = run_inprocess("evaluate", recipe)
    v = json.loads((ev / "eval.json").read_text())["verifier"]
    assert [f["label"] for f in v["verifiers"]] == ["j"]
    assert all(0.0 <= m["pass@1"] <= 1.0 for m in v["policies"].values())
    assert not left_running(server_pgid(ev / "logs", "j"))
