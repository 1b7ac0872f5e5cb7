"""What an RL step saves by scoring only with the roles it needs (`posttrain.rl.setup.
scoring_passes`): the real GRPO stage, in this process, twice on the same recipe and parents.

The recipe is the shape where both passes can go: `kl.coef: 0` (nothing reads the
reference) and one optimizer step per rollout (one update epoch, micro-batch = the rollout's
sequences), so the update's own log-probs are the sampling policy's. Once with every pass (the
policy's and the reference's no-grad forward over the rollout before the update: how every step
ran before), once with the needed ones only. Both start from the same SFT policy with the same
seeds: the same rollouts, and the same update up to rounding.

A tiny from-config Llama (--hidden/--layers), fp32, world size 1, a token-similarity reward
against the quickstart prompts' references (continuous, so every group trains); ingest and SFT run once in a temporary workspace. Printed: medians
over the logged steps after the first of scoring, generation and update seconds and of the whole
step, the ratio, and how far the two final adapters are apart.

    python bench/scoring_passes.py [--steps 8] [--hidden 256] [--layers 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from posttrain.rl import setup as rl_setup
from posttrain.telemetry.records import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import rl_parents, run_stage  # noqa: E402 (bench/, on the path above)


def recipe(ws: Path, args: argparse.Namespace) -> dict[str, Any]:
    rows = args.prompts * args.samples  # one update per rollout: micro = the rollout
    return rl_parents(ws, args.hidden, args.layers, args.threads) | {
        "grpo": {
            "data": {"synthetic": {"n_examples": 400, "seed": 9}, "eval_fraction": 0.05},
            "rollout": {
                "prompts_per_step": args.prompts,
                "samples_per_prompt": args.samples,
                "max_new_tokens": args.new_tokens,
            },
            # continuous rewards, so that every group has advantages to train on
            "rewards": [{"fn": "posttrain.rewards.match:token_similarity"}],
            "missing_eos_penalty": -1.0,
            "kl": {"coef": 0.0},
            "update_epochs": 1,
            "batch": {"micro_batch_size": rows, "grad_accum_steps": 1},
            "max_steps": args.steps,
            "checkpoint_every": 0,
            "eval_prompts": 4,
            "max_kl": None,
        },
    }


@contextmanager
def passes_used(force_every: bool) -> Iterator[list[tuple[bool, bool]]]:
    """The (policy, reference) scoring passes the stage decided on, one entry per setup; with
    `force_every`, both passes whatever the recipe: the stage as it ran before."""
    real = rl_setup.scoring_passes
    seen: list[tuple[bool, bool]] = []

    def record(*a: Any) -> tuple[bool, bool]:
        seen.append((True, True) if force_every else real(*a))
        return seen[-1]

    rl_setup.scoring_passes = record
    try:
        yield seen
    finally:
        rl_setup.scoring_passes = real


def figures(out: Path) -> dict[str, Any]:
    train = read_metrics(out / "metrics.jsonl", "train")[1:]  # the first step warms up
    med = {k: statistics.median(r[k] for r in train) for k in ("generation_s", "scoring_s")}
    med["training_s"] = statistics.median(r["training_s"] for r in train)
    med["step_s"] = statistics.median(
        r["generation_s"] + r["scoring_s"] + r["training_s"] for r in train
    )
    med["loss"] = train[-1]["loss"]
    from safetensors.torch import load_file

    med["adapter"] = load_file(out / "adapter" / "adapter_model.safetensors")
    return med


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="scoring-passes-") as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe(Path(tmp) / "ws", args)))
        run_stage("ingest", path)
        run_stage("sft", path)
        with passes_used(force_every=True) as full_passes:
            out = run_stage("grpo", path)
        full = figures(out)
        shutil.rmtree(out)
        with passes_used(force_every=False) as own_passes:
            own = figures(run_stage("grpo", path))
    diff = max(float((full["adapter"][k] - own["adapter"][k]).abs().max()) for k in own["adapter"])
    print(
        f"GRPO, {args.prompts} prompts x {args.samples} samples, {args.new_tokens} new tokens, "
        f"hidden {args.hidden}, {args.layers} layers, kl.coef 0, one update per rollout; medians "
        f"of {args.steps - 1} steps after the first"
    )
    print("passes | scoring s | generation s | update s | step s")
    for name, m in (("policy + reference + reward", full), ("reward only", own)):
        print(
            f"{name:27s} | {m['scoring_s']:9.3f} | {m['generation_s']:12.3f} | "
            f"{m['training_s']:8.3f} | {m['step_s']:6.3f}"
        )
    ratio = own["step_s"] / full["step_s"]
    print(
        f"step time, needed passes / every pass: {ratio:.2f}x; scoring "
        f"{own['scoring_s'] / full['scoring_s']:.2f}x; final adapters differ by at most "
        f"{diff:.1e}, last losses {full['loss']:.5f} / {own['loss']:.5f}"
    )
    return {
        "ratio": ratio,
        "diff": diff,
        "scoring_full": full["scoring_s"],
        "scoring_own": own["scoring_s"],
        "loss": own["loss"],
        "passes_full": full_passes,
        "passes_own": own_passes,
    }


if __name__ == "__main__":
    main()
