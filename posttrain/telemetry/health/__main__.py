"""Print what the health sources read on this machine, as JSON:

    python -m posttrain.telemetry.health                 # 2 samples 1 s apart (rates in the 2nd)
    python -m posttrain.telemetry.health --cuda-index 3  # another GPU

Writes no file. The CUDA device defaults to torch's current one when torch sees a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from posttrain.telemetry.health.sampler import HealthSampler, sources_line


def _default_cuda_index() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m posttrain.telemetry.health")
    ap.add_argument("--cuda-index", type=int, default=None, help="default: torch's current")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cuda_index = args.cuda_index if args.cuda_index is not None else _default_cuda_index()
    sampler = HealthSampler(Path("."), 0, args.interval, cuda_index=cuda_index)
    print(sources_line({n: s.status for n, s in sampler.sources.items()}), flush=True)
    try:
        for i in range(args.samples):
            if i:
                time.sleep(args.interval)
            print(json.dumps(sampler.sample(), indent=2), flush=True)
    finally:
        sampler.stop()


if __name__ == "__main__":
    main()
