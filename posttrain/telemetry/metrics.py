"""What an SRE reads per step: throughput, FLOP/s, MFU, memory, and where the time went.

`metrics.jsonl` gets one JSON object per line with a `kind` (`start`, `train`, `eval`, `end`).
MFU is achieved model FLOP/s over the device's peak: a table of dense bf16 peaks for known GPUs,
and on CPU a matmul peak measured on this machine at stage start.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
import time
from pathlib import Path
from typing import Any

import torch

from posttrain import jsonsafe
from posttrain.telemetry import health
from posttrain.telemetry.records import read_metrics

log = logging.getLogger("posttrain.telemetry")

# Dense (no sparsity) peak FLOP/s per device for bf16/fp16 tensor cores; fp32 uses TF32 peaks.
GPU_PEAKS_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "T4": 65e12,
}


def gpu_peak_flops(name: str, precision: str) -> float | None:
    for key in sorted(GPU_PEAKS_BF16, key=len, reverse=True):  # longest match: "H100 PCIe" first
        if key in name:
            peak = GPU_PEAKS_BF16[key]
            return peak if precision in ("bf16", "fp16") else peak / 2  # TF32 is half of bf16
    return None


_CPU_PEAK: float | None = None


def measure_cpu_matmul_peak(n: int = 1024, seconds: float = 0.4) -> float:
    """fp32 matmul FLOP/s with this process's thread count (best of a short burst)."""
    global _CPU_PEAK
    if _CPU_PEAK is not None:
        return _CPU_PEAK
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: first call pays allocation and thread-pool start
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    _CPU_PEAK = best
    return best


def device_peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the number came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, precision)
        if peak:
            return peak, f"table:{name}"
        return 0.0, f"unknown GPU {name}: MFU not reported"
    return measure_cpu_matmul_peak(), f"measured fp32 matmul, {torch.get_num_threads()} threads"


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: everything but embedding tables, plus the LM head
    once even when tied to the embedding (its matmul still runs)."""
    total = 0
    seen = set()
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not isinstance(mod, torch.nn.Embedding):
                total += p.numel()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if head is not None and id(head.weight) in seen and _is_tied(model):
        total += head.weight.numel()
    return total


def _is_tied(model: torch.nn.Module) -> bool:
    inp = getattr(model, "get_input_embeddings", lambda: None)()
    out = getattr(model, "get_output_embeddings", lambda: None)()
    return inp is not None and out is not None and inp.weight is out.weight


def train_flops_per_token(
    n_matmul: int, n_trainable: int, n_layers: int, hidden: int, seq_len: int
) -> float:
    """Forward 2N, backward activation gradients 2N, weight gradients 2 x trainable only (so LoRA
    costs ~4N, full fine-tuning ~6N), plus attention scores 12 x layers x seq x hidden
    (PaLM-paper convention, no causal discount)."""
    return 4 * n_matmul + 2 * n_trainable + 12 * n_layers * seq_len * hidden


def fragmentation_warning(
    allocated_gib: float, reserved_gib: float, ratio: float = 1.5, min_gap_gib: float = 1.0
) -> str | None:
    """A warning when the CUDA caching allocator holds far more than the tensors use: reserved
    above `ratio` x allocated AND more than `min_gap_gib` GiB apart (a small process always
    rounds up a little). None when it is not heavy."""
    gap = reserved_gib - allocated_gib
    if reserved_gib <= ratio * allocated_gib or gap <= min_gap_gib:
        return None
    return (
        f"GPU memory fragmentation: peak reserved {reserved_gib:.2f} GiB is "
        f"{reserved_gib / max(allocated_gib, 1e-9):.1f}x peak allocated {allocated_gib:.2f} GiB "
        f"({gap:.2f} GiB cached but unused); varying sequence lengths fragment the caching "
        "allocator: try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


_FRAGMENTATION_WARNED = False


def memory_snapshot(device: torch.device) -> dict[str, float]:
    """Current and peak allocated vs reserved (GPU) or current and peak RSS (CPU), in GiB. On
    GPU, heavy fragmentation (see `fragmentation_warning`) is logged the first time it is
    seen."""
    global _FRAGMENTATION_WARNED
    gib = 1024**3
    if device.type == "cuda":
        snap = {
            "mem_allocated_gib": torch.cuda.memory_allocated(device) / gib,
            "mem_reserved_gib": torch.cuda.memory_reserved(device) / gib,
            "mem_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
        }
        warning = fragmentation_warning(
            snap["mem_peak_allocated_gib"], snap["mem_peak_reserved_gib"]
        )
        if warning and not _FRAGMENTATION_WARNED:
            _FRAGMENTATION_WARNED = True
            log.warning("%s", warning)
        return snap
    import psutil

    rss = psutil.Process().memory_info().rss
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mem_rss_gib": rss / gib, "mem_peak_rss_gib": peak_kib * 1024 / gib}


class MetricsWriter:
    """Append JSON lines to metrics.jsonl (rank 0 only; other ranks write nothing).

    Two threads write: the training loop and the rank's health sampler (`health` records), which
    an enabled writer registers itself with; a lock keeps their lines whole."""

    def __init__(self, path: Path, enabled: bool = True, resume_step: int = 0):
        """A fresh run truncates the file; a run resumed at `resume_step` keeps the records up
        to that step, so the file reads like one uninterrupted run."""
        self.path = path
        self.enabled = enabled
        self._f = None
        self._lock = threading.Lock()
        if not enabled:
            return
        old = read_metrics(path) if resume_step else []
        kept = [r for r in old if r.get("kind") != "end" and r.get("step", 0) <= resume_step]
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        for rec in kept:
            self._f.write(jsonsafe.dumps(rec) + "\n")
        # Only now: health records written before the truncation above would be lost.
        health.attach_writer(self)

    def write(self, kind: str, **fields: Any) -> None:
        if self._f is None:  # disabled (ranks > 0) or closed: skip the serialising
            return
        rec = {"kind": kind, "time": round(time.time(), 3), **fields}
        line = jsonsafe.dumps(rec, default=float) + "\n"
        with self._lock:
            if self._f is None:  # closed meanwhile by the other thread
                return
            self._f.write(line)
            # Flushed to the OS, which keeps it if the process is killed; made durable (fsync)
            # at checkpoints and at close, not per record: a resume keeps only records up to the
            # checkpoint it resumes from, and an fsync per record costs ~0.3 ms (a small model's
            # step is ~40 ms).
            self._f.flush()

    def sync(self) -> None:
        """Make the records written so far durable (before a checkpoint is written)."""
        with self._lock:
            if self._f is not None:
                os.fsync(self._f.fileno())

    def close(self) -> None:
        # Detached first, outside our lock: the sampler takes its own lock to detach.
        health.detach_writer(self)
        with self._lock:
            if self._f is not None:
                os.fsync(self._f.fileno())
                self._f.close()
                self._f = None
