"""Does `torch.compile` pay for a LoRA SFT step? Eager vs the whole model compiled vs each
decoder block compiled, on the `bench/sft_throughput.py` models (micro-batch 16 x 96 tokens,
LoRA r=16, fused AdamW). Reports the first step (compilation included), the steady-state step
(median after 3 warm-up steps) and the wall time of 20 and of `--steps` steps.

    .venv/bin/python bench/compile_step.py            # both sizes, 40 steps
    .venv/bin/python bench/compile_step.py --threads 1 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from posttrain.distributed.fsdp import decoder_blocks
from posttrain.sections.shared import OptimConfig
from posttrain.train.losses import token_nll_sum
from posttrain.train.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import SIZES, lora_model  # noqa: E402 (bench/, on the path above)


def run(size: str, mode: str, steps: int) -> list[float]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = lora_model(SIZES[size])
    model.train()
    if mode == "model":
        model.compile()
    elif mode == "blocks":
        for block in decoder_blocks(model):
            block.compile()
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], OptimConfig())
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        ids = torch.randint(2, 2048, (16, 96), generator=g)
        t = time.perf_counter()
        logits = model(input_ids=ids, use_cache=False).logits
        nll, n = token_nll_sum(logits, ids)
        (nll / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"size | mode | first step s | steady step ms | 20 steps s | {args.steps} steps s")
    print("--- | --- | --- | --- | --- | ---")
    for size in args.sizes:
        for mode in ("eager", "model", "blocks"):
            t = run(size, mode, args.steps)
            print(
                f"{size} | {mode} | {t[0]:.2f} | {1e3 * statistics.median(t[3:]):.1f} | "
                f"{sum(t[:20]):.1f} | {sum(t):.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
