"""Attention confined to each row of a padding-free batch (`posttrain.data.segments`).

transformers 5.24 finds packed rows from restarting position ids only to build a dense
block-diagonal [N, N] mask for SDPA: attention then costs N^2 for a micro-batch of N tokens
instead of sum(L_i^2), and the mask alone is N^2 bytes (16k tokens: 256 MB per layer call).
Flash-attention's varlen kernels (GPU, `infra.attention: flash_attention_2`) do it right and are
used as they are. Everywhere else this module's attention function runs instead, for the
duration of a padding-free forward (`confined_attention`): it gathers q/k/v into one padded
[S, H, L, D] block per row, runs SDPA causally (its flash or memory-efficient kernel on GPU,
the CPU flash kernel here), and scatters the outputs back to [1, N, H, D]. Linear layers and
the MLP, most of the FLOPs, see N real tokens; attention costs what padded rows cost. On CUDA
in half precision, where torch has its own flash varlen kernel, the rows go to it as they lie
instead (`posttrain.models.flash_varlen`): no gather, no scatter, sum(L_i^2).

Right padding inside a row's block needs no mask: a real query at position t attends keys
0..t, all real. Sliding-window models (Mistral, Qwen2 with `use_sliding_window`) get the window
as a boolean mask when a row is longer than it. Soft-capped attention logits (Gemma-2) are not
expressible in SDPA: such models keep padded rows (`padding_free_unsupported`).

Under sequence parallelism (`posttrain.distributed.sequence_parallel`) each rank's q/k/v hold a
slice of the tokens; the group, handed down as a keyword beside the segments, exchanges them
for all tokens of a share of the heads around the same row-confined attention.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from posttrain.data.segments import Segments
from posttrain.errors import RecipeVerdict
from posttrain.models import flash_varlen

if TYPE_CHECKING:
    from posttrain.distributed.sequence_parallel import SequenceParallel

NAME = "posttrain_varlen"
SEGMENTS_KW = "posttrain_segments"
# The sequence-parallel group of a forward whose ranks each hold a slice of the tokens
# (`posttrain.distributed.sequence_parallel`), handed down beside the segments: a keyword, not
# a context, so an activation-checkpointing recompute (during backward) sees it too.
SEQUENCE_PARALLEL_KW = "posttrain_sequence_parallel"
_STATE = threading.local()


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    seg: Segments | None = kwargs.get(SEGMENTS_KW)
    if seg is None:
        if getattr(_STATE, "active", 0):
            # The model did not pass our keyword down to its attention: running SDPA over the
            # whole flat sequence would let rows attend to each other. Never silently.
            raise RecipeVerdict(
                "batch.padding_free",
                f"{type(module).__name__} did not hand the row segments to its attention "
                "function: this architecture cannot run padding-free batches; set it to false",
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise RuntimeError("soft-capped attention cannot run padding-free (needs eager attention)")
    # A store, never a read: a compiled block replays it on every call without guarding on a
    # value (a counter read here would recompile the block at every call).
    _STATE.seen = True
    sp: SequenceParallel | None = kwargs.get(SEQUENCE_PARALLEL_KW)
    if sp is not None:
        # This rank holds a slice of the tokens and all heads: the exchange hands it all tokens
        # of its share of the heads, attention runs over the whole rows, and back.
        return sp.attention(
            lambda q, k, v: _rows_attention(q, k, v, seg, dropout, scaling, kwargs),
            query,
            key,
            value,
        ), None
    return _rows_attention(query, key, value, seg, dropout, scaling, kwargs), None


def _rows_attention(
    query: torch.Tensor,  # [1, H, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, D]
    seg: Segments,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """Causal attention inside each row of the flat sequence -> [1, N, H, D]."""
    # Sizes from the segments' tensors, not from `seg.lengths` (python ints): a compiled block
    # then sees symbolic sizes and one graph serves every packed layout.
    tokens, rows, width = seg.row_of.shape[0], seg.gather.shape[0], seg.gather.shape[1]
    if query.shape[0] != 1 or query.shape[2] != tokens:
        raise ValueError(
            f"padding-free attention expects one flat row of {tokens} tokens, "
            f"got query {tuple(query.shape)}"
        )
    if flash_varlen.usable(query, dropout):  # CUDA, half precision: no gather, no scatter
        window = kwargs.get("sliding_window")
        return flash_varlen.flash_varlen(query, key, value, seg, scaling, window)
    groups = query.shape[1] // key.shape[1]
    if rows == 1:  # one row: plain causal attention, nothing to gather
        q, k, v = query, key, value
    else:
        # [1, H, N, D] -> [H, S, L, D] -> [S, H, L, D]
        q = query[0][:, seg.gather].transpose(0, 1)
        k = key[0][:, seg.gather].transpose(0, 1)
        v = value[0][:, seg.gather].transpose(0, 1)
    mask, causal = None, True
    window = kwargs.get("sliding_window")
    if window is not None and width > window:
        i = torch.arange(q.shape[2], device=q.device)
        d = i[:, None] - i[None, :]
        mask, causal = (d >= 0) & (d < window), False  # [L, L], as transformers' window rule
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=groups > 1,
    )  # [S, H, L, D]
    out = out.transpose(1, 2)  # [S, L, H, D]
    if rows == 1:
        return out.contiguous()
    return out[seg.row_of, seg.pos_of].unsqueeze(0)  # [1, N, H, D]


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask builder for this attention: none in a padding-free forward (the segments carry
    the structure; transformers would otherwise build a dense [N, N] block mask), SDPA's own
    otherwise (a padded batch through the same model: held-out loss, generation)."""
    if getattr(_STATE, "active", 0):
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, varlen_sdpa_forward)
AttentionMaskInterface.register(NAME, _mask)


def padding_free_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot take padding-free batches, or None when it can."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"{config.model_type} soft-caps its attention logits (SDPA cannot)"
    if impl not in ("sdpa", NAME) and not str(impl).startswith("flash_attention"):
        return f"attention implementation {impl!r} (padding-free needs sdpa or flash-attention)"
    return None


@contextmanager
def confined_attention(model: torch.nn.Module) -> Iterator[bool]:
    """For the duration of one padding-free forward: attention stays inside each row.

    Flash-attention models need nothing (transformers derives varlen lengths from the position
    ids). An SDPA model is switched to `varlen_sdpa_forward` for good, not just for the call:
    activation checkpointing recomputes a block's forward during backward, outside this
    context, with the same keywords (the segments among them), and the recompute must confine
    attention as the forward did. Without segments the function is SDPA itself, so padded
    batches through the same model are unchanged. Raises after the forward if no attention
    layer saw the segments (an architecture that drops the keyword). Yields whether the
    model's own attention handles the rows (flash-attention)."""
    config = model.config
    impl = config._attn_implementation
    if str(impl).startswith("flash_attention"):
        yield True  # native varlen: the caller passes no segments
        return
    if impl == "sdpa":
        config._attn_implementation = NAME
    elif impl != NAME:
        raise RuntimeError(f"padding-free batches need sdpa or flash attention, not {impl!r}")
    _STATE.active = getattr(_STATE, "active", 0) + 1
    seen_before, _STATE.seen = getattr(_STATE, "seen", False), False
    try:
        yield False
    finally:
        _STATE.active -= 1
    seen, _STATE.seen = _STATE.seen, seen_before or _STATE.seen
    if not seen:
        raise RecipeVerdict(
            "batch.padding_free",
            f"no attention layer of {type(model).__name__} ran padding-free (this architecture "
            "cannot); set it to false",
        )
