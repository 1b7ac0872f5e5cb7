"""AdamW step time on a LoRA parameter list: for-loop vs foreach vs fused (torch's flags).

Builds the bench models of `bench/sft_throughput.py` with LoRA r=16, gives every trainable
parameter a gradient and times `opt.step()` + `zero_grad` for each implementation, on the CPU (or
`--device cuda`). `posttrain.train.optim.build_optimizer` picks by these figures.

    .venv/bin/python bench/adamw_step.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402 (bench/, on the path above)

SIZES = {
    **tiny_models.SIZES,
    "large": {"hidden_size": 1024, "num_layers": 16, "num_heads": 16, "intermediate_size": 2816},
}


def time_step(params: list[torch.nn.Parameter], impl: str, steps: int) -> float:
    kw = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    opt = torch.optim.AdamW(params, lr=1e-3, **kw)
    best = float("inf")
    for i in range(steps + 3):
        for p in params:
            p.grad = torch.randn_like(p)
        if params[0].device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if params[0].device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    print("size | trainable tensors | trainable params | loop ms | foreach ms | fused ms")
    print("--- | --- | --- | --- | --- | ---")
    for name in args.sizes:
        model = tiny_models.lora_model(SIZES[name])
        model.to(args.device)
        params = [p for p in model.parameters() if p.requires_grad]
        ms = {i: 1e3 * time_step(params, i, args.steps) for i in ("loop", "foreach", "fused")}
        print(
            f"{name} | {len(params)} | {sum(p.numel() for p in params):,} | "
            f"{ms['loop']:.2f} | {ms['foreach']:.2f} | {ms['fused']:.2f}"
        )


if __name__ == "__main__":
    main()
