"""Padding-free attention through torch's own flash varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, CUDA only, half precision), where the torch at hand
has it: the packed rows go in as they lie, [N, H, D] with their `cu_seqlens`, so attention costs
sum(L_i^2) with no gather into padded [S, H, L, D] blocks and no scatter back (16 gathers and
scatters per layer on the SDPA path). No flash-attn source build is needed.

Everywhere else (CPU, fp32, an older torch, attention dropout) the gather-SDPA path of
`posttrain.models.varlen_attention` runs: it is the CPU path and the reference the CUDA test
holds this one to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.data.segments import Segments


def _probe() -> Callable[..., Any] | None:
    """torch's varlen attention, or None where this torch has none (older than 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


VARLEN_ATTN = _probe()


def usable(query: torch.Tensor, dropout: float) -> bool:
    """Whether the flash varlen kernel can take this call: CUDA, fp16/bf16, no dropout."""
    return (
        VARLEN_ATTN is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and dropout == 0.0
    )


def flash_varlen(
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, D]
    seg: Segments,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    """Causal attention within each row of the flat batch -> [1, N, H, D]. `window`: a
    sliding window of that many keys (the query's own included), as transformers' rule."""
    assert VARLEN_ATTN is not None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    # The longest row as gather's width [S, L], not `seg.max_len` (python ints): in a compiled
    # block (`infra.compile`) it stays symbolic instead of recompiling at every new length.
    longest = seg.gather.shape[1]
    # (-1, 0): causal over the whole row; (W - 1, 0): the query and the W - 1 keys before it.
    left = -1 if window is None or longest <= window else window - 1
    out = VARLEN_ATTN(
        q,
        k,
        v,
        seg.cu_seqlens,
        seg.cu_seqlens,
        longest,
        longest,
        scale=scaling,
        window_size=(left, 0),
        enable_gqa=query.shape[1] != key.shape[1],
    )  # [N, H, D]
    return out.unsqueeze(0)
