"""SFT throughput: the posttrain SFT stage vs the same LoRA loop in plain PyTorch.

For two model sizes, runs (1) the real sft stage process (FSDP2 at world size 1, metrics,
checkpoint-free) and (2) a bare loop over the same model, adapter, batches and optimizer, with
no sharding and no telemetry. Prints tokens/s and MFU for each and their ratio, which is what
the stage's orchestration, sharding and telemetry cost. Both run in this one invocation, side by
side, because absolute times on shared CPUs are noisy.

    .venv/bin/python bench/sft_throughput.py            # default: 40 steps per size
    .venv/bin/python bench/sft_throughput.py --steps 80
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    "small": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 256},
    "medium": {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 688},
}


def recipe_for(size: dict, steps: int, workspace: Path) -> dict:
    return {
        "run": {"name": "bench", "workspace": str(workspace), "seed": 0},
        "infra": {"device": "cpu", "devices_per_node": 1},
        "ingest": {
            "source": "from_config",
            "from_config": {
                **size,
                "vocab_size": 2048,
                "max_position_embeddings": 256,
                "pretrain_steps": 0,
                "corpus_examples": 2000,
            },
        },
        "sft": {
            "data": {"synthetic": {"n_examples": 2000}, "max_seq_len": 96},
            "lora": {"r": 16, "alpha": 32},
            "optim": {"lr": 2e-3},
            "batch": {"micro_batch_size": 16, "grad_accum_steps": 1},
            "max_steps": steps,
            "checkpoint_every": 0,
        },
    }


def run_stage(stage: str, recipe: Path) -> float:
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", f"posttrain.stages.{stage}", "--recipe", str(recipe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode:
        sys.exit(f"{stage} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t


def plain_loop(recipe_path: Path, steps: int) -> dict:
    """The same work with nothing around it: peft model, AdamW, the same batches in order."""
    import torch

    from posttrain.config.loader import load_recipe, sft_batch
    from posttrain.data.batching import pad_batch, step_indices
    from posttrain.data.sft_data import prepare
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.models.lora import apply_lora
    from posttrain.pipeline import plan
    from posttrain.telemetry.metrics import (
        matmul_params,
        measure_cpu_matmul_peak,
        train_flops_per_token,
    )
    from posttrain.train.losses import token_nll_sum

    recipe = load_recipe(recipe_path)
    ingest_dir = plan(recipe)[0].out_dir
    tok = load_tokenizer(ingest_dir / "tokenizer")
    model = apply_lora(load_causal_lm(ingest_dir / "model"), recipe.sft.lora)
    data = prepare(recipe.sft.data, tok, recipe.run.seed)
    b = sft_batch(recipe)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=recipe.sft.optim.lr
    )
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_matmul = matmul_params(model)
    cfg = model.config
    tokens = flops = 0.0
    t_total = 0.0
    for step in range(steps):
        idx = step_indices(
            len(data.train),
            step,
            micro=b.micro_batch_size,
            accum=1,
            dp_size=1,
            rank=0,
            seed=recipe.run.seed,
        )[0]
        batch = pad_batch([data.train[i] for i in idx], tok.pad_token_id)
        t = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        nll, n = token_nll_sum(logits, batch["labels"])
        (nll / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t
        if step >= 3:  # skip warm-up steps, as the stage figures below do
            ntok = int(batch["attention_mask"].sum())
            seq = ntok / batch["input_ids"].size(0)
            tokens += ntok
            flops += ntok * train_flops_per_token(
                n_matmul, n_trainable, cfg.num_hidden_layers, cfg.hidden_size, int(seq)
            )
            t_total += dt
    peak = measure_cpu_matmul_peak()
    return {
        "tokens_per_s": tokens / t_total,
        "mfu": flops / t_total / peak,
        "params": sum(p.numel() for p in model.parameters()) - n_trainable,
    }


def stage_figures(recipe_path: Path) -> dict:
    from posttrain.config.loader import load_recipe
    from posttrain.pipeline import plan
    from posttrain.telemetry.metrics import read_metrics

    sft_dir = plan(load_recipe(recipe_path))[1].out_dir
    rows = read_metrics(sft_dir / "metrics.jsonl", "train")[3:]
    secs = sum(r["step_time_s"] for r in rows)
    return {
        "tokens_per_s": sum(r["tokens"] for r in rows) / secs,
        "mfu": sum(r["mfu"] * r["step_time_s"] for r in rows) / secs,
        "tokens_total": sum(r["tokens"] for r in read_metrics(sft_dir / "metrics.jsonl", "train")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes:
            ws = Path(tmp) / name
            ws.mkdir()
            recipe = ws / "recipe.yaml"
            recipe.write_text(yaml.safe_dump(recipe_for(SIZES[name], args.steps, ws / "ws")))
            run_stage("ingest", recipe)
            wall = run_stage("sft", recipe)
            stage = stage_figures(recipe)
            plain = plain_loop(recipe, args.steps)
            rows.append(
                {
                    "size": name,
                    "base_params": plain["params"],
                    "stage_tok_s": stage["tokens_per_s"],
                    "plain_tok_s": plain["tokens_per_s"],
                    "ratio": stage["tokens_per_s"] / plain["tokens_per_s"],
                    "stage_mfu": stage["mfu"],
                    "plain_mfu": plain["mfu"],
                    "stage_wall_s": wall,
                    "stage_wall_tok_s": stage["tokens_total"] / wall,
                }
            )
    print(
        f"\nSFT throughput, {args.steps} steps, micro-batch 16, seq <= 96, fp32 CPU "
        f"({os.cpu_count()} cores); steady state excludes the first 3 steps\n"
    )
    hdr = (
        "size",
        "base params",
        "stage tok/s",
        "plain tok/s",
        "stage/plain",
        "stage MFU",
        "plain MFU",
        "stage wall s",
        "wall tok/s",
    )
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(
            f"{r['size']} | {r['base_params']:,} | {r['stage_tok_s']:.0f} | {r['plain_tok_s']:.0f} | "
            f"{r['ratio']:.2f} | {100 * r['stage_mfu']:.1f}% | {100 * r['plain_mfu']:.1f}% | "
            f"{r['stage_wall_s']:.1f} | {r['stage_wall_tok_s']:.0f}"
        )
    print(
        "\nstage/plain < 1 is the in-loop cost of FSDP2 wrapping, token-count all-reduces and "
        "metrics; 'wall tok/s' also pays process start, imports, data prep and adapter save."
    )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
