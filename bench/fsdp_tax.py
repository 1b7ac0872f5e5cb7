"""The FSDP2 tax at one device, step by step: the same LoRA SFT step on the plain module (what
`place_model` gives on one device) and on the FSDP2-wrapped one (`infra.shard_single_device`),
alternating every step so load from other jobs hits both alike. Prints the median step time of
each and the median per-pair ratio.

    .venv/bin/python bench/fsdp_tax.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from posttrain.distributed.fsdp import grad_sync, place_model
from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.sections.shared import OptimConfig
from posttrain.train.forward_logps import forward_nll_sum
from posttrain.train.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import SIZES, lora_model  # noqa: E402 (bench/, on the path above)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    d = init_distributed("cpu", 120, args.threads)
    print("size | plain step ms | FSDP2 step ms | plain/FSDP2 time (median of pairs)")
    print("--- | --- | --- | ---")
    for size in args.sizes:
        models, opts = [], []
        for shard in (False, True):
            torch.manual_seed(0)
            m = lora_model(SIZES[size])
            m = place_model(m, d.mesh, "fp32", shard_single_device=shard)
            models.append(m)
            opts.append(
                build_optimizer([p for p in m.parameters() if p.requires_grad], OptimConfig())
            )
        g = torch.Generator().manual_seed(1)
        times: list[list[float]] = [[], []]
        for step in range(args.steps + 3):
            ids = torch.randint(2, 2048, (16, 96), generator=g)
            batch = {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(96).expand(16, 96),
                "labels": ids,
            }
            for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
                t = time.perf_counter()
                grad_sync(m, True)
                nll, n = forward_nll_sum(m, batch, 2048)
                (nll / n).backward()
                torch.nn.utils.clip_grad_norm_([p for p in m.parameters() if p.requires_grad], 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= 3:
                    times[i].append(time.perf_counter() - t)
        ratio = statistics.median(a / b for a, b in zip(*times, strict=True))
        print(
            f"{size} | {1e3 * statistics.median(times[0]):.0f} | "
            f"{1e3 * statistics.median(times[1]):.0f} | {ratio:.2f}",
            flush=True,
        )
    shutdown()


if __name__ == "__main__":
    main()
