"""bench/quickstart_gain.py: its checks of the quickstart's DPO gain, and its command line. The
run itself (the whole quickstart, ~10 minutes) is a bench, not a test (docs/benchmarks.md)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from bench import quickstart_gain

ROOT = Path(__file__).resolve().parents[1]
RAN = {s: "ran" for s in ("ingest", "sft", "reward", "dpo", "evaluate", "export")}
# The README's figures: 0.353 -> 0.427, win-rate 0.65.
SUMMARY = {
    "policies": {
        "sft": {"exact_match": 0.353},
        "dpo": {"exact_match": 0.427, "parent": "sft", "win_rate_vs_parent": 0.65},
    },
    "headline": {"exact_match_tuned": 0.427},
}


def test_the_readme_s_figures_pass_and_give_their_ratio() -> None:
    assert quickstart_gain.gain_problems(RAN, SUMMARY) == []
    figs = quickstart_gain.figures(SUMMARY)
    assert figs["gain"] == pytest.approx(0.074)
    assert figs["ratio"] == pytest.approx(0.427 / 0.353)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (("dpo", "exact_match", 0.40), "exact match gain"),  # +4.7 points < 5
        (("dpo", "win_rate_vs_parent", 0.5), "win-rate"),  # half is not more than half
        (("dpo", "parent", "base"), "parent"),
    ],
)
def test_each_promise_fails_on_its_own(change: tuple, problem: str) -> None:
    summary = copy.deepcopy(SUMMARY)
    policy, key, value = change
    summary["policies"][policy][key] = value
    summary["headline"]["exact_match_tuned"] = summary["policies"]["dpo"]["exact_match"]
    problems = quickstart_gain.gain_problems(RAN, summary)
    assert len(problems) == 1 and problem in problems[0], problems


def test_a_reused_stage_or_another_headline_fails() -> None:
    summary = copy.deepcopy(SUMMARY)
    summary["headline"]["exact_match_tuned"] = 0.4271  # within the 4-digit rounding: fine
    assert quickstart_gain.gain_problems(RAN, summary) == []
    summary["headline"]["exact_match_tuned"] = 0.353
    problems = quickstart_gain.gain_problems({**RAN, "sft": "reused"}, summary)
    assert len(problems) == 2 and "sft reused" in problems[0] and "headline" in problems[1]


def test_help_parses_its_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quickstart_gain.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "--workspace" in proc.stdout, proc.stderr
