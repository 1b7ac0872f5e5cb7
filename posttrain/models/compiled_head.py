"""The chunked LM head with each chunk's work compiled (`infra.logits_head: compiled`).

Same computation as `posttrain.models.chunked.ChunkedTargetLogps`, chunk by chunk, but each
chunk's forward and backward is one `torch.compile`d function, so inductor fuses what the eager
path runs as separate kernels over [c, V] fp32 buffers:

  forward   (the eager path's own per-chunk function, compiled) z = h W^T + b (the matmul in the compute dtype: bf16 [c, V] on a bf16 model), then
            ONE fused reduction reads z, upcasts to fp32 in registers, applies the transform and
            writes only [c] vectors: lse, logp (the target's logit via an index compare) and the
            entropy. Eager writes z in fp32, and p = softmax(z) for the entropy: two more [c, V]
            fp32 buffers and their passes.
  backward  recompute z (matmul), then one fused elementwise pass forms dL/dz in fp32 registers
            (softmax, entropy term, one-hot, the transform's derivative) and writes it once in
            the weight's dtype (bf16 [c, V] on a bf16 model, where eager writes fp32 and casts);
            dL/db is a fused column sum of the fp32 values; dL/dh = dL/dz W (one matmul in the
            graph). dL/dW accumulates outside the graph, in place into the fp32 [V, H]
            accumulator, as eager does: inside a graph the input mutation would be
            functionalized into an out-of-place [V, H] result plus a copy.

Shapes: the chunk's row count is marked dynamic (one graph for every N and every last chunk);
a chunk of one row is padded to two (a size of 1 would be specialised: a second graph), the pad
row's upstream gradient zero so it adds nothing. What does make another graph: entropy on or
off, another `LogitTransform` (a softcap, a sampling temperature), other dtypes, autocast on or
off; a stage sees a handful. Dynamo's recompile limit (8 per function) then falls back to eager
for further variants, with its warning: results stay right.

Called from inside the autograd function's forward and backward (no autograd graph is traced,
only inference graphs), so it works wherever the eager chunked head works: inside the FSDP2 root
forward (`scoring_head`), under autocast (the ambient autocast is part of what dynamo traces and
guards), with tied embeddings and a LoRA model.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

# `transform` below is a `posttrain.models.chunked.LogitTransform` (typed Any: chunked imports
# this module, and an import back would make a cycle).


def _logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: Any,
) -> torch.Tensor:
    """[c, H] -> [c, V] fp32 logits, as `chunked._chunk_logits` (out of place: in a graph the
    upcast and the transform fuse into the consumer)."""
    return transform.logits(F.linear(h, weight, bias).float())


def _backward_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    transform: Any,
    need_h: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(dL/dh [c, H] in h's dtype | None, dL/du [c, V] in the weight's dtype, dL/db [V] fp32 | None)
    of one chunk, u = h W^T + b. g_logp [c] (zeros when logp got no gradient), g_ent [c] | None;
    the formulas of `ChunkedTargetLogps.backward`."""
    z = _logits(h, weight, bias, transform)  # [c, V] fp32
    p = torch.exp(z - lse[:, None])
    gl = g_logp[:, None]
    if g_ent is not None and ent is not None:
        mean_z = (lse - ent)[:, None]  # E_p[z]
        gz = -p * (gl + g_ent[:, None] * (z - mean_z))
    else:
        gz = -p * gl
    vocab = torch.arange(z.size(1), device=z.device)
    gz = gz + torch.where(vocab[None, :] == targets[:, None], gl, 0.0)  # the one-hot, fused
    factor = transform.grad_factor(z)  # [c, V] | float | None
    if factor is not None:
        gz = gz * factor  # dL/dl -> dL/du
    gz_w = gz.to(weight.dtype)
    grad_h = (gz_w @ weight).to(h.dtype) if need_h else None
    return grad_h, gz_w, (gz.sum(0) if bias is not None else None)


@functools.cache
def _compiled(fn: Any) -> Any:
    """One compiled version of `fn` per process (dynamo keys its graphs by the arguments)."""
    return torch.compile(fn, fullgraph=True)


def _dynamic_rows(*tensors: torch.Tensor | None) -> None:
    """Each tensor's first size (the chunk's rows) symbolic from the first trace."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def _pad_one(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """A one-row chunk as two rows, the second zeros (sizes of 1 are specialised by dynamo);
    detached: a slice of a leaf that requires grad says so even under no_grad, a padded copy
    does not, and dynamo guards on it (so does it on the weight: frozen or trained, one graph)."""
    return tuple(
        None
        if t is None
        else torch.cat([t.detach(), torch.zeros_like(t[:1])])
        if t.size(0) == 1
        else t.detach()
        for t in tensors
    )


def forward_chunk(
    body: Any,
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: Any,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`body` (the eager chunked head's per-chunk forward, `chunked._eager_forward_chunk`)
    compiled: (logp [c], lse [c], entropy [c] | None). Its in-place steps on the chunk's own
    buffers are functionalised and fused by inductor like the rest."""
    c = h.size(0)
    h, targets = _pad_one(h, targets)
    _dynamic_rows(h, targets)
    weight, bias = _pad_one(weight, bias)  # detached only: V > 1
    logp, lse, ent = _compiled(body)(h, weight, bias, targets, transform, with_entropy)
    return logp[:c], lse[:c], (None if ent is None else ent[:c])


def backward_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    transform: Any,
    need_h: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """`_backward_chunk` compiled: (dL/dh [c, H] | None, dL/du [c, V], dL/db [V] | None); a padded
    row has zero upstream gradients, so it adds nothing to dL/db (nor, sliced off, to dL/dW)."""
    c = h.size(0)
    h, targets, lse, ent, g_logp, g_ent = _pad_one(h, targets, lse, ent, g_logp, g_ent)
    _dynamic_rows(h, targets, lse, ent, g_logp, g_ent)
    weight, bias = _pad_one(weight, bias)  # detached only: V > 1
    grad_h, gz, grad_b = _compiled(_backward_chunk)(
        h, weight, bias, targets, lse, ent, g_logp, g_ent, transform, need_h
    )
    return (None if grad_h is None else grad_h[:c]), gz[:c], grad_b


# The mark on the LM head module (an nn.Linear) that `chunked.head_scores` reads: set once when a
# session is built, so every scoring path (SFT, preference, RL, `RoleModel`) follows it without
# the choice being threaded through each call.
_MARK = "posttrain_compiled_head"


def logits_head_compiled(setting: str, compile_setting: str | bool, device: torch.device) -> bool:
    """`infra.logits_head`: `compiled`/`chunked` as set; `auto` = compiled where the stage
    compiles its decoder blocks (`infra.compile`, `auto` = on CUDA only)."""
    from posttrain.models.compile import compile_enabled

    if setting == "auto":
        return compile_enabled(compile_setting, device)
    return setting == "compiled"


def use_compiled_head(head: torch.nn.Module, on: bool = True) -> None:
    """Mark `head` (the model's LM head: `chunked.output_head(model)`) so the chunked scoring
    path compiles each chunk's work (`on`), or runs it eagerly."""
    setattr(head, _MARK, on)


def is_compiled(head: torch.nn.Module) -> bool:
    return bool(getattr(head, _MARK, False))
