"""`posttrain run` end to end on the real stages with a tiny recipe, on a Prefect test server:
a first run builds every stage, a re-run is all cache hits, and a change to the evaluate section
re-runs evaluate and export only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from stage_helpers import TINY, write_recipe

from flows.cli import cmd_run

pytestmark = pytest.mark.slow

# Smaller than the stage tests' recipe: this checks orchestration, not learning.
FAST = ["ingest.from_config.pretrain_steps=5", "sft.max_steps=3"]


LAST_OUTPUT: list[str] = []


def _run(recipe: Path, *overrides: str) -> dict[str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cmd_run(str(recipe), [*FAST, *overrides], out, err)
    assert code == 0, err.getvalue()[-3000:]
    text = out.getvalue()
    LAST_OUTPUT[:] = [text]
    rows = text.split("\n\n")[0].splitlines()[2:]
    statuses = {row.split()[0]: row.split()[1] for row in rows}
    model = Path(text.split("exported model:")[1].split()[0])
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    return statuses


def test_run_then_cached_then_downstream_only(prefect_harness: None, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, TINY)
    assert _run(recipe) == dict.fromkeys(("ingest", "sft", "evaluate", "export"), "ran")
    assert _run(recipe) == dict.fromkeys(("ingest", "sft", "evaluate", "export"), "cached")
    assert _run(recipe, "evaluate.max_eval_rows=12") == {
        "ingest": "cached", "sft": "cached", "evaluate": "ran", "export": "ran",
    }  # fmt: skip
    assert len(list((tmp_path / "ws" / "runs").iterdir())) == 3


def test_promotion_gate_promotes_then_refuses_a_worse_candidate(
    prefect_harness: None, tmp_path: Path
) -> None:
    from posttrain.promotion import read_registry

    # With a reward stage, the gate also runs the head-to-head against the champion.
    recipe = write_recipe(tmp_path, {**TINY, "reward": REWARD, "evaluate": H2H_EVALUATE})
    _run(recipe)
    assert "promotion:      promoted: first candidate of this pipeline" in LAST_OUTPUT[0]
    _run(recipe)  # all cached: the same export is already the champion
    assert "already the champion" in LAST_OUTPUT[0]
    # Deliberately worse: one SFT step instead of three.
    _run(recipe, "sft.max_steps=1")
    assert "promotion:      NOT promoted: regressed: tuned_loss" in LAST_OUTPUT[0]
    reg = read_registry(tmp_path / "ws", "tiny")
    assert [h["promoted"] for h in reg["history"]] == [True, False]
    assert reg["champion"]["run_id"] == reg["history"][0]["run_id"]
    run_dir = Path(LAST_OUTPUT[0].split("run folder:")[1].split()[0])
    report = (run_dir / "report.md").read_text()
    assert "## Promotion" in report and "| tuned_loss | lower | 0.02 |" in report
    h2h = reg["history"][1]["head_to_head"]
    assert h2h["champion_run_id"] == reg["champion"]["run_id"] and h2h["n"] == 4
    win_rate = reg["history"][1]["metrics"]["win_rate_vs_champion"]
    assert win_rate == h2h["win_rate"] and (h2h["wins"] + h2h["ties"] / 2) / 4 == win_rate
    assert f"| win_rate_vs_champion | higher | 0.05 | {win_rate:.4g} | 0.5 |" in report
    assert f"head-to-head against champion {h2h['champion_run_id']} (ran)" in report
    assert Path(h2h["artifact"]).parent == tmp_path / "ws" / "artifacts" / "head_to_head"


REWARD = {
    "data": {
        "synthetic": {"n_examples": 40},
        "eval_fraction": 0.2,
        "max_seq_len": 64,
        "max_prompt_len": 40,
    },
    "lora": {"r": 8, "alpha": 16},
    "optim": {"lr": 1e-2},
    "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
    "max_steps": 3,
    "checkpoint_every": 0,
}
H2H_EVALUATE = {
    **TINY["evaluate"],
    "win_rate_prompts": 4,
    "win_rate_sampling": {"name": "win-rate", "strategy": "greedy", "max_new_tokens": 8},
}
