"""Every no-grad pass that feeds training or a figure gives the same bits in another process
(issue 39): GRPO's scoring passes (the policy's log-probs before its two updates of a rollout,
the reference's for the KL), a teacher's greedy answers (cached across runs) and its log-probs
(on-policy distillation), and evaluate's figures.

One workspace builds the bases and SFTs; two copies then run offpolicy SFT, GRPO, distill and
evaluate, each in a process of its own with its own PYTHONHASHSEED, the second while a competing
training job runs on the same cores. Every artifact must be the same, file for file. Then the
teacher's answers are asked for under other numerics (2 threads): sampled again into a cache
file of their own, never taken from the one the 1-thread runs wrote.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.stage_helpers import (
    ROOT,
    TINY,
    artifact_digests,
    competing_training,
    run_inprocess,
    stop_competing,
)

pytestmark = pytest.mark.slow

# Bases warmed up for 10 steps: the passes' bits, not the models' quality, are compared.
BASE = {**TINY["ingest"]["from_config"], "pretrain_steps": 10}
PROMPTS = {"synthetic": {"n_examples": 120, "seed": 7}, "eval_fraction": 0.1, "max_prompt_len": 40}
STAGES = [
    {"kind": "ingest", "name": "teacher_base", "source": "from_config",
     "from_config": {**BASE, "hidden_size": 96}},
    {"kind": "sft", "name": "teacher_sft", "base": "teacher_base", **copy.deepcopy(TINY["sft"])},
    {"kind": "sft", "name": "offpolicy", "from": "sft", "teacher": "teacher_sft",
     **copy.deepcopy(TINY["sft"]), "max_steps": 4,
     "teacher_sampling": {"max_new_tokens": 12, "batch_size": 8}},
    # Two updates per rollout and a KL in the loss: both scoring passes run.
    {"kind": "grpo", "name": "grpo", "from": "sft", "data": PROMPTS, "update_epochs": 2,
     "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 12},
     "optim": {"lr": 5e-3}, "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
     "max_steps": 3, "checkpoint_every": 0, "eval_prompts": 8,
     "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}]},
    # Last: the final policy, the one evaluate scores beside its teacher.
    {"kind": "distill", "name": "distill", "from": "grpo", "teacher": "teacher_sft",
     "data": PROMPTS, "rollout": {"prompts_per_step": 4, "max_new_tokens": 12},
     "optim": {"lr": 5e-3}, "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
     "max_steps": 3, "checkpoint_every": 0, "eval_prompts": 8,
     "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}]},
]  # fmt: skip
RUNS = [("sft", "offpolicy"), ("grpo", "grpo"), ("distill", "distill"), ("evaluate", "evaluate")]
# One process runs the passes in order, as the stages' own entry points do.
RUNNER = """
import sys
from tests.stage_helpers import run_inprocess
for kind, name in {runs!r}:
    run_inprocess(kind, sys.argv[1], name=name)
"""


def _recipe(folder: Path) -> Path:
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(folder / "ws")
    # One thread beside the competing job's one on two cores: decoding's small operations slow
    # down many times over when OpenMP threads outnumber the cores (they spin while they wait).
    data["infra"]["threads_per_rank"] = 1
    data["ingest"]["from_config"] = copy.deepcopy(BASE)
    data["stages"] = copy.deepcopy(STAGES)
    path = folder / "passes.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workspace with both bases and both SFTs."""
    folder = tmp_path_factory.mktemp("passes")
    recipe = _recipe(folder)
    for kind, name in (("ingest", "ingest"), ("ingest", "teacher_base"), ("sft", "sft"),
                       ("sft", "teacher_sft")):  # fmt: skip
        run_inprocess(kind, recipe, name=name)
    return folder / "ws"


def _copy(built: Path, folder: Path) -> Path:
    shutil.copytree(built / "artifacts", folder / "ws" / "artifacts")
    return _recipe(folder)


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **extra}


def _passes(recipe: Path, hash_seed: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER.format(runs=RUNS), str(recipe)],
        cwd=ROOT,
        env=_env(PYTHONHASHSEED=hash_seed),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> None:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-6000:]


def test_scoring_teacher_and_evaluate_passes_are_the_same_in_another_process(
    built: Path, tmp_path: Path
) -> None:
    alone_dir, loaded_dir, load_dir = (tmp_path / n for n in ("alone", "loaded", "load"))
    for d in (alone_dir, loaded_dir, load_dir):
        d.mkdir()
    _finish(_passes(_copy(built, alone_dir), "1"))

    loaded_recipe = _copy(built, loaded_dir)
    competitor = competing_training(load_dir, _env(), threads=1)
    try:
        _finish(_passes(loaded_recipe, "2"))
    finally:
        assert stop_competing(competitor), "the competing job ended before the passes did"

    alone, loaded = artifact_digests(alone_dir / "ws"), artifact_digests(loaded_dir / "ws")
    kinds = {key.split("/")[0] for key in alone}
    assert {"grpo", "distill", "evaluate"} <= kinds and alone.keys() == loaded.keys()
    differ = sorted(k for k in alone if alone[k] != loaded[k])
    assert not differ, differ
    answers = sorted((loaded_dir / "ws" / "artifacts" / "teacher_answers").glob("*/answers.jsonl"))
    assert len(answers) == 1

    # The same answers asked for under other numerics are sampled again, into a file of their
    # own; under the same numerics (another learning rate) they are reused.
    def offpolicy(*overrides: str) -> dict:
        out = run_inprocess("sft", loaded_recipe, *overrides, name="offpolicy")
        return json.loads((out / "manifest.json").read_text())["summary"]

    other = offpolicy("stages.offpolicy.optim.lr=7e-3", "infra.threads_per_rank=2")
    assert not other["teacher_answers_reused"]
    assert Path(other["teacher_answers_file"]) not in answers
    same = offpolicy("stages.offpolicy.optim.lr=6e-3")
    assert same["teacher_answers_reused"] and Path(same["teacher_answers_file"]) == answers[0]
