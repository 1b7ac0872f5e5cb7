"""torch's flash varlen kernel for padding-free attention on CUDA, held to the gather-SDPA path
(the CPU path and the reference). Its plumbing (the [N, H, D] layout, cu_seqlens, the sliding
window, GQA) is checked here on CPU against a per-row SDPA written from the kernel's documented
contract; the kernel itself on CUDA, where a GPU is at hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.data.segments import Segments
from posttrain.models import flash_varlen
from posttrain.models.varlen_attention import SEGMENTS_KW, varlen_sdpa_forward

LENGTHS = [5, 1, 7, 3]


def _per_row_reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """varlen_attn's contract, row by row: q/k/v [N, H, D], rows delimited by cu_seqlens,
    window_size (left, 0) causal with `left` keys before the query (-1: all)."""
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        qi, ki, vi = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        i = torch.arange(b - a)
        d = i[:, None] - i[None, :]
        mask = (d >= 0) & ((d <= window_size[0]) if window_size[0] >= 0 else True)
        o = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def _qkv(heads: int, kv_heads: int, dtype=torch.float32, device="cpu"):
    n, d = sum(LENGTHS), 8
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(1, h, n, d, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def test_cu_seqlens_by_hand() -> None:
    seg = Segments.from_lengths([3, 1, 2])
    assert seg.cu_seqlens.tolist() == [0, 3, 4, 6] and seg.cu_seqlens.dtype == torch.int32


def test_the_cpu_keeps_the_gather_sdpa_path() -> None:
    q, _, _ = _qkv(4, 4)
    assert not flash_varlen.usable(q, 0.0)
    assert not flash_varlen.usable(q.bfloat16(), 0.0)  # CPU: never, whatever the dtype


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (4, 2, None), (4, 1, 3)])
def test_the_flat_layout_gives_the_gather_paths_attention(monkeypatch, heads, kv_heads, window):
    monkeypatch.setattr(flash_varlen, "VARLEN_ATTN", _per_row_reference)
    seg = Segments.from_lengths(LENGTHS)
    q, k, v = _qkv(heads, kv_heads)
    flat = flash_varlen.flash_varlen(q, k, v, seg, 0.5, window)
    kw = {SEGMENTS_KW: seg, "sliding_window": window}
    ref, _ = varlen_sdpa_forward(torch.nn.Identity(), q, k, v, None, scaling=0.5, **kw)
    assert flat.shape == ref.shape == (1, sum(LENGTHS), heads, 8)
    torch.testing.assert_close(flat, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(
    not torch.cuda.is_available() or flash_varlen.VARLEN_ATTN is None,
    reason="needs CUDA and torch's varlen attention",
)
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_the_cuda_kernel_equals_the_gather_sdpa_path(kv_heads: int) -> None:
    seg = Segments.from_lengths(LENGTHS).to("cuda")
    q, k, v = _qkv(8, kv_heads, torch.bfloat16, "cuda")
    kw = {SEGMENTS_KW: seg}
    out, _ = varlen_sdpa_forward(torch.nn.Identity(), q, k, v, None, scaling=None, **kw)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    # The same rows in fp32: flash varlen takes half precision only, so this is the gather path.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want, _ = varlen_sdpa_forward(torch.nn.Identity(), q32, k32, v32, None, scaling=None, **kw)
    want_grads = torch.autograd.grad(want.square().sum(), (q32, k32, v32))
    # bf16 inputs and kernel against an fp32 reference: bf16's 8-bit mantissa sets the bound.
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
    for got, exp in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got.float(), exp, atol=6e-2, rtol=6e-2)
