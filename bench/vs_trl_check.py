"""Checks of posttrain against TRL 1.16 that need the `bench` extra (trl), which the test
command never installs: run them after changing the SFT, DPO or GRPO stages, the distillation
losses, or bench/vs_trl.py. Exits 1, listing each failed check, when one fails.

  comparison  bench/vs_trl.py's whole comparison at the tiny size, 3 steps (about two minutes
              on an idle machine, seven process starts): positive figures, the same tokens
              counted on both sides, the first-step losses equal (same base, rows and B = 0
              adapter) and, with the adapter's init seeded alike, the last ones too; the GRPO
              row's step times, completion lengths and posttrain's phase split.
  gkd         our distillation token_mean loss equals TRL's GKDTrainer.generalized_jsd_loss
              ("batchmean" over tokens whose label is not -100), per token and in its gradient,
              on random logits, at beta 0, 0.5 and 1.

    pip install -e .[bench]                     # trl==1.16.0; not a runtime dependency
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl_check.py [--only comparison|gkd]

These were tests (tests/test_bench_vs_trl.py, tests/test_distill_losses.py) that skipped without
trl, so in CI they could never fail.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402 (bench/, on the path above)

ROOT = Path(__file__).resolve().parents[1]


def close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel)


def throughput_problems(r: dict[str, Any]) -> list[str]:
    """An SFT or DPO row of `vs_trl.measure` at 3 steps."""
    p, t, out = r["posttrain"], r["trl"], []
    if not (p["tokens_per_s"] > 0 and t["tokens_per_s"] > 0 and r["ratio"] > 0):
        out.append(f"tokens/s or ratio not positive: {p['tokens_per_s']}, {t['tokens_per_s']}")
    if not (r["median_ratio"] > 0 and r["fast_ratio"] > 0):
        out.append(f"median or fast ratio not positive: {r['median_ratio']}, {r['fast_ratio']}")
    if not p["steps"] == t["steps"] == 3:
        out.append(f"steps {p['steps']} / {t['steps']}, not 3")
    if p["tokens_per_step"] != t["tokens_per_step"]:  # same batches, same real tokens
        out.append(f"tokens per step differ: {p['tokens_per_step']} vs {t['tokens_per_step']}")
    if not r["first_loss_match"]:
        out.append(f"first losses differ: {p['first_loss']} vs {t['first_loss']}")
    if not close(p["last_loss"], t["last_loss"], 1e-3):
        out.append(f"last losses differ: {p['last_loss']} vs {t['last_loss']}")
    if not t["gradient_checkpointing"]:  # TRL's default, kept
        out.append("TRL's gradient checkpointing is off: its default (on) was not kept")
    return [f"{r['stage']}: {x}" for x in out]


def grpo_problems(g: dict[str, Any]) -> list[str]:
    """The GRPO row of `vs_trl.measure` at 3 steps."""
    p, t, out = g["posttrain"], g["trl"], []
    if not p["steps"] == t["steps"] == 3:
        out.append(f"steps {p['steps']} / {t['steps']}, not 3")
    for name, side in (("posttrain", p), ("trl", t)):
        keys = ("step_time_s", "median_step_time_s", "fast_step_time_s", "completion_len")
        if not all(side[k] > 0 for k in keys):
            out.append(f"{name}: a step time or completion length is not positive")
    if not all(g[k] > 0 for k in ("time_ratio", "median_time_ratio", "fast_time_ratio")):
        out.append("a time ratio is not positive")
    if set(p["split"]) != set(vs_trl.RL_SPLIT) or not all(v > 0 for v in p["split"].values()):
        out.append(f"posttrain's phase split {p['split']} is not {vs_trl.RL_SPLIT}, all > 0")
    if not t["split"]["generation_s"] > 0:
        out.append("TRL's generation time is not positive")
    if t["gradient_checkpointing"]:  # the shape, as the stage
        out.append("TRL's gradient checkpointing is on in the GRPO row")
    return [f"grpo: {x}" for x in out]


def check_comparison() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = vs_trl.measure("tiny", 3, ["sft", "dpo", "grpo"], 2, "default", Path(tmp))
    if [r["stage"] for r in rows] != ["sft", "dpo", "grpo"]:
        return [f"rows {[r['stage'] for r in rows]}, not sft, dpo, grpo"]
    return throughput_problems(rows[0]) + throughput_problems(rows[1]) + grpo_problems(rows[2])


def check_gkd() -> list[str]:
    import warnings

    import torch

    sys.path.insert(0, str(ROOT))
    from posttrain.rl.distill_losses import objective_sum, token_divergence

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRLExperimentalWarning
        from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(1)
    b, t, v = 2, 6, 13
    student, teacher = torch.randn(b, t, v) * 3, torch.randn(b, t, v) * 3
    labels = torch.randint(0, v, (b, t))
    labels[0, :2] = -100  # a prompt
    labels[1, 4:] = -100  # padding
    mask = labels != -100
    out = []
    for beta in (0.0, 0.5, 1.0):
        s_ours = student.clone().requires_grad_(True)
        s_trl = student.clone().requires_grad_(True)
        per_token = token_divergence(s_ours, teacher, mask, "jsd", beta=beta, temperature=0.7)
        # The training objective over one micro-batch holding the step's every token.
        ours = objective_sum(per_token, mask, "token_mean") / mask.sum()
        theirs = GKDTrainer.generalized_jsd_loss(
            s_trl, teacher, labels=labels, beta=beta, temperature=0.7
        )
        if abs(ours.item() - theirs.item()) > 1e-6:
            out.append(f"gkd beta {beta}: loss {ours.item()} vs TRL's {theirs.item()}")
        theirs_tokens = GKDTrainer.generalized_jsd_loss(
            student, teacher, labels=labels, beta=beta, temperature=0.7, reduction="none"
        ).sum(-1)  # [n masked tokens, V] -> [n]
        if not torch.allclose(per_token[mask].detach(), theirs_tokens, atol=1e-6):
            out.append(f"gkd beta {beta}: per-token values differ from TRL's")
        ours.backward()
        theirs.backward()
        if not torch.allclose(s_ours.grad, s_trl.grad, atol=1e-6):
            out.append(f"gkd beta {beta}: gradients differ from TRL's")
    return out


CHECKS: dict[str, Callable[[], list[str]]] = {"gkd": check_gkd, "comparison": check_comparison}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=list(CHECKS), help="one check (default: all)")
    args = ap.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit(vs_trl.TRL_MISSING)
    problems = []
    for name, check in CHECKS.items():
        if args.only in (None, name):
            found = check()
            print(f"{name}: {'FAILED' if found else 'ok'}")
            problems += found
    if problems:
        print("\n".join(problems), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
