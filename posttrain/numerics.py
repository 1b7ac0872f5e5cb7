"""What the bits of a stage's arithmetic depend on besides its inputs, and the pin that keeps
them from depending on anything else (decision 71, issue 39).

Measured on this project's CPU machines (torch 2.13 CPU build with MKL 2024.2, AMD EPYC, AVX2):
- MKL's sgemm, torch's CPU matmul, rounds by its operands' addresses modulo 16 bytes (the same
  values at four offsets gave four different products; small row counts, as in decoding, are
  the sensitive shapes) and by its thread count, unless its conditional numerical
  reproducibility is on. `MKL_CBWR=AUTO,STRICT` gives one result for every offset and thread
  count, at no measured cost (`bench/numerics_pin.py`). MKL reads the setting at its first call,
  so importing `posttrain` sets it (`pin`), before anything multiplies; a process whose MKL
  started earlier keeps MKL's default and its manifest says so (`reproducibility`).
- Tensors read by `safetensors.load_file` or `from_pretrained` are views at the file's byte
  offsets (8 mod 16 for the quickstart's base) where a copied tensor is 64-byte aligned: the
  same weights sit at different addresses in different code paths, which the pin makes harmless.
- ATen's vectorized element-wise kernels (SiLU, exp, ...) round their scalar tails unlike their
  vector bodies, and a parallel loop cuts its range by the thread count: the quickstart's DPO
  reference table is the same at 1, 2, 4 and 8 threads and differs at 3. No setting removes
  that, so the threads per process are part of the `signature`.
- On CUDA, kernels with atomics (scatter/index_add reductions, some cuBLAS paths) are not
  run-to-run deterministic, and no GPU test backs a bit-exact claim: not claimed.

A cached table (the DPO reference log-probs, a teacher's answers) is keyed by the `signature`
of the process that computed it, so a cache hit returns what a miss would compute.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Any

STRICT_MKL = "AUTO,STRICT"
# mkl.h: the code-branch values of mkl_cbwr_get, and the strict flag.
_MKL_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 9: "AVX", 10: "AVX2", 12: "AVX512"}
_MKL_STRICT = 0x10000


def pin() -> None:
    """MKL's reproducible mode for this process and its children, unless the user chose one.
    Must run before MKL's first call (importing `posttrain` runs it)."""
    os.environ.setdefault("MKL_CBWR", STRICT_MKL)


@functools.cache
def _mkl() -> Any:
    """torch's bundled MKL service functions, or None (no MKL: another BLAS, another OS)."""
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        mkl = ctypes.CDLL(str(lib))
        get = mkl.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get


def mkl_mode() -> str | None:
    """MKL's conditional-reproducibility mode in this process ("AUTO,STRICT", "OFF", ...), or
    None where torch has no MKL."""
    get = _mkl()
    if get is None:
        return None
    value = get(-1)  # MKL_CBWR_ALL
    branch = _MKL_BRANCHES.get(value & 0xFFFF, str(value & 0xFFFF))
    return f"{branch},STRICT" if value & _MKL_STRICT else branch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def device_signature(device_type: str) -> dict[str, Any]:
    """The hardware and library facts the bits depend on: on CPU the processor, ATen's vector
    instruction set, MKL's mode and this process's thread count; on CUDA the GPU and CUDA."""
    import torch

    out: dict[str, Any] = {"device": device_type, "torch": torch.__version__}
    for name in ("transformers", "peft"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = mod.__version__
    if device_type == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    else:
        out |= {
            "cpu": _cpu_model(),
            "isa": torch.backends.cpu.get_cpu_capability(),
            "mkl_cbwr": mkl_mode(),
            "threads": torch.get_num_threads(),
        }
    return out


def signature(infra: Any, device_type: str) -> dict[str, Any]:
    """`device_signature` plus the execution settings that change a forward's arithmetic
    without changing what it computes (attention kernel, LM-head chunking, precision)."""
    return device_signature(device_type) | {
        "precision": infra.precision,
        "base_dtype": infra.base_dtype,
        "attention": infra.attention,
        "logits_chunk_tokens": infra.logits_chunk_tokens,
    }


def reproducibility(device_type: str) -> dict[str, Any]:
    """For a manifest: whether a re-run with the same inputs and the same `signature` gives the
    same bits, and why (only what a test here backs is claimed)."""
    if device_type == "cuda":
        return {
            "bit_exact": False,
            "why": "CUDA kernels with atomic reductions are not run-to-run deterministic, and "
            "no GPU test backs a bit-exact claim",
        }
    mode = mkl_mode()
    if mode is None:
        return {"bit_exact": False, "why": "torch here has no MKL: not measured"}
    if not mode.endswith("STRICT"):
        return {
            "bit_exact": False,
            "why": f"MKL ran in mode {mode}, not STRICT (set before posttrain was imported, or "
            "MKL_CBWR chosen so): matmuls round by their operands' memory addresses",
        }
    return {"bit_exact": True, "scope": "same inputs and the same numerics signature (CPU)"}


# Shapes where MKL's default mode was seen to round by address here: decoding-sized row counts.
PROBE_SHAPES = ((7, 64, 128), (7, 128, 2048), (33, 64, 256), (96, 128, 2048), (7, 16, 256))


def distinct_products(shapes: tuple[tuple[int, int, int], ...] = PROBE_SHAPES) -> int:
    """The most different products one [m, k] x [k, n] matmul of fixed values gives in this
    process when its left operand sits at four addresses (offsets of 0-3 floats) and runs on
    1-3 threads: 1 where matmul is a function of the values alone. The thread count is
    restored afterwards."""
    import torch

    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    most = 0
    try:
        for m, k, n in shapes:
            a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            seen = set()
            for offset in range(4):
                moved = torch.empty(a.numel() + offset)[offset:].view(m, k).copy_(a)
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    seen.add((moved @ b.t()).numpy().tobytes())
            most = max(most, len(seen))
    finally:
        torch.set_num_threads(before)
    return most
