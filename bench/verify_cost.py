"""What verifying files costs: sha256 vs a size-only check on 1 GiB, and the hashing share of a
real checkpoint save.

Part 1. A 1 GiB file in a temporary artifact folder (written, then sealed by the real
`write_manifest`, which hashes it), then `verify(folder)` (size + sha256 of every file: what a
stage now does to its parents before loading them, and what the flow does before reusing an
artifact) and `verify(folder, hashes=False)` (a stat per file) are timed, best of --rounds. The
file was just written, so reads come from the page cache: this is the CPU cost of sha256; a cold
read from disk adds the disk's read time (about 1 GiB / its bandwidth).

Part 2. `save_checkpoint` of a plain module with --ckpt-params trainable fp32 parameters after
one AdamW step (checkpoint = weights + two moments, ~12 bytes per parameter), world size 1: its
log line reports the seconds spent hashing (integrity.json) out of the whole save; then
`inspect_checkpoint` (what a resume checks: sizes + sha256) is timed. Files are deleted at the
end.

    python bench/verify_cost.py [--gib 1] [--rounds 3] [--ckpt-params 50_000_000]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
import time
from pathlib import Path

from posttrain.store.artifacts import verify, write_manifest


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def verify_cost(root: Path, gib: float, rounds: int) -> None:
    folder = root / "artifact"
    folder.mkdir()
    size = int(gib * (1 << 30))
    block = os.urandom(64 << 20)
    t = time.perf_counter()
    with open(folder / "weights.bin", "wb") as f:
        for off in range(0, size, len(block)):
            f.write(block[: min(len(block), size - off)])
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    write_manifest(folder, stage="bench", fp="0" * 16, parents=[], section={}, seed=0, summary={})
    seal_s = time.perf_counter() - t
    full = _best(lambda: verify(folder), rounds)
    sizes = _best(lambda: verify(folder, hashes=False), rounds)
    assert verify(folder) == (True, "")
    print(f"file: {size / 2**30:.2f} GiB, written in {write_s:.2f} s")
    print(f"write_manifest (sha256 of it): {seal_s:.2f} s")
    print(f"verify, size + sha256:  {full:.3f} s  ({size / full / 1e9:.2f} GB/s)")
    print(f"verify, size only:      {sizes * 1e3:.3f} ms")
    (folder / "weights.bin").unlink()


def checkpoint_cost(root: Path, n_params: int) -> None:
    import torch

    from posttrain.distributed.runtime import init_distributed, shutdown
    from posttrain.train.checkpoint import save_checkpoint
    from posttrain.train.resume import inspect_checkpoint

    init_distributed("cpu", 120, 2)
    try:
        width = 4096
        model = torch.nn.Sequential(
            *[
                torch.nn.Linear(width, width, bias=False)
                for _ in range(max(1, n_params // width**2))
            ]
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        n = sum(p.numel() for p in model.parameters())
        lines: list[str] = []

        class Grab(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        log = logging.getLogger("posttrain.train")
        log.setLevel(logging.INFO)
        log.addHandler(Grab())
        t = time.perf_counter()
        path = save_checkpoint(root / "ckpt", 1, model, opt, sched, keep=1)
        save_s = time.perf_counter() - t
        hash_s = float(re.search(r"of which ([\d.]+) s hashing", lines[-1]).group(1))
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        t = time.perf_counter()
        assert inspect_checkpoint(path) == (True, [])
        check_s = time.perf_counter() - t
        print(f"checkpoint: {n / 1e6:.0f}M trainable params, {size / 2**30:.2f} GiB on disk")
        print(
            f"save_checkpoint: {save_s:.2f} s, of which sha256 {hash_s:.2f} s "
            f"({100 * hash_s / save_s:.0f}%)"
        )
        print(f"resume check (sizes + sha256): {check_s:.2f} s")
    finally:
        shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ckpt-params", type=int, default=50_000_000, help="0: skip part 2")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="verify-cost-") as tmp:
        verify_cost(Path(tmp), args.gib, args.rounds)
        if args.ckpt_params:
            checkpoint_cost(Path(tmp), args.ckpt_params)


if __name__ == "__main__":
    main()
