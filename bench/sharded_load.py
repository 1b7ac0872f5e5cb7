"""Sharded loading: each rank's peak memory while a base is loaded and sharded, 2 ranks vs 1.

A random-init Qwen2-architecture model (~300M parameters by default: hidden 1024, 24 layers,
vocab 32k, tied embeddings) is saved as safetensors in a temporary folder (or --dir). Then, in
fresh processes (gloo, one torch thread each), every rank loads it the way the training stages do
and the peak RSS of each is read from /proc/self/status (VmHWM):

  sharded  `build_on_meta` -> LoRA (`apply_lora`) -> `shard_model` -> `fill_from_checkpoint`:
           each rank allocates and reads only its shards (architecture decision 27).
  whole    (--old) the path before it: every rank loads the whole model (`load_causal_lm`),
           then LoRA, then shards.

Reported per rank: RSS before loading (interpreter, torch, transformers, peft imported; process
group up), the peak during load+shard, and the load's own cost (peak - before). The ratio is
the 2-rank per-rank figure over the 1-rank one, for the peak and for the load's cost; with
weights on half the rows each, the cost ratio tends to 0.5 as the model grows, the peak ratio
to 0.5 plus the import floor over the single-rank peak. The single rank and the two ranks run
at the same time (the figures are per process; run time is not measured).

    PYTHONPATH=. .venv/bin/python bench/sharded_load.py            # ~300M params (~1.5 min)
    PYTHONPATH=. .venv/bin/python bench/sharded_load.py --old      # also the whole-model path
    PYTHONPATH=. .venv/bin/python bench/sharded_load.py --hidden 512 --layers 8 --vocab 16000
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def save_model(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """Random-init Qwen2 of that shape saved as safetensors in `folder`; returns its parameters."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        intermediate_size=int(hidden * 2.75),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(folder))
    return sum(p.numel() for p in model.parameters())


def worker(model_dir: str, path: str) -> dict[str, Any]:
    """One rank (RANK/WORLD_SIZE/MASTER_* in the environment): load + LoRA + shard."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from posttrain.distributed.fsdp import shard_model
    from posttrain.models.loading import load_causal_lm
    from posttrain.models.lora import apply_lora
    from posttrain.models.sharded_load import build_on_meta, fill_from_checkpoint
    from posttrain.sections.shared import LoraConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    lora = LoraConfig(r=8, alpha=16)
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    if path == "sharded":
        model, files = build_on_meta(model_dir, AutoModelForCausalLM, torch.float32)
        model = shard_model(apply_lora(model, lora), mesh, "fp32")
        fill_from_checkpoint(model, files, torch.device("cpu"))
    else:
        model = shard_model(apply_lora(load_causal_lm(model_dir), lora), mesh, "fp32")
    seconds = time.perf_counter() - t0
    local = sum(p.to_local().numel() for p in model.parameters())  # this rank's share
    dist.barrier()
    dist.destroy_process_group()
    return {
        "rank": int(os.environ["RANK"]),
        "world": world,
        "path": path,
        "rss_before_mb": before / 1024,
        "peak_mb": _status_kb("VmHWM") / 1024,
        "load_s": seconds,
        "local_params": local,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model_dir: Path, world: int, path: str) -> list[subprocess.Popen[str]]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = os.environ | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
        }
        cmd = [sys.executable, __file__, "--worker", str(model_dir), "--path", path]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen[str]], timeout: float) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"worker exited {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def measure(model_dir: Path, path: str = "sharded", timeout: float = 600) -> dict[str, Any]:
    """Peak RSS of 1 rank and of each of 2 ranks loading `model_dir` (run side by side)."""
    one, two = launch(model_dir, 1, path), launch(model_dir, 2, path)
    single, pair = collect(one, timeout)[0], collect(two, timeout)
    worst_peak = max(r["peak_mb"] for r in pair)
    worst_cost = max(r["peak_mb"] - r["rss_before_mb"] for r in pair)
    single_cost = single["peak_mb"] - single["rss_before_mb"]
    return {
        "path": path,
        "single": single,
        "ranks": pair,
        "peak_ratio": worst_peak / single["peak_mb"],
        "load_cost_ratio": worst_cost / single_cost,
    }


def report(res: dict[str, Any]) -> None:
    print(f"\n[{res['path']}]  rank  before MB   peak MB   load cost MB   load s   local params")
    for r in [res["single"], *res["ranks"]]:
        print(
            f"  world {r['world']} rank {r['rank']}  {r['rss_before_mb']:9.0f} {r['peak_mb']:9.0f} "
            f"{r['peak_mb'] - r['rss_before_mb']:14.0f} {r['load_s']:8.1f} {r['local_params']:14,}"
        )
    print(
        f"  per-rank peak, 2 ranks / 1 rank: {res['peak_ratio']:.2f}x;  "
        f"load cost (peak - before): {res['load_cost_ratio']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="MODEL_DIR")
    ap.add_argument("--path", default="sharded", choices=["sharded", "whole"])
    ap.add_argument("--dir", type=Path, help="model folder to reuse (made if empty)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--old", action="store_true", help="also measure the whole-model path")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.path)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.dir or Path(tmp) / "model"
        if not (folder / "config.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            n = save_model(folder, args.hidden, args.layers, args.vocab)
            print(f"saved a {n / 1e6:.0f}M-parameter Qwen2 to {folder}")
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        print(f"checkpoint: {size / 2**20:.0f} MB of safetensors")
        for path in ("sharded", "whole") if args.old else ("sharded",):
            report(measure(folder, path))


if __name__ == "__main__":
    main()
