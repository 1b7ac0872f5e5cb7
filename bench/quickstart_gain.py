"""Whether the shipped quickstart, unchanged, still does its job: DPO beats its SFT parent on the
held-out measures (issue 29 point 9), with the figures and ratios that say by how much.

Runs `recipes/quickstart.yaml` on a fresh workspace (the whole pipeline: ~10 minutes on 2 CPU
cores) with one override, `evaluate.policies=[sft,dpo]`, which makes evaluate also score SFT and
changes nothing upstream, so the figures are the recipe's own (README: 0.353 -> 0.427, win-rate
0.65). Prints SFT's and DPO's greedy exact match, their difference and ratio, and DPO's
head-to-head win-rate against its parent under the reward model, then checks what the quickstart
promises and exits 1 when it does not hold:

  every stage ran (a fresh workspace reuses nothing); DPO's parent is SFT;
  DPO's exact match - SFT's >= 0.05 (5 points); DPO wins more than half of the decided
  head-to-heads; the summary's headline exact match is DPO's (rounded to 4 digits there).

    HF_HUB_OFFLINE=1 .venv/bin/python bench/quickstart_gain.py [--workspace DIR] [--json out.json]
                                                               [--set key.path=value ...]

This was the slow test tests/test_quickstart_gain.py: a quality run, not a check of code, so it
runs on its own command (docs/benchmarks.md) and the test suite keeps only its checks' logic.
Flow runs go to whatever PREFECT_API_URL names, else an embedded server in this process.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIN_GAIN = 0.05  # DPO's exact match over SFT's, absolute
MIN_WIN_RATE = 0.5  # DPO's share of the decided head-to-heads against SFT, exclusive


def gain_problems(statuses: dict[str, str], summary: dict[str, Any]) -> list[str]:
    """What the quickstart promises and a run's evaluate summary does not show (empty: all
    holds). `statuses`: each stage's status in the run (`ran`, `reused`, ...)."""
    problems = [f"stage {s} {st}, not ran" for s, st in statuses.items() if st != "ran"]
    sft, dpo = summary["policies"]["sft"], summary["policies"]["dpo"]
    if dpo["parent"] != "sft":
        problems.append(f"DPO's parent is {dpo['parent']!r}, not 'sft'")
    gain = dpo["exact_match"] - sft["exact_match"]
    if not gain >= MIN_GAIN:
        problems.append(f"exact match gain {gain:+.4f} < {MIN_GAIN} (sft {sft}, dpo {dpo})")
    if not dpo["win_rate_vs_parent"] > MIN_WIN_RATE:
        problems.append(f"win-rate vs parent {dpo['win_rate_vs_parent']} <= {MIN_WIN_RATE}")
    headline = summary["headline"]["exact_match_tuned"]
    if abs(headline - dpo["exact_match"]) > 1e-4:
        problems.append(f"headline exact match {headline} is not DPO's {dpo['exact_match']}")
    return problems


def figures(summary: dict[str, Any]) -> dict[str, float]:
    sft, dpo = summary["policies"]["sft"], summary["policies"]["dpo"]
    return {
        "sft_exact_match": sft["exact_match"],
        "dpo_exact_match": dpo["exact_match"],
        "gain": dpo["exact_match"] - sft["exact_match"],
        "ratio": dpo["exact_match"] / sft["exact_match"] if sft["exact_match"] else float("inf"),
        "win_rate_vs_parent": dpo["win_rate_vs_parent"],
    }


def run_quickstart(workspace: Path, overrides: list[str]) -> tuple[dict[str, str], dict]:
    """The quickstart in this process; each stage's status and evaluate's summary."""
    sys.path.insert(0, str(ROOT))
    from flows.prefect_env import apply_prefect_defaults

    apply_prefect_defaults()  # before prefect is imported (flows.post_train imports it)
    from flows.post_train import post_train
    from posttrain.config.loader import load_recipe

    sets = [f"run.workspace={workspace}", "evaluate.policies=[sft,dpo]", *overrides]
    result = post_train(load_recipe(ROOT / "recipes" / "quickstart.yaml", sets))
    by = {r.stage: r for r in result.stages}
    summary = by["evaluate"].summary.model_dump(mode="json", exclude_unset=True)
    return {s: r.status for s, r in by.items()}, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workspace", type=Path, help="a fresh workspace (default: a temp one)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override")
    ap.add_argument("--json", type=Path, help="also save the figures here")
    args = ap.parse_args()
    workspace = (args.workspace or Path(tempfile.mkdtemp(prefix="quickstart-gain-"))).resolve()
    statuses, summary = run_quickstart(workspace, args.set)
    figs = figures(summary)
    print(f"\nquickstart in {workspace}: " + ", ".join(f"{s} {st}" for s, st in statuses.items()))
    print(f"{'policy':8s} {'exact match':>12s}")
    print(f"{'sft':8s} {figs['sft_exact_match']:12.4f}")
    print(f"{'dpo':8s} {figs['dpo_exact_match']:12.4f}")
    print(f"gain {figs['gain']:+.4f} (needs >= {MIN_GAIN}), ratio dpo/sft {figs['ratio']:.3f}x")
    print(f"DPO's win-rate vs SFT {figs['win_rate_vs_parent']:.3f} (needs > {MIN_WIN_RATE})")
    if args.json:
        args.json.write_text(json.dumps({"statuses": statuses, **figs}, indent=2))
    if problems := gain_problems(statuses, summary):
        print("\n".join(["FAILED:", *problems]), file=sys.stderr)
        raise SystemExit(1)
    print("OK: the quickstart's DPO beats its SFT parent")


if __name__ == "__main__":
    main()
