"""Sequence parallelism: peak memory per rank and step time of SFT's step at N = 1, 2 (4).

The same global batch - one padding-free micro-batch of T tokens (packed rows of at most
`--row-tokens`, the first PROMPT_TOKENS of each unscored) - at growing T, on N ranks of one
sequence-parallel group (`infra.sequence_parallel: N`, one data-parallel group), each rank
launched by torchrun: gloo on CPU, NCCL with `--device cuda`.

What a step runs is SFT's step as the stage runs it, without the stage around it (recipe,
data, workspace): a random-init Llama with a LoRA adapter on every linear (`apply_lora`,
r=16), placed as the stage places it (`place_model`: FSDP2 over the N ranks' dp_sp mesh, or
unwrapped on one rank), the rank's shard of the micro-batch (`split_batch`, as
`Training.lay_out` splits it; N = 1 takes the flat batch whole), the loss through the chunked
head (`forward_nll_sum` -> `shard_logps` under N > 1), backward (the all-to-alls of Ulysses
attention), clipping and fused AdamW (`build_optimizer`).

Memory per rank, measured honestly:
  CPU   RSS. glibc keeps freed heap, so a second step would reuse the first step's pages and
        show no growth: the ranks run with MALLOC_MMAP_THRESHOLD_=65536 (tensors above 64 KiB
        mmapped, returned on free). Before each timed step the kernel's peak RSS is reset
        (`/proc/self/clear_refs` 5); `base` is the RSS then (runtime, weights, optimizer
        state: everything held between steps) and `peak` the step's VmHWM; `step` = peak - base
        is what the step adds (activations, the head's chunks, gathered weights, gradients).
  CUDA  torch's allocator: base = memory_allocated before the step, peak = max_memory_allocated
        during it (reset before).
One warm-up step per length first (allocator and autograd caches, AdamW state), then `--steps`
timed steps: the median step seconds, the largest peak. Beside each row: the memory pre-flight's
activations term per rank for the same recipe (`posttrain.memory.estimate`, micro 1 x max_seq_len
T, chunk as run, `infra.sequence_parallel` N) and its whole step phase (activations + logits +
gathered weights).

    python bench/sequence_parallel.py                          # CPU: 2k..16k tokens, N = 1, 2
    python bench/sequence_parallel.py --sizes 1 2 4 --lengths 4096 16384
    python bench/sequence_parallel.py --device cuda --sizes 1 2 4 8 --lengths 8192 32768 65536
    python bench/sequence_parallel.py --cpu-smoke              # a tiny shape, seconds

Measured: see docs/multi-node.md ("When to use sequence parallelism").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS = 64
LORA_R = 16
MIB = 2**20
# The bench's Llama: small enough for CPU steps of 16k tokens in seconds, 8 heads so N = 2, 4
# (and 8) split them; `--cpu-smoke` the same layout shrunk.
SHAPES = {
    "small": {
        "hidden": 256,
        "layers": 4,
        "heads": 8,
        "kv_heads": 4,
        "intermediate": 688,
        "vocab": 8192,
    },
    "smoke": {
        "hidden": 64,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab": 512,
    },
}


@dataclass(frozen=True)
class Plan:
    shape: str
    lengths: tuple[int, ...]
    sizes: tuple[int, ...]
    steps: int
    row_tokens: int
    chunk: int
    device: str
    checkpointing: bool = False  # sft.activation_checkpointing


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--steps", type=int, default=2, help="timed steps per length (after 1 warm-up)")
    p.add_argument("--row-tokens", type=int, default=2048, help="longest packed row")
    p.add_argument("--chunk", type=int, default=2048, help="infra.logits_chunk_tokens")
    p.add_argument("--shape", choices=tuple(SHAPES), default="small")
    p.add_argument("--checkpointing", action="store_true", help="sft.activation_checkpointing")
    p.add_argument("--cpu-smoke", action="store_true", help="smoke shape, 2 lengths, N = 1, 2")
    p.add_argument("--json", type=Path, help="write the rows here too")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a rank: its output folder
    p.add_argument("--plan", help=argparse.SUPPRESS)  # the Plan, as JSON, for a rank
    return p.parse_args(argv)


def plan_of(args: argparse.Namespace) -> Plan:
    if args.cpu_smoke:
        return Plan("smoke", (256, 1024), (1, 2), 1, 256, 128, "cpu")
    return Plan(
        args.shape,
        tuple(args.lengths),
        tuple(args.sizes),
        args.steps,
        args.row_tokens,
        args.chunk,
        args.device,
        args.checkpointing,
    )


# ---- the parent: one torchrun launch per N, then the table ----


def launch(plan: Plan, n: int, out: Path) -> None:
    """The N ranks of one sequence-parallel group through torchrun; each writes rank<r>.json.
    The parent holds no model: each rank's memory is its own."""
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    if plan.device == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed tensors leave RSS (see the docstring)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        str(Path(__file__).resolve()),
        "--worker",
        str(out),
        "--plan",
        json.dumps(asdict(plan)),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"N={n} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def estimate_rows(plan: Plan, tokens: int, n: int) -> tuple[int, int]:
    """The pre-flight's (activations per rank, whole step phase per rank) in bytes for this
    recipe: micro 1 x max_seq_len `tokens`, LoRA r16 on every linear, fp32 on CPU (bf16 base on
    CUDA), sequence_parallel n over n ranks."""
    from posttrain.memory.estimate import Adapter, DeviceLayout, ModelShape, StageShape, estimate

    s = SHAPES[plan.shape]
    model = ModelShape(
        hidden=s["hidden"],
        layers=s["layers"],
        heads=s["heads"],
        kv_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"],
        intermediate=s["intermediate"],
        vocab=s["vocab"],
        tied=False,
    )
    cuda = plan.device == "cuda"
    stage = StageShape(
        kind="lm",
        micro_batch=1,
        seq_len=tokens,
        adapters=(Adapter("policy", LORA_R, "all-linear", True),),
        precision="bf16" if cuda else "fp32",
        base_dtype="bf16" if cuda else "fp32",
        logits_chunk_tokens=plan.chunk,
        activation_checkpointing=plan.checkpointing,
        padding_free=True,  # the ranks run `flat_batch`'s rows end to end, as SFT does
    )
    layout = DeviceLayout(world=n, device=plan.device, sequence_parallel=n)  # type: ignore[arg-type]
    est = estimate(model, stage, layout, overhead_bytes=0)
    return est.component("activations"), est.phase_totals()["step"]


def collect(plan: Plan, folder: Path) -> list[dict[str, Any]]:
    """One row per (tokens, N): the ranks' figures (the largest rank's memory, the slowest
    rank's step) and the estimate beside them."""
    rows = []
    for n in plan.sizes:
        ranks = [json.loads((folder / f"n{n}" / f"rank{r}.json").read_text()) for r in range(n)]
        for i, tokens in enumerate(plan.lengths):
            per = [r["lengths"][i] for r in ranks]
            act, step_phase = estimate_rows(plan, tokens, n)
            rows.append(
                {
                    "tokens": tokens,
                    "n": n,
                    "base_mib": max(p["base"] for p in per) / MIB,
                    "peak_mib": max(p["peak"] for p in per) / MIB,
                    "step_mib": max(p["peak"] - p["base"] for p in per) / MIB,
                    "step_s": max(p["step_s"] for p in per),
                    "loss": per[0]["loss"],
                    "est_act_mib": act / MIB,
                    "est_step_mib": step_phase / MIB,
                }
            )
    for row in rows:  # ratios to N = 1 at the same length, where N = 1 ran
        one = next((r for r in rows if r["tokens"] == row["tokens"] and r["n"] == 1), None)
        row["step_ratio"] = row["step_mib"] / one["step_mib"] if one else None
        row["time_ratio"] = row["step_s"] / one["step_s"] if one else None
    return rows


def table(rows: list[dict[str, Any]], plan: Plan) -> str:
    mem = "RSS" if plan.device == "cpu" else "allocated"
    head = (
        f"{'tokens':>7} {'N':>2} {'base MiB':>9} {'peak MiB':>9} {'step MiB':>9} {'x N=1':>6}"
        f" {'step s':>7} {'x N=1':>6} | {'est act MiB':>11} {'est step MiB':>12}"
    )
    lines = [
        f"SFT step per rank, {plan.shape} Llama {SHAPES[plan.shape]}, LoRA r{LORA_R} all-linear, "
        f"rows <= {plan.row_tokens} tokens, chunk {plan.chunk}, "
        f"activation checkpointing {'on' if plan.checkpointing else 'off'}, {plan.device} ({mem}; "
        "step = peak - base: what the step adds over weights and optimizer state)",
        head,
    ]
    for r in rows:
        ratio = f"{r['step_ratio']:.2f}" if r["step_ratio"] is not None else "-"
        tratio = f"{r['time_ratio']:.2f}" if r["time_ratio"] is not None else "-"
        lines.append(
            f"{r['tokens']:>7} {r['n']:>2} {r['base_mib']:>9.1f} {r['peak_mib']:>9.1f}"
            f" {r['step_mib']:>9.1f} {ratio:>6} {r['step_s']:>7.2f} {tratio:>6} |"
            f" {r['est_act_mib']:>11.1f} {r['est_step_mib']:>12.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    if args.worker is not None:
        from bench.sequence_parallel_rank import run_rank

        run_rank(Plan(**json.loads(args.plan)), args.worker)
        return []
    plan = plan_of(args)
    with tempfile.TemporaryDirectory(prefix="sp-bench-") as tmp:
        started = time.perf_counter()
        for n in plan.sizes:
            (Path(tmp) / f"n{n}").mkdir()
            launch(plan, n, Path(tmp) / f"n{n}")
        rows = collect(plan, Path(tmp))
    print(table(rows, plan))
    print(f"({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        args.json.write_text(json.dumps({"plan": asdict(plan), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
