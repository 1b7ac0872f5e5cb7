"""GPU check: SFT and DPO on random-init Qwen2.5-0.5B and -1.5B shapes in bf16, with the figures an
SRE asks for first.

For each shape it builds the model offline (`ingest.from_config.shape`: real width, depth, heads
and 151,936-row vocabulary, random weights), writes long synthetic conversations and preference
pairs (so steps run at a realistic sequence length, not the quickstart's ~60 tokens), and runs the
real stages (`posttrain launch <stage> recipe.yaml`, called in this process: the supervisor and
stage processes the flow starts) for a few dozen steps. Then it prints, per stage: tokens/s per
GPU, MFU, peak allocated and reserved memory, and the memory pre-flight's estimate beside the
measured peak.

Then the RL part (`--rl-steps`, 0 skips it), in the same workspace: GRPO on the first shape
(sampling with the policy's own weights, verifier rewards) and on-policy distillation of the first
shape from the last (the teacher frozen beside the student, its base in bf16), from the random
bases: what their steps cost on the GPU (sampled tokens/s, the share of each phase, memory), not
what they learn.

    bash bench/gpu_check.sh                     # on a machine with a GPU
    python bench/gpu_check.py --shapes qwen2.5-0.5b --sft-steps 40 --seq 2048
    python bench/gpu_check.py --cpu-smoke       # the same path, shrunk, on CPU (minutes)

Needs no hub access. Writes under --work (default a temp folder) and removes nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from posttrain.data.synthetic import WORDS as NOUNS
from posttrain.telemetry.records import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# Function words, so the text is not a list of nouns, and the quickstart's own vocabulary.
WORDS = ["the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", *NOUNS]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def write_data(folder: Path, rows: int, words: int, seed: int = 0) -> tuple[Path, Path]:
    """SFT conversations (a short question, an answer of `words` words) and preference pairs
    (two answers of half that each), as JSONL in the shapes users bring."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    sft, pref = folder / "sft.jsonl", folder / "pref.jsonl"
    with sft.open("w") as f:
        for _ in range(rows):
            msgs = [
                {"role": "user", "content": _text(rng, 48)},
                {"role": "assistant", "content": _text(rng, words)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with pref.open("w") as f:
        for _ in range(rows):
            row = {
                "prompt": _text(rng, 48),
                "chosen": _text(rng, words // 2),
                "rejected": _text(rng, words // 2),
            }
            f.write(json.dumps(row) + "\n")
    return sft, pref


def recipe(
    work: Path, shape: str, args: argparse.Namespace, sft_data: Path, pref_data: Path
) -> dict[str, Any]:
    model: dict[str, Any] = {
        "shape": shape,
        "max_position_embeddings": max(4096, args.seq),
        "pretrain_steps": 0,
        "corpus_examples": 400,
    }
    if args.cpu_smoke:  # the same code path at a size CPU runs in minutes
        model |= {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128}
    train = {
        "optim": {"lr": 1e-4, "warmup_steps": 2},
        "batch": {"micro_batch_size": args.micro, "grad_accum_steps": 1},
        "log_every": 1,
        "checkpoint_every": 0,
    }
    return {
        "run": {
            "name": f"gpu-check-{shape}",
            "workspace": str(work / "ws"),
            "seed": 0,
            "allowed_paths": [str(sft_data.parent)],  # the generated data sits beside, not inside
        },
        "infra": {
            "device": "cpu" if args.cpu_smoke else "cuda",
            "devices_per_node": 1,
            "precision": "fp32" if args.cpu_smoke else "bf16",
            "base_dtype": "auto",
            "attention": args.attention,
            # The smoke's stages are tiny: a second thread per stage only adds handoffs (and
            # waits for a core on a shared machine). On a GPU the default (cores per rank).
            "threads_per_rank": 1 if args.cpu_smoke else None,
        },
        "ingest": {"source": "from_config", "from_config": model},
        "sft": {
            "data": {"path": str(sft_data), "eval_fraction": 0.0, "max_seq_len": args.seq},
            "lora": {"r": 16, "alpha": 32},
            "max_steps": args.sft_steps,
            **train,
        },
        "dpo": {
            "data": {
                "path": str(pref_data),
                "eval_fraction": 0.0,
                "max_seq_len": args.seq,
                "max_prompt_len": min(256, args.seq // 4),
            },
            "beta": 0.1,
            "max_steps": args.dpo_steps,
            **train,
        },
    }


def rl_recipe(base: dict[str, Any], shapes: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """`base` (the first shape's recipe: its ingest and SFT are reused from the workspace) with
    the RL stages from its SFT: GRPO, and distillation from a base of the last shape."""
    teacher = base["ingest"]["from_config"] | {"shape": shapes[-1]}
    if args.cpu_smoke:  # twice the student's width, as a teacher is larger
        teacher |= {"hidden_size": 128, "num_heads": 4, "intermediate_size": 256}
    common = {
        "data": {"synthetic": {"n_examples": 400, "seed": 0}, "eval_fraction": 0.05},
        "rollout": {
            "prompts_per_step": args.rl_prompts,
            "samples_per_prompt": args.rl_samples,
            "max_new_tokens": args.rl_new_tokens,
            "temperature": 1.0,
        },
        "rewards": [{"fn": "posttrain.rewards.match:exact_match"}],
        "optim": {"lr": 1e-5, "warmup_steps": 1},
        "batch": {"micro_batch_size": args.micro, "grad_accum_steps": 1},
        "max_steps": args.rl_steps,
        "log_every": 1,
        "checkpoint_every": 0,
        # The held-out KL and reward, on a few prompts (one on CPU: each is sampled from the
        # policy and from its start, and costs there as much as a training step).
        "eval_prompts": 1 if args.cpu_smoke else 4,
    }
    stages = [
        {"kind": "ingest", "name": "teacher_base", "source": "from_config", "from_config": teacher},
        {"kind": "grpo", "name": "grpo", "from": "sft", **common},
        {"kind": "distill", "name": "distill", "from": "sft", "teacher": "teacher_base", **common},
    ]
    rest = {k: v for k, v in base.items() if k != "dpo"}
    return rest | {"run": base["run"] | {"name": "gpu-check-rl"}, "stages": stages}


def run_stage(stage: str, recipe_path: Path, log: Path, name: str | None = None) -> None:
    """`posttrain launch` of the recipe's stage `name` (default: the one named `stage`), run in
    this process (`cmd_launch`, what the command runs: the supervisor here, the stage a process
    of its own): the supervisor's imports are paid once for all the stages, not per stage."""
    from flows.cli import cmd_launch

    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = cmd_launch(name or stage, str(recipe_path), [], f, f)
    tail = log.read_text().splitlines()[-15:]
    if rc:
        raise SystemExit(f"{name or stage} failed (exit {rc}); log {log}:\n" + "\n".join(tail))
    print(f"  {name or stage:12s} done in {time.perf_counter() - t0:6.1f} s", flush=True)


def _stage_records(stage_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A stage's train records, and what every table reports beside them: its parameters, the
    memory peaks at its end (peak RSS on CPU) and the pre-flight's estimate."""
    recs = read_metrics(stage_dir / "metrics.jsonl")
    end = next(r for r in recs if r["kind"] == "end")
    pre = next((r for r in recs if r["kind"] == "preflight"), {})
    return [r for r in recs if r["kind"] == "train"], {
        "params": next(r for r in recs if r["kind"] == "start")["params_total"],
        "peak_allocated_gib": end.get("mem_peak_allocated_gib", end.get("mem_peak_rss_gib")),
        "peak_reserved_gib": end.get("mem_peak_reserved_gib"),
        "estimate_gib": pre.get("estimate_gib"),
    }


def figures(stage_dir: Path) -> dict[str, Any]:
    """Median throughput over the steps after warm-up, the memory peaks and the estimate."""
    train, common = _stage_records(stage_dir)
    steady = train[len(train) // 4 :] or train
    return {
        **common,
        "tokens_per_s_per_device": statistics.median(r["tokens_per_s_per_device"] for r in steady),
        "tflops_per_device": statistics.median(r["tflops_per_device"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady),
        "tokens_per_step": statistics.median(r["tokens"] for r in steady),
    }


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """The SFT and DPO figures, one row a stage, the estimate over the allocated peak last."""
    head = (
        f"{'run':22s} {'params':>8s} {'tok/step':>8s} {'tok/s/GPU':>10s} {'TFLOP/s':>8s} "
        f"{'MFU':>6s} {'alloc GiB':>9s} {'resv GiB':>8s} {'est GiB':>8s} {'est/alloc':>9s}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for name, r in results.items():
        ratio = (r["estimate_gib"] or 0) / r["peak_allocated_gib"] if r["peak_allocated_gib"] else 0
        resv = r["peak_reserved_gib"]
        print(
            f"{name:22s} {r['params'] / 1e6:7.0f}M {r['tokens_per_step']:8.0f} "
            f"{r['tokens_per_s_per_device']:10.0f} {r['tflops_per_device']:8.1f} "
            f"{r['mfu']:6.1%} {r['peak_allocated_gib']:9.2f} "
            f"{resv if resv is not None else float('nan'):8.2f} "
            f"{r['estimate_gib'] or float('nan'):8.2f} {ratio:9.2f}"
        )


def rl_figures(stage_dir: Path, answers: int) -> dict[str, Any]:
    """An RL step's phases (medians after the first step, which compiles and warms caches):
    seconds generating, scoring and updating, sampled tokens/s (`answers` a step), and the
    memory peaks."""
    train, common = _stage_records(stage_dir)
    steady = train[1:] or train

    def med(key: str) -> float:
        return statistics.median(float(r.get(key, float("nan"))) for r in steady)

    return {
        **common,
        "generation_s": med("generation_s"),
        "scoring_s": med("scoring_s"),
        "training_s": med("training_s"),
        "response_len": med("response_len"),
        "sampled_tokens_per_s": statistics.median(
            r["response_len"] * answers / r["generation_s"] for r in steady
        ),
        "tflops_per_device": med("tflops_per_device"),
        "mfu": med("mfu"),
    }


def print_rl(rl: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    head = (
        f"{'RL step':22s} {'answers':>7s} {'len':>5s} {'gen s':>6s} {'score s':>7s} "
        f"{'train s':>7s} {'sampled tok/s':>13s} {'MFU':>6s} {'alloc GiB':>9s} "
        f"{'resv GiB':>8s} {'est GiB':>8s}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for name, r in rl.items():
        resv = r["peak_reserved_gib"]
        print(
            f"{args.shapes[0] + ' ' + name:22s} {args.rl_prompts * args.rl_samples:7d} "
            f"{r['response_len']:5.0f} {r['generation_s']:6.2f} {r['scoring_s']:7.2f} "
            f"{r['training_s']:7.2f} {r['sampled_tokens_per_s']:13.0f} {r['mfu']:6.1%} "
            f"{r['peak_allocated_gib']:9.2f} {resv if resv is not None else float('nan'):8.2f} "
            f"{r['estimate_gib'] or float('nan'):8.2f}"
        )


def health_line(stage_dir: Path) -> str:
    """What NVML read on rank 0's GPU in its last health sample of the stage (logs/health/)."""
    from posttrain.telemetry.health import read_health

    sample = read_health(stage_dir).get(0)
    if sample is None:
        return "no health sample"
    if not sample["gpus"]:
        return f"nvml {sample['sources'].get('nvml')}"
    g = sample["gpus"][0]
    held = [r for r, on in g.get("throttle", {}).items() if on] or ["none"]
    parts = [
        f"GPU {g.get('index')} {g.get('name')}",
        f"{g.get('power_w', float('nan')):.0f}/{g.get('power_limit_w', float('nan')):.0f} W",
        f"{g.get('temperature_c')} C",
        f"SM {g.get('sm_clock_mhz')}/{g.get('sm_clock_max_mhz')} MHz",
        f"throttle {','.join(held)}",
        f"ECC {g.get('ecc_corrected')}/{g.get('ecc_uncorrected')}",
        f"PCIe tx {g.get('pcie_tx_bytes_per_s', float('nan')) / 1e9:.2f} GB/s",
        f"NVLink tx {g.get('nvlink_tx_bytes_per_s', float('nan')) / 1e9:.2f} GB/s",
        f"mem {g.get('memory_used_bytes', float('nan')) / 2**30:.1f} GiB",
    ]
    return ", ".join(parts)


def stage_dir(ws: Path, stage: str) -> Path:
    dirs = sorted((ws / "artifacts" / stage).iterdir(), key=lambda p: p.stat().st_mtime)
    return dirs[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--dpo-steps", type=int, default=20)
    ap.add_argument("--micro", type=int, default=8, help="micro-batch rows")
    ap.add_argument("--seq", type=int, default=1024, help="max sequence length")
    ap.add_argument("--attention", default="sdpa", help="infra.attention (sdpa or flash)")
    ap.add_argument("--rl-steps", type=int, default=6, help="GRPO and distill steps (0: none)")
    ap.add_argument("--rl-prompts", type=int, default=16, help="prompts per RL step")
    ap.add_argument("--rl-samples", type=int, default=8, help="answers per prompt")
    ap.add_argument("--rl-new-tokens", type=int, default=256, help="longest answer sampled")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--cpu-smoke", action="store_true", help="shrunk shapes, CPU, fp32")
    args = ap.parse_args()
    # What the stage processes inherit (the supervisor passes its environment on).
    os.environ |= {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    # Stages of a few dozen steps: a health sample every second, so the last one is mid-run.
    os.environ.setdefault("POSTTRAIN_HEALTH_INTERVAL_S", "1")
    if args.cpu_smoke:
        args.sft_steps, args.dpo_steps, args.micro, args.seq = 3, 2, 2, 128
        args.rl_steps, args.rl_prompts, args.rl_samples, args.rl_new_tokens = 2, 2, 2, 16
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    words = max(16, int(args.seq * 0.6))  # ~1.2 tokens per word: rows fill most of --seq
    sft_data, pref_data = write_data(work / "data", rows=64 * args.micro, words=words)
    results: dict[str, dict[str, Any]] = {}
    health: dict[str, str] = {}
    ws = work / "ws"  # one workspace: the RL part reuses the first shape's ingest
    for shape in args.shapes:
        print(f"{shape}:", flush=True)
        folder = work / shape
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe(work, shape, args, sft_data, pref_data)))
        for stage in ("ingest", "sft", "dpo"):
            run_stage(stage, path, folder / f"{stage}.log")
            if stage != "ingest":
                results[f"{shape} {stage}"] = figures(stage_dir(ws, stage))
                health[f"{shape} {stage}"] = health_line(stage_dir(ws, stage))
    # Printed and saved before the RL part, so that a run cut short keeps them.
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    rl: dict[str, dict[str, Any]] = {}
    if args.rl_steps:
        first = recipe(work, args.shapes[0], args, sft_data, pref_data)
        path = work / "rl.yaml"
        path.write_text(yaml.safe_dump(rl_recipe(first, args.shapes, args)))
        print(f"RL: GRPO on {args.shapes[0]}, distilled from {args.shapes[-1]}:", flush=True)
        # Its ingest is the first shape's, complete in the workspace (the same section, so the
        # same fingerprint): a launch of it would only start a process to find it there.
        for stage, name in (("ingest", "teacher_base"), ("grpo", "grpo")):
            run_stage(stage, path, work / f"rl-{name}.log", name)
        run_stage("distill", path, work / "rl-distill.log", "distill")
        for name in ("grpo", "distill"):
            rl[name] = rl_figures(stage_dir(ws, name), args.rl_prompts * args.rl_samples)
            health[f"{args.shapes[0]} {name}"] = health_line(stage_dir(ws, name))

    if rl:
        print_rl(rl, args)
    print("\nlast health sample (NVML, rank 0) of each stage:")
    for name, line in health.items():
        print(f"  {name:22s} {line}")
    if args.cpu_smoke:
        print("(CPU smoke: 'alloc' is the peak RSS, MFU against this CPU's measured fp32 peak)")
    if args.json:
        args.json.write_text(json.dumps(results | {f"rl {k}": v for k, v in rl.items()}, indent=2))


if __name__ == "__main__":
    main()
