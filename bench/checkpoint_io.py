"""Checkpoint I/O: save/load time and size vs model size, and what a kill-and-resume costs.

Side by side in one run:

Part 1 (I/O). Tiny Llamas of three sizes (~1M, ~8M, ~30M parameters, built by
`posttrain.models.tiny.build_model`), each with a LoRA adapter of two ranks and with every
parameter trainable (full fine-tuning), sharded by `shard_model` at world size 1 as every stage
holds its model. After one real AdamW step (so the optimizer holds its moments), the project's
`save_checkpoint` and a load (`read_checkpoint` + `apply_checkpoint`: what a resume runs once it
has checked the checkpoint's integrity) are timed (best of --rounds: load from other processes on
a shared machine only ever adds time; every save also prunes the previous checkpoint, keep=1,
as a run does). A checkpoint is meant to hold only the trainable parameters and their optimizer
state (frozen base weights are reloaded from the ingest artifact), so its size should follow the
trainable count: ~12 bytes per trainable parameter in fp32 (weight + two AdamW moments). The
"extra" column counts model entries in the checkpoint that are no trainable parameter under
their own name (read back from the DCP metadata): with tied embeddings, the frozen
`lm_head.weight` alias in a LoRA checkpoint and a second copy of the embedding in a full one.
Every load is checked: the trainable weights and AdamW moments are perturbed before it and must
come back exactly. Loads read files just written, i.e. from the page cache: a cold read from a
network disk is slower. A least-squares fit time = fixed + bytes / bandwidth over all cases
separates the per-checkpoint fixed cost (DCP planning, metadata, barriers, meta.json, RNG files,
rename, pruning) from the bandwidth.

Part 2 (resume). The real sft stage (`python -m posttrain.stages.sft`, one process, world size
1) on a from-config base: once uninterrupted, once SIGKILLed (its whole process group) as soon
as the checkpoint at about two thirds of the run is complete, then re-run to the end in the same
folder (it resumes from that checkpoint). Both runs checkpoint at the same interval, so the
uninterrupted time includes the saves too (their in-run cost is estimated from the gaps between
step records). Reported: wall times, the ratio killed+resumed / uninterrupted, the steps
recomputed (those the killed process finished after the checkpoint), each process's start-up
time (process start to its first step; a resumed one skips the step-0 held-out evaluation but
loads the checkpoint), and whether the resumed run ends where the uninterrupted one does (final
loss, adapter weights).

Every child runs --threads torch threads (default 1): on a 2-core machine shared with other
processes, two OpenMP threads per process made torch ~30x slower.

    .venv/bin/python bench/checkpoint_io.py             # default (~2 min on 2 shared CPU cores)
    .venv/bin/python bench/checkpoint_io.py --quick     # two sizes, shorter SFT run
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

# Before anything imports transformers (in the children too, which inherit the environment).
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import stage_process  # noqa: E402 (bench/, on the path above)

SIZES: dict[str, dict[str, int]] = {
    "1M": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 344},
    "8M": {"hidden_size": 256, "num_layers": 8, "num_heads": 8, "intermediate_size": 688},
    "30M": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
}
VOCAB = {"1M": 2048, "8M": 4096, "30M": 8192}
MODES = ("lora8", "lora64", "full")  # LoRA rank 8, LoRA rank 64, all parameters trainable

# Part 2: the SFT run that is killed and resumed.
RESUME_BASE = {
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "intermediate_size": 344,
    "vocab_size": 1024,
    "max_position_embeddings": 128,
    "pretrain_steps": 0,  # the weights only need to exist
    "corpus_examples": 400,
}


# ---------------------------------------------------------------------------------------------
# Part 1: save/load (child process)


class _VocabOnly:
    """What `build_model` reads from a tokenizer: its length and two special ids."""

    pad_token_id, eos_token_id = 0, 1

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def extra_bytes(path: Path, trainable_names: set[str]) -> int:
    """Bytes of model entries in a checkpoint that are not a trainable parameter by their own
    name (`named_parameters()` names each shared parameter once)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    total = 0
    for key, m in meta.state_dict_metadata.items():
        if not key.startswith("model.") or key.removeprefix("model.") in trainable_names:
            continue
        numel = 1
        for n in getattr(m, "size", ()):
            numel *= n
        total += numel * m.properties.dtype.itemsize
    return total


def io_case(d: Any, size: str, mode: str, rounds: int, work: Path) -> dict[str, Any]:
    """One model size x trainable mode: build, shard, one AdamW step, time saves and loads."""
    import shutil

    import torch

    from posttrain.distributed.fsdp import shard_model
    from posttrain.kinds.ingest import FromConfigModel
    from posttrain.models.loading import count_params
    from posttrain.models.lora import apply_lora
    from posttrain.models.tiny import build_model
    from posttrain.sections.shared import LoraConfig, OptimConfig
    from posttrain.train.checkpoint import apply_checkpoint, read_checkpoint, save_checkpoint
    from posttrain.train.optim import build_optimizer, build_scheduler

    torch.manual_seed(0)
    cfg = FromConfigModel(**SIZES[size], vocab_size=VOCAB[size], max_position_embeddings=64)
    model: Any = build_model(cfg, _VocabOnly(VOCAB[size]))
    model.config.use_cache = False
    if mode == "full":
        model.requires_grad_(True)
    else:
        r = int(mode.removeprefix("lora"))
        model = apply_lora(model, LoraConfig(r=r, alpha=2 * r))
    n_total, n_trainable = count_params(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    model = shard_model(model, d.mesh, "fp32")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optim = OptimConfig(lr=1e-3, warmup_steps=2)
    opt = build_optimizer(trainable, optim)
    sched = build_scheduler(opt, 100, optim)
    ids = torch.randint(16, VOCAB[size], (2, 32), generator=torch.Generator().manual_seed(0))
    for p in trainable:  # LoRA B starts at zero: give every weight a value worth restoring
        p.data.add_(0.01 * torch.randn_like(p.data))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)

    root = work / f"{size}-{mode}"
    saves, loads = [], []
    path = root
    for k in range(rounds):
        t = time.perf_counter()
        path = save_checkpoint(root, k + 1, model, opt, sched, keep=1)
        saves.append(time.perf_counter() - t)
    n_bytes = _dir_bytes(path)
    n_files = sum(1 for p in path.rglob("*") if p.is_file())
    n_extra = extra_bytes(path, names)
    saved = [p.detach().full_tensor().clone() for p in trainable]
    moment = next(iter(opt.state.values()))["exp_avg"].full_tensor().clone()
    for _ in range(rounds):
        with torch.no_grad():
            for p in trainable:
                p.add_(1.0)
            for st in opt.state.values():
                st["exp_avg"].add_(1.0)
        t = time.perf_counter()
        meta = apply_checkpoint(read_checkpoint(path, model, opt), model, opt, sched)
        loads.append(time.perf_counter() - t)
        assert meta["step"] == rounds
        for p, s in zip(trainable, saved, strict=True):
            assert torch.equal(p.detach().full_tensor(), s), f"{size} {mode}: weights not restored"
        got = next(iter(opt.state.values()))["exp_avg"].full_tensor()
        assert torch.equal(got, moment), f"{size} {mode}: optimizer state not restored"
    shutil.rmtree(root)
    return {
        "size": size,
        "mode": mode,
        "params_total": n_total,
        "params_trainable": n_trainable,
        "bytes": n_bytes,
        "extra_bytes": n_extra,
        "files": n_files,
        "save_s": min(saves),
        "load_s": min(loads),
        "save_median_s": statistics.median(saves),
        "load_median_s": statistics.median(loads),
        "first_save_s": saves[0],
    }


def io_child(sizes: list[str], rounds: int, threads: int) -> list[dict[str, Any]]:
    from posttrain.distributed.runtime import init_distributed, shutdown

    d = init_distributed("cpu", 600, threads)  # a world of one, as in a single-process stage
    out = []
    with tempfile.TemporaryDirectory(prefix="ckpt-io-") as tmp:
        for size in sizes:
            for mode in MODES:
                out.append(io_case(d, size, mode, rounds, Path(tmp)))
                print(json.dumps(out[-1]), file=sys.stderr, flush=True)  # progress
    shutdown()
    return out


# ---------------------------------------------------------------------------------------------
# Part 2: kill and resume (this process drives stage subprocesses; it never imports torch)


def resume_recipe(workspace: Path, steps: int, every: int, threads: int) -> dict[str, Any]:
    return {
        "run": {"name": "ckpt-resume", "workspace": str(workspace), "seed": 0},
        "infra": {"device": "cpu", "devices_per_node": 1, "threads_per_rank": threads},
        "ingest": {"source": "from_config", "from_config": RESUME_BASE},
        "sft": {
            "data": {"synthetic": {"n_examples": 400}, "eval_fraction": 0.05, "max_seq_len": 64},
            "lora": {"r": 16, "alpha": 32},
            "optim": {"lr": 5e-3, "warmup_steps": 2},
            "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
            "max_steps": steps,
            "checkpoint_every": every,
            "keep_checkpoints": 2,
        },
    }


def run_stage(stage: str, recipe: Path, *overrides: str) -> float:
    with stage_process(stage, recipe, *overrides) as cmd:
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def out_dir(stage: str, recipe: Path, *overrides: str) -> Path:
    sys.path.insert(0, str(ROOT))
    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan

    return next(
        s.out_dir for s in plan(load_recipe(recipe, list(overrides))).stages if s.name == stage
    )


def train_records(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "train"]


def kill_after_checkpoint(
    recipe: Path, overrides: tuple[str, ...], step: int, log: Path
) -> dict[str, Any]:
    """Start the stage in its own process group; SIGKILL the group as soon as checkpoint `step`
    is complete (renamed from .tmp, which save_checkpoint does last)."""
    folder = out_dir("sft", recipe, *overrides)
    target = folder / "checkpoints" / f"step_{step:07d}"
    t0 = time.perf_counter()
    wall0 = time.time()
    with open(log, "w") as f, stage_process("sft", recipe, *overrides) as cmd:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill it and anything it started
        )
        try:
            while not target.is_dir():
                if proc.poll() is not None:
                    sys.exit(f"sft ended before checkpoint {step}:\n{log.read_text()[-3000:]}")
                time.sleep(0.005)
            seen = time.perf_counter()
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:  # only on an error above: do not leave it running
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = [r["step"] for r in train_records(folder)]
    return {
        "wall_s": time.perf_counter() - t0,
        "seen_after_s": seen - t0,
        "start_time": wall0,
        "last_step": max(done, default=0),
        "checkpoint": step,
        "returncode": proc.returncode,
    }


def adapter_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two saved adapters (a child, to keep torch out)."""
    code = (
        "import sys; from safetensors.numpy import load_file\n"
        "a, b = (load_file(p + '/adapter/adapter_model.safetensors') for p in sys.argv[1:])\n"
        "assert a.keys() == b.keys()\n"
        "print(max(float(abs(a[k] - b[k]).max()) for k in a))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


def save_cost(rows: list[dict[str, Any]], every: int) -> float:
    """In-run seconds of one checkpoint save: the gap between the records of a checkpointed step
    and the next one, less that step's own time, minus the same for the other steps (median)."""
    gaps: dict[bool, list[float]] = {True: [], False: []}
    for a, b in zip(rows[1:], rows[2:], strict=False):
        gaps[a["step"] % every == 0].append(b["time"] - a["time"] - b["step_time_s"])
    if not gaps[True] or not gaps[False]:
        return float("nan")
    return statistics.median(gaps[True]) - statistics.median(gaps[False])


def first_step_after(folder: Path, start_time: float, after_step: int) -> float:
    """Seconds from a process's start to its first train record beyond `after_step`."""
    rows = [r for r in train_records(folder) if r["step"] > after_step]
    return rows[0]["time"] - start_time if rows else float("nan")


def resume_part(work: Path, steps: int, every: int, threads: int) -> dict[str, Any]:
    work.mkdir(parents=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(resume_recipe(work / "ws", steps, every, threads)))
    ingest_s = run_stage("ingest", recipe)
    kill_at = every * max(1, round(steps * 2 / 3 / every))
    assert kill_at < steps, "the kill checkpoint must come before the last step"

    # keep_checkpoints differs only to give the two runs their own folders (the fingerprint
    # covers the sft section); both keep the checkpoint the killed run resumes from.
    plain = ("sft.keep_checkpoints=2",)
    killed = ("sft.keep_checkpoints=3",)
    t0 = time.time()
    plain_s = run_stage("sft", recipe, *plain)
    plain_dir = out_dir("sft", recipe, *plain)
    plain_rows = train_records(plain_dir)
    plain_startup = plain_rows[0]["time"] - t0

    k = kill_after_checkpoint(recipe, killed, kill_at, work / "killed.log")
    killed_dir = out_dir("sft", recipe, *killed)
    t1 = time.time()
    resumed_s = run_stage("sft", recipe, *killed)
    resumed_rows = train_records(killed_dir)
    step_s = statistics.median(r["step_time_s"] for r in plain_rows[1:])
    return {
        "steps": steps,
        "every": every,
        "ingest_s": ingest_s,
        "plain_s": plain_s,
        "plain_startup_s": plain_startup,
        "killed_s": k["wall_s"],
        "kill_seen_s": k["seen_after_s"],
        "killed_last_step": k["last_step"],
        "kill_checkpoint": kill_at,
        "recomputed": k["last_step"] - kill_at,
        "resumed_s": resumed_s,
        "resumed_startup_s": first_step_after(killed_dir, t1, kill_at),
        "step_s": step_s,
        "save_in_run_s": save_cost(plain_rows, every),
        "saves_in_run": (steps - 1) // every,
        "total_s": k["wall_s"] + resumed_s,
        "ratio": (k["wall_s"] + resumed_s) / plain_s,
        "plain_final_loss": plain_rows[-1]["loss"],
        "resumed_final_loss": resumed_rows[-1]["loss"],
        "resumed_steps": [r["step"] for r in resumed_rows] == list(range(1, steps + 1)),
        "adapter_max_abs_diff": adapter_diff(plain_dir, killed_dir),
    }


# ---------------------------------------------------------------------------------------------
# Report


def table(hdr: tuple[str, ...], rows: list[list[str]]) -> None:
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(" | ".join(r))


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def fit(rows: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Least squares time = fixed + bytes / bandwidth -> (fixed s, bandwidth bytes/s)."""
    xs = [r["bytes"] for r in rows]
    ys = [r[key] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, (1 / slope if slope > 0 else float("inf"))


def report_io(rows: list[dict[str, Any]], rounds: int) -> None:
    print(
        f"\nPart 1: checkpoint save/load, FSDP2 world size 1, fp32, best of {rounds} "
        "(loads from the page cache)\n"
    )
    hdr = (
        "model",
        "trainable",
        "params total",
        "params trainable",
        "ckpt size",
        "extra",
        "bytes/trainable param",
        "without extra",
        "ckpt / fp32 model",
        "save s",
        "load s",
        "save s/GB",
        "load s/GB",
    )
    out = []
    for r in rows:
        gb = r["bytes"] / 1e9
        out.append(
            [
                r["size"],
                r["mode"],
                f"{r['params_total']:,}",
                f"{r['params_trainable']:,}",
                _size(r["bytes"]),
                _size(r["extra_bytes"]),
                f"{r['bytes'] / r['params_trainable']:.2f}",
                f"{(r['bytes'] - r['extra_bytes']) / r['params_trainable']:.2f}",
                f"{r['bytes'] / (4 * r['params_total']):.3f}",
                f"{r['save_s']:.3f}",
                f"{r['load_s']:.3f}",
                f"{r['save_s'] / gb:.1f}",
                f"{r['load_s'] / gb:.1f}",
            ]
        )
    table(hdr, out)
    for key in ("save_s", "load_s"):
        fixed, bw = fit(rows, key)
        rate = (
            f"{bw / 1e9:.2f} GB/s"
            if bw != float("inf")
            else "no measurable time per byte (size does not predict the time in this range)"
        )
        print(
            f"\n{key.split('_')[0]}: fixed cost ~{1000 * fixed:.0f} ms per checkpoint + {rate} "
            f"(least squares over the {len(rows)} cases)",
            end="",
        )
    print(
        "\n\nbytes/trainable param: fp32 weight + AdamW exp_avg + exp_avg_sq = 12, plus DCP "
        "metadata, meta.json and the RNG state (small and about fixed, so they weigh most in "
        "the smallest checkpoints, as does the fixed time: there s/GB is no bandwidth figure). "
        "'extra': model entries that are no trainable parameter by their own name, i.e. the tied "
        "embedding's lm_head alias (frozen in LoRA checkpoints, which are meant to hold "
        "trainable state only; a duplicate in full ones). 'ckpt / fp32 model': checkpoint size "
        "over the whole model's fp32 weights."
    )


def report_resume(r: dict[str, Any]) -> None:
    print(
        f"\nPart 2: sft stage, {r['steps']} steps, checkpoint every {r['every']}; SIGKILL right "
        f"after the step-{r['kill_checkpoint']} checkpoint completed, then re-run\n"
    )
    lost = r["total_s"] - r["plain_s"]
    hdr = ("run", "wall s", "start-up s (to first step)", "steps run")
    table(
        hdr,
        [
            [
                "uninterrupted",
                f"{r['plain_s']:.1f}",
                f"{r['plain_startup_s']:.1f}",
                str(r["steps"]),
            ],
            [
                "killed",
                f"{r['killed_s']:.1f}",
                "",
                f"{r['killed_last_step']} (checkpoint seen {r['kill_seen_s']:.1f} s in)",
            ],
            [
                "resumed",
                f"{r['resumed_s']:.1f}",
                f"{r['resumed_startup_s']:.1f}",
                f"{r['steps'] - r['kill_checkpoint']} (from step {r['kill_checkpoint'] + 1})",
            ],
            ["killed + resumed", f"{r['total_s']:.1f}", "", ""],
        ],
    )
    print(
        f"\nkilled+resumed / uninterrupted = {r['ratio']:.2f}; time lost {lost:.1f} s = "
        f"{lost / r['step_s']:.0f} median steps ({r['step_s'] * 1000:.0f} ms each); steps "
        f"recomputed: {r['recomputed']} (finished after the checkpoint before the kill landed)"
    )
    print(
        f"checkpoint saves inside the uninterrupted run: {r['saves_in_run']} x "
        f"~{r['save_in_run_s']:.2f} s (gap after a checkpointed step minus the usual gap)"
    )
    print(
        f"final train loss uninterrupted {r['plain_final_loss']:.6f} vs resumed "
        f"{r['resumed_final_loss']:.6f}; adapter max |diff| {r['adapter_max_abs_diff']:.2e}; "
        f"metrics read 1..{r['steps']} without gaps: {r['resumed_steps']}"
    )
    print(
        "The time lost is mostly one more process start-up (imports, base load, data prep, "
        "sharding) plus the checkpoint load; on a long run it is a fixed cost, so the ratio "
        "tends to 1 + start-up / run time."
    )


def run_child(*argv: str, threads: int) -> Any:
    """This script in a fresh process; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, __file__, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    if proc.returncode:
        sys.exit(f"child {' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, 2 rounds, shorter SFT run")
    ap.add_argument("--rounds", type=int, help="saves and loads timed per case (default 3)")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), help="default: all")
    ap.add_argument("--steps", type=int, help="SFT steps of the resume run (default 60)")
    ap.add_argument("--every", type=int, help="checkpoint interval (default steps / 4)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--skip-resume", action="store_true", help="part 1 only")
    ap.add_argument("--io-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = args.sizes or (["1M", "8M"] if args.quick else list(SIZES))
    rounds = args.rounds or (2 if args.quick else 3)
    if args.io_child:
        print(json.dumps(io_child(sizes, rounds, args.threads)))
        return
    steps = args.steps or (24 if args.quick else 60)
    every = args.every or max(1, steps // 4)

    t = time.perf_counter()
    io = run_child("--io-child", "--rounds", str(rounds), "--sizes", *sizes, threads=args.threads)
    io_s = time.perf_counter() - t
    res = None
    if not args.skip_resume:
        with tempfile.TemporaryDirectory(prefix="ckpt-resume-") as tmp:
            res = resume_part(Path(tmp) / "w", steps, every, args.threads)
    report_io(io, rounds)
    print(f"(part 1 took {io_s:.0f} s)")
    if res:
        report_resume(res)
        print(f"(part 2 took {res['ingest_s'] + res['plain_s'] + res['total_s']:.0f} s)")
    print(
        f"\n{os.cpu_count()} CPU cores, {args.threads} torch thread(s) per process; absolute "
        "times on shared CPUs are noisy, the ratios printed side by side are the figures to use."
    )
    print(json.dumps({"io": io, "resume": res}))


if __name__ == "__main__":
    main()
