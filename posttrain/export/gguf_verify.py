"""Read a written .gguf back and check it against the merged folder it came from.

Checks: the tensor count and names are the planned ones, each shape is the HF tensor's, every
metadata value reads back as written, and every de-quantised weight is within the rounding bound
of its type of the merged weight (q/k rows un-permuted back to HF's order first, so a wrong
rotary permutation fails here). Tensors are compared one at a time, in row chunks (the file is
memory-mapped).

Bounds, per element w (fp32 merged weight) and d (de-quantised):
  F32:  d == w
  F16:  |d - w| <= |w| * 2^-11 + 2^-24        (round to nearest; the 2^-24 covers subnormals)
  BF16: |d - w| <= |w| * 2^-8  + 2^-133
  Q8_0: |d - w| <= 0.57 * amax / 127 per block of 32, amax the block's largest |w|: half a
        quant step, plus the fp16 rounding of the block scale times at most 127 steps
        (127 * 2^-11 = 0.062 of a step).
A q/k permutation error moves weights by about their own size, far above every bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open

from posttrain.export.gguf import (
    GGUFPlan,
    HParams,
    PlannedTensor,
    ggml_to_hf_rope_rows,
    load_hf,
)

CHUNK_ELEMENTS = 1 << 22  # ~16 MB of fp32 per piece compared


class GGUFVerificationError(RuntimeError):
    """The written GGUF does not hold what was planned."""


def _bound(w: np.ndarray, gtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Allowed |dequantised - w| for each element of w (module docstring)."""
    Q = gguf.GGMLQuantizationType
    a = np.abs(w)
    if gtype == Q.F32:
        return np.zeros_like(w)
    if gtype == Q.F16:
        return a * 2.0**-11 + 2.0**-24
    if gtype == Q.BF16:
        return a * 2.0**-8 + 2.0**-133
    if gtype == Q.Q8_0:
        blocks = a.reshape(-1, 32)
        amax = blocks.max(axis=1, keepdims=True)
        return np.broadcast_to(0.57 * amax / 127, blocks.shape).reshape(w.shape)
    raise GGUFVerificationError(f"no error bound for {gtype.name}")


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    if f is None:
        raise GGUFVerificationError(f"metadata key {key!r} is missing")
    return f.contents()


def _same(expected: Any, got: Any) -> bool:
    if isinstance(expected, float):
        return bool(np.float32(expected) == np.float32(got))
    return expected == got


def verify_gguf(path: str | Path, planned: GGUFPlan) -> dict[str, Any]:
    """Raise GGUFVerificationError unless the file at `path` holds what `planned` says."""
    hp, plan, meta = planned.hp, planned.tensors, planned.metadata
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    want = [t.gguf_name for t in plan]
    if len(reader.tensors) != len(plan) or set(tensors) != set(want):
        missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
        raise GGUFVerificationError(
            f"{path}: {len(reader.tensors)} tensors, expected {len(plan)} "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for key, value in meta.items():
        got = _field(reader, key)
        if not _same(value, got):
            shown = f"{len(got)} items" if isinstance(got, list) else repr(got)[:80]
            raise GGUFVerificationError(f"{path}: metadata {key} reads back as {shown}")

    worst: dict[str, float] = {}
    for t in plan:
        r = tensors[t.gguf_name]
        shape = tuple(reversed(r.shape.tolist()))  # GGUF stores dims fastest-first
        if shape != t.shape or r.tensor_type != t.gtype:
            raise GGUFVerificationError(
                f"{path}: {t.gguf_name} is {r.tensor_type.name} {list(shape)}, "
                f"expected {t.gtype.name} {list(t.shape)}"
            )
        for w, d in _pairs(t, r, hp):
            err = np.abs(d - w)
            if not np.all(np.isfinite(d)) or np.any(err > _bound(w, r.tensor_type)):
                raise GGUFVerificationError(
                    f"{path}: {t.gguf_name} ({t.hf_name}) de-quantises to values up to "
                    f"{float(np.nan_to_num(err, nan=np.inf).max()):.3g} away from the merged "
                    f"weights, beyond the {r.tensor_type.name} rounding bound"
                )
            name = r.tensor_type.name
            worst[name] = max(worst.get(name, 0.0), float(err.max()))
    return {
        "path": str(path),
        "tensors": len(plan),
        "metadata_keys": len(meta),
        "max_abs_weight_error": worst,
        "passed": True,
    }


def _pairs(t: PlannedTensor, r: Any, hp: HParams) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(merged fp32, de-quantised fp32) pieces of one tensor, in HF's row order, in row chunks
    of about CHUNK_ELEMENTS (a 70B embedding holds a few hundred MB, not 4 GB copies). Permuted
    q/k are compared whole against the stored HF tensor, undoing the permutation on the file
    side, so the check does not only test the permutation against its own inverse.
    """
    if t.permute_heads:
        with safe_open(str(t.file), framework="pt") as st:
            w = st.get_tensor(t.hf_name).to(torch.float32).numpy()
        d = gguf.quants.dequantize(np.asarray(r.data), r.tensor_type).reshape(t.shape)
        yield w, ggml_to_hf_rope_rows(d, t.permute_heads)
        return
    if t.hf_name is None or len(t.shape) < 2:
        d = gguf.quants.dequantize(np.asarray(r.data), r.tensor_type).reshape(t.shape)
        yield load_hf(t, hp), d
        return
    step = max(1, CHUNK_ELEMENTS // math.prod(t.shape[1:]))
    with safe_open(str(t.file), framework="pt") as st:
        stored = st.get_slice(t.hf_name)
        for a in range(0, t.shape[0], step):
            w = stored[a : a + step].to(torch.float32).numpy()
            yield w, gguf.quants.dequantize(np.asarray(r.data[a : a + step]), r.tensor_type)
