"""The promotion gate's head-to-head: candidate export vs champion export, judged by the candidate
run's reward model, on real (tiny) stage artifacts.

Two exports of one pipeline: "good" (SFT 8 steps) and "worse" (SFT 1 step). The judge is a reward
stage trained on pairs chosen = the good export's answers, rejected = the worse export's, with
the same file as its held-out set: the head-to-head then asks about exactly the preference the
judge has fitted, so the direction it must report is known (good beats worse), and a swap of
roles must mirror it exactly. A real reward model fitted on real data would not make a test:
a tiny one does not generalise in seconds.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from flows.gate import head_to_head_vs_champion
from flows.report.tables import StageRecord
from flows.stage.failures import StageFailed
from flows.stage.supervise import supervise_stage
from posttrain.config.loader import load_recipe
from posttrain.data.preference import quickstart_preference_rows
from posttrain.eval.preference_eval import answers
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.plan.planner import spec_for
from posttrain.stages import head_to_head as stage_module
from posttrain.stages.common import stage_main
from posttrain.store.artifacts import read_manifest, ref_from_manifest
from posttrain.workspace.promotion import HEAD_TO_HEAD, WIN_RATE_VS_CHAMPION, head_to_head_stage
from tests.stage_helpers import TINY, run_inprocess, run_shared, supervised, write_recipe

pytestmark = pytest.mark.slow

N_PROMPTS = 16
SAMPLING = {"name": "win-rate", "strategy": "greedy", "max_new_tokens": 10}
BASE = copy.deepcopy(TINY)
BASE["infra"]["threads_per_rank"] = 1
BASE["ingest"]["from_config"]["pretrain_steps"] = 30
BASE["sft"]["max_steps"] = 8
BASE["evaluate"] |= {"win_rate_prompts": N_PROMPTS, "win_rate_sampling": SAMPLING}
WORSE = "sft.max_steps=1"
LOG = logging.getLogger("test_head_to_head")


def _pairs(recipe: Path, good: Path, worse: Path, path: Path) -> int:
    """Preference file: each prompt with the good export's answer as chosen, the worse
    export's as rejected (the same generation settings the head-to-head uses)."""
    cfg = load_recipe(recipe).evaluate
    prompts = [r["prompt"] for r in quickstart_preference_rows(N_PROMPTS, seed=3)]
    replies = {}
    for name, folder in (("good", good), ("worse", worse)):
        model = load_causal_lm(folder / "model", torch.float32)
        tok = load_tokenizer(folder / "model")
        replies[name] = answers(model, tok, prompts, cfg.win_rate_sampling, 0, cfg.batch_size)
    rows = [
        {"prompt": p, "chosen": g, "rejected": w}
        for p, g, w in zip(prompts, replies["good"], replies["worse"], strict=True)
        if g.strip() and w.strip() and g != w
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def _export(recipe: Path, *overrides: str) -> Path:
    for stage in ("ingest", "sft", "evaluate", "export"):
        folder = run_inprocess(stage, recipe, *overrides)
    return folder


@pytest.fixture(scope="module")
def arts(tmp_path_factory: pytest.TempPathFactory, shared_parents: Path) -> dict:
    root = tmp_path_factory.mktemp("h2h")
    recipe = write_recipe(root, BASE)
    run_shared("ingest", recipe, shared_parents)  # the 30-step base, built once per session
    out = {"good": _export(recipe), "worse": _export(recipe, WORSE)}
    out["ingest"] = run_inprocess("ingest", recipe)  # complete: returns its folder
    pairs = root / "pairs.jsonl"
    out["pairs"] = _pairs(recipe, out["good"], out["worse"], pairs)
    # The judge belongs to the "good" run: reward's parents are ingest and the good SFT.
    judged = copy.deepcopy(BASE)
    judged["reward"] = {
        "data": {
            "path": str(pairs),
            "eval_path": str(pairs),
            "max_seq_len": 64,
            "max_prompt_len": 40,
            "on_invalid": "skip",
        },
        "lora": {"r": 8, "alpha": 16},
        "optim": {"lr": 1e-2},
        "batch": {"micro_batch_size": 4, "grad_accum_steps": 1},
        "max_steps": 30,
        "checkpoint_every": 0,
    }
    out["recipe"] = write_recipe(root, judged)  # same workspace: ingest and sft are reused
    out["reward"] = run_inprocess("reward", out["recipe"])
    return out


def _head_to_head(arts: dict, candidate: str, champion: str) -> tuple[Path, dict]:
    recipe = load_recipe(arts["recipe"])
    parents = {
        "candidate": ref_from_manifest(arts[candidate]),
        "champion": ref_from_manifest(arts[champion]),
        "reward_model": ref_from_manifest(arts["reward"]),
        "base": ref_from_manifest(arts["ingest"]),
    }
    stage = head_to_head_stage(recipe, parents)
    with supervised(stage, spec_for(stage, recipe, parents)) as spec:
        stage_main(stage_module.run, kind=HEAD_TO_HEAD, argv=["--spec", str(spec)])
    return stage.out_dir, (read_manifest(stage.out_dir) or {})["summary"]


def test_a_model_against_itself_ties_every_prompt(arts) -> None:
    folder, s = _head_to_head(arts, "good", "good")
    assert folder.parent.name == "head_to_head"
    assert (s["wins"], s["losses"], s["ties"]) == (0, 0, s["n"])
    assert s["win_rate"] == 0.5 and s["headline"][WIN_RATE_VS_CHAMPION] == 0.5
    rows = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == s["n"] == arts["pairs"]
    assert all(r["candidate"] == r["champion"] for r in rows)
    assert all(r["candidate_score"] == r["champion_score"] for r in rows)


def test_the_worse_export_loses_and_swapping_roles_mirrors_it(arts) -> None:
    _, good = _head_to_head(arts, "good", "worse")
    assert good["n"] == arts["pairs"] >= 4
    assert good["win_rate"] >= 0.75, good
    assert good["mean_reward"]["candidate"] > good["mean_reward"]["champion"]
    _, worse = _head_to_head(arts, "worse", "good")
    assert (worse["wins"], worse["losses"], worse["ties"]) == (
        good["losses"],
        good["wins"],
        good["ties"],
    )
    assert worse["win_rate"] == pytest.approx(1 - good["win_rate"], abs=1e-12)
    assert worse["headline"][WIN_RATE_VS_CHAMPION] < 0.5


def _records(arts: dict, *stages: str) -> dict[str, StageRecord]:
    folders = {"ingest": arts["ingest"], "reward": arts["reward"], "export": arts["good"]}
    return {
        s: StageRecord(s, ref_from_manifest(folders[s]).fingerprint, "ran", 0.0, str(folders[s]))
        for s in stages
    }


def _champion(arts: dict, which: str = "worse") -> dict:
    return {
        "run_id": "r-champ",
        "export_path": str(arts[which] / "model"),
        "export_fingerprint": ref_from_manifest(arts[which]).fingerprint,
    }


def test_gate_finds_the_same_artifact_and_reads_its_win_rate(arts) -> None:
    """The flow side plans the same fingerprint as the stage test above made, so the
    supervisor reuses that folder instead of starting a process."""
    recipe = load_recipe(arts["recipe"])
    _, direct = _head_to_head(arts, "good", "worse")

    by_stage = _records(arts, "ingest", "reward", "export")
    h2h = head_to_head_vs_champion(recipe, by_stage, _champion(arts), LOG, supervise_stage)
    assert h2h.value == direct["headline"][WIN_RATE_VS_CHAMPION] and h2h.unmeasured is None
    assert "head-to-head against champion r-champ (reused)" in h2h.note
    assert h2h.record["wins"] == direct["wins"] and h2h.record["champion_run_id"] == "r-champ"


def test_gate_skips_or_blocks_with_the_reason(arts, tmp_path: Path) -> None:
    recipe = load_recipe(arts["recipe"])
    by_stage = _records(arts, "ingest", "reward", "export")

    def never(stage, spec):
        raise AssertionError("must not launch")

    no_reward = _records(arts, "ingest", "export")
    h2h = head_to_head_vs_champion(recipe, no_reward, _champion(arts), LOG, never)
    assert h2h.value is None and h2h.unmeasured is not None and not h2h.unmeasured.blocks
    assert h2h.unmeasured.reason == "the recipe has no reward stage to judge with"

    gone = {**_champion(arts), "export_path": str(tmp_path / "deleted" / "model")}
    h2h = head_to_head_vs_champion(recipe, by_stage, gone, LOG, never)
    assert h2h.unmeasured is not None and not h2h.unmeasured.blocks
    assert "no longer exists" in h2h.unmeasured.reason
    assert h2h.note.startswith("head-to-head against the champion skipped: ")

    def fails(stage, spec):
        raise StageFailed(
            f"stage '{stage.name}' exited with code 1. Log: x\n--- end of the log ---\n"
            "POSTTRAIN_ERROR stage head_to_head failed: RuntimeError: out of memory"
        )

    h2h = head_to_head_vs_champion(recipe, by_stage, _champion(arts), LOG, fails)
    assert h2h.unmeasured is not None and h2h.unmeasured.blocks
    assert h2h.unmeasured.reason == (
        "head-to-head against the champion failed: stage 'head_to_head' exited with code 1. "
        "Log: x (RuntimeError: out of memory)"
    )
