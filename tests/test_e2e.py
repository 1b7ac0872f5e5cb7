"""`posttrain run` end to end on the real stages with a tiny recipe, on a Prefect test server:
a first run builds every stage, a re-run reuses every artifact, and a change to the SFT section
re-runs SFT and what depends on it only; the promotion gate promotes the first candidate, keeps
the champion on the re-run and refuses the worse one (a head-to-head against the champion
included).

The three runs are shared by both tests (a module fixture): a first version ran three more of
the plain recipe for the caching test, with an evaluate edit as its change. That orchestration
(which stages a change re-runs) is checked edit by edit on stand-in stages in tests/test_flow.py;
here the real stages show that their fingerprints are stable and their artifacts are reused.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from stage_helpers import TINY, write_recipe

from flows.cli import cmd_run

pytestmark = pytest.mark.slow

# Smaller than the stage tests' recipe: this checks orchestration, not learning.
FAST = ["ingest.from_config.pretrain_steps=5", "sft.max_steps=3"]


def _run(recipe: Path, *overrides: str) -> tuple[dict[str, str], str]:
    """(status of each stage, the CLI's output) of one `posttrain run`."""
    out, err = io.StringIO(), io.StringIO()
    code = cmd_run(str(recipe), [*FAST, *overrides], out, err)
    assert code == 0, err.getvalue()[-3000:]
    text = out.getvalue()
    rows = text.split("\n\n")[0].splitlines()[2:]
    statuses = {row.split()[0]: row.split()[1] for row in rows}
    model = Path(text.split("exported model:")[1].split()[0])
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    return statuses, text


@pytest.fixture(scope="module")
def runs(prefect_harness: None, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """With a reward stage, so the promotion gate also runs the head-to-head against the
    champion: a first run, the same again (all reused), then a deliberately worse candidate (one
    SFT step instead of three)."""
    folder = tmp_path_factory.mktemp("e2e")
    recipe = write_recipe(folder, {**TINY, "reward": REWARD, "evaluate": H2H_EVALUATE})
    first, again, worse = _run(recipe), _run(recipe), _run(recipe, "sft.max_steps=1")
    return {"ws": folder / "ws", "first": first, "again": again, "worse": worse}


def test_run_then_reused_then_downstream_only(runs: dict) -> None:
    stages = ("ingest", "sft", "reward", "evaluate", "export")
    assert runs["first"][0] == dict.fromkeys(stages, "ran")
    assert runs["again"][0] == dict.fromkeys(stages, "reused")
    # The reward model takes its chat template from the SFT policy, so it follows the SFT edit.
    assert runs["worse"][0] == {
        "ingest": "reused", "sft": "ran", "reward": "ran", "evaluate": "ran", "export": "ran",
    }  # fmt: skip
    assert len(list((runs["ws"] / "runs").iterdir())) == 3


def test_promotion_gate_promotes_then_refuses_a_worse_candidate(runs: dict) -> None:
    from posttrain.workspace.promotion import read_registry

    assert "promotion:      promoted: first candidate of this pipeline" in runs["first"][1]
    assert "already the champion" in runs["again"][1]  # the same export is the champion
    text = runs["worse"][1]
    assert "promotion:      NOT promoted: regressed: tuned_loss" in text
    reg = read_registry(runs["ws"], "tiny")
    assert [h["promoted"] for h in reg["history"]] == [True, False]
    assert reg["champion"]["run_id"] == reg["history"][0]["run_id"]
    run_dir = Path(text.split("run folder:")[1].split()[0])
    report = (run_dir / "report.md").read_text()
    assert "## Promotion" in report and "| tuned_loss | lower | 0.02 |" in report
    h2h = reg["history"][1]["head_to_head"]
    assert h2h["champion_run_id"] == reg["champion"]["run_id"] and h2h["n"] == 4
    win_rate = reg["history"][1]["metrics"]["win_rate_vs_champion"]
    assert win_rate == h2h["win_rate"] and (h2h["wins"] + h2h["ties"] / 2) / 4 == win_rate
    assert f"| win_rate_vs_champion | higher | 0.05 | {win_rate:.4g} | 0.5 |" in report
    assert f"head-to-head against champion {h2h['champion_run_id']} (ran)" in report
    assert Path(h2h["artifact"]).parent == runs["ws"] / "artifacts" / "head_to_head"


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
