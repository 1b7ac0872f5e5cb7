"""What MKL's reproducible mode (`MKL_CBWR=AUTO,STRICT`, set by importing posttrain) costs and what
it buys (decision 71, issue 39).

Each mode runs in a process of its own (MKL reads the mode once, at its first call): the default
(MKL started before posttrain was imported) and the pinned one. Side by side, per mode:

- matmul GFLOP/s at shapes of LoRA training and decoding (best of repeated bursts);
- a LoRA training step (forward + backward + AdamW) of a from-config Llama, fp32, median time;
- how many different products the same values give at four addresses (offsets of 0-3 floats)
  and 1-3 threads: 1 is reproducible.

    python bench/numerics_pin.py [--hidden 256] [--layers 4] [--tokens 1024] [--threads 2]
                                 [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, statistics, sys, time
import torch
mode, hidden, layers, tokens, threads = sys.argv[1], *map(int, sys.argv[2:6])
if mode == "default":
    torch.ones(8, 8) @ torch.ones(8, 8)  # MKL starts here, before posttrain can pin it
import posttrain
from posttrain.numerics import distinct_products, mkl_mode
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
torch.set_num_threads(threads)
torch.manual_seed(0)

def gflops(m, k, n):
    a, b = torch.randn(m, k), torch.randn(n, k)
    for _ in range(3):
        a @ b.t()
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(5):
            a @ b.t()
        best = min(best, (time.perf_counter() - t) / 5)
    return 2 * m * k * n / best / 1e9

shapes = [(tokens, hidden, hidden), (tokens, hidden, 4 * hidden), (tokens, hidden, 16),
          (8, hidden, hidden), (8, hidden, 8192)]
matmul = {f"{m}x{k}x{n}": gflops(m, k, n) for m, k, n in shapes}

cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                  num_attention_heads=max(1, hidden // 64), vocab_size=8192,
                  max_position_embeddings=tokens)
model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=16, target_modules="all-linear"))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, 8192, (1, tokens))
times = []
for step in range(8):
    t = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - t)

outcomes = distinct_products()
print(json.dumps({"mode": mkl_mode(), "matmul": matmul,
                  "step_s": statistics.median(times[2:]), "outcomes": outcomes}))
"""


def measure(mode: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    cmd = [sys.executable, "-c", WORKER, mode]
    cmd += [str(x) for x in (args.hidden, args.layers, args.tokens, args.threads)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="processes per mode (best of them)")
    args = ap.parse_args(argv)
    # Alternated, twice each by default: these machines are shared and noisy.
    runs = {"default": [], "pinned": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(measure(mode, args))
    best = {
        mode: {
            "mode": rs[0]["mode"],
            "matmul": {s: max(r["matmul"][s] for r in rs) for s in rs[0]["matmul"]},
            "step_s": min(r["step_s"] for r in rs),
            "outcomes": max(r["outcomes"] for r in rs),
        }
        for mode, rs in runs.items()
    }
    d, p = best["default"], best["pinned"]
    print(f"MKL mode: default run {d['mode']}, pinned run {p['mode']}")
    print(f"{'matmul (GFLOP/s, best)':<26}{'default':>10}{'pinned':>10}{'ratio':>8}")
    for shape in d["matmul"]:
        a, b = d["matmul"][shape], p["matmul"][shape]
        print(f"{shape:<26}{a:>10.1f}{b:>10.1f}{b / a:>8.2f}")
    ratio = d["step_s"] / p["step_s"]
    print(f"{'LoRA step (s, median)':<26}{d['step_s']:>10.3f}{p['step_s']:>10.3f}{ratio:>8.2f}")
    print(f"{'products of same values':<26}{d['outcomes']:>10}{p['outcomes']:>10}")
    return best


if __name__ == "__main__":
    main()
