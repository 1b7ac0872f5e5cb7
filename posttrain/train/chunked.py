"""Target-token log-probs (and entropy) through the LM head in token chunks.

Full-vocabulary logits are the largest tensor of a step on a big-vocabulary model: 8 x 2048 tokens
x 151,936 (Qwen2) x 4 bytes is 10 GB per fp32 copy, and log_softmax plus its gradient make several.
Here only positions that have a label go through the head, `chunk` tokens at a time:

  forward   per chunk: z = h W^T + b in the compute dtype, upcast to fp32 [c, V];
            lse = logsumexp(z); logp = z[target] - lse; entropy = lse - sum softmax(z) z.
            Saved for backward: h [N, H], W, b, targets [N], lse [N] (and entropy [N]).
  backward  per chunk, recompute z and p = softmax(z) and form dL/dz in place:
            dlogp/dz  = onehot(target) - p
            dH/dz     = -p (z - E_p[z]),  E_p[z] = lse - H
            then dL/dh = dL/dz W and dL/dW += dL/dz^T h (fp32 accumulator), dL/db += sum dL/dz.
So at most two [chunk, V] fp32 buffers exist at a time instead of several [N, V] ones.

FSDP2: the embedding, final norm and head belong to the ROOT module, whose weights are gathered
only inside the root forward, and whose gradient reduce-scatter hooks are set up there. So the
head is never called from outside the model: `scoring_head` swaps the head's forward for the
duration of a model call, so the model's own forward returns the scores as `.logits`
(`RoleModel.forward(targets=...)` does the same inside its own root forward).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.data.chat import IGNORE
from posttrain.train.losses import sequence_logps, token_nll_sum

# Config attributes of architectures that transform the head's output before it becomes the
# logits (Gemma-2/3 soft-capping, Cohere's logit scale, Granite's divisor): the chunked head
# scores the raw head output, so these models must run unchunked.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[c, H] -> [c, V] fp32: the matmul in the compute dtype (as the unchunked head does), then
    upcast, so bf16 models get an fp32 log-softmax."""
    return F.linear(h, weight, bias).float()


class ChunkedTargetLogps(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N], chunk, entropy) ->
    (logp [N] fp32, entropy [N] fp32, or an empty tensor when not asked for)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.size(0)
        step = chunk if chunk > 0 else max(1, n)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for s in range(0, n, step):
            z = _chunk_logits(hidden[s : s + step], weight, bias)  # [c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [c]
            logp[s : s + step] = z.gather(1, targets[s : s + step, None]).squeeze(1) - lse_c
            lse[s : s + step] = lse_c
            if with_entropy:
                p = (z - lse_c[:, None]).exp_()  # [c, V] softmax
                ent[s : s + step] = lse_c - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.step, ctx.with_entropy = step, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        use_ent = ctx.with_entropy and g_ent is not None
        step = ctx.step
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulators over chunks; cast to the parameters' dtype at the end.
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if need_b and bias is not None
            else None
        )
        rows = torch.arange(min(step, hidden.size(0)), device=hidden.device)
        for s in range(0, hidden.size(0), step):
            h = hidden[s : s + step]
            c = h.size(0)
            z = _chunk_logits(h, weight, bias)  # [c, V]
            lse_c = lse[s : s + step, None]
            gl = g_logp[s : s + step, None] if g_logp is not None else None
            if use_ent:
                p = (z - lse_c).exp()  # [c, V]
                # dL/dz = -p * (g_logp + g_ent (z - E_p[z])) (+ g_logp at the target), in z's buffer
                mean_z = lse_c - ent[s : s + step, None]
                gz = z.sub_(mean_z).mul_(g_ent[s : s + step, None])
                if gl is not None:
                    gz.add_(gl)
                gz = gz.mul_(p).neg_()
                del p
            else:
                gz = z.sub_(lse_c).exp_()  # p, in z's buffer
                gz = gz.mul_(-gl) if gl is not None else gz.zero_()
            if gl is not None:
                gz[rows[:c], targets[s : s + step]] += gl.squeeze(1)
            if grad_h is not None:
                grad_h[s : s + step] = (gz.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(gz.t(), h.float())
                else:
                    grad_w += gz.to(weight.dtype).t() @ h.to(weight.dtype)
            if grad_b is not None:
                grad_b += gz.sum(0)
            del gz, z
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


def chunked_target_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] (and the entropy [N] of each position's distribution when `entropy`)
    from hidden states [N, H] through a head of `weight` [V, H] / `bias` [V]; `chunk` tokens per
    pass (0 = all N at once). fp32 results; exact gradients for hidden, weight and bias."""
    logp, ent = ChunkedTargetLogps.apply(hidden, weight, bias, targets, chunk, entropy)
    return logp, (ent if entropy else None)


def head_scores(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position scores of `targets` [B, T] (IGNORE = not scored) from `hidden` [B, T, H]
    through `head` (an nn.Linear, not called: its weight is read) -> (logp [B, T], entropy
    [B, T] | None), 0.0 at IGNORE positions. Unlabelled positions never reach the head: in a
    prompt-heavy batch they are most of the tokens."""
    if hidden.shape[:2] != targets.shape:
        raise ValueError(
            f"the LM head sees positions {tuple(hidden.shape[:2])} but the targets are "
            f"{tuple(targets.shape)}: align the targets with the positions given to the head "
            f"(shifted labels; the last `logits_to_keep` columns when that is set)"
        )
    mask = targets != IGNORE  # [B, T]
    logp_n, ent_n = chunked_target_logps(
        hidden[mask], head.weight, head.bias, targets[mask], chunk, entropy
    )  # [N]
    logp = logp_n.new_zeros(targets.shape)
    logp[mask] = logp_n
    if ent_n is None:
        return logp, None
    ent = ent_n.new_zeros(targets.shape)
    ent[mask] = ent_n
    return logp, ent


def output_head(model: nn.Module) -> nn.Linear:
    """The LM head of a causal LM (through peft wrappers), checked to be a plain linear layer
    whose output is the logits as they are."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(
            f"chunked log-probs need a plain nn.Linear LM head, got {type(head).__name__} "
            f"(an adapter on the head?): set infra.logits_chunk_tokens: 0"
        )
    config = getattr(model, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{type(config).__name__}.{name}={value} transforms the head's output into the "
                f"logits, which chunked scoring does not reproduce: set infra.logits_chunk_tokens: 0"
            )
    return head


@contextmanager
def scoring_head(
    model: nn.Module, targets: torch.Tensor, chunk: int, entropy: bool = False
) -> Iterator[None]:
    """While active, the model's `.logits` are the log-probs of `targets` [B, T] ([B, T, 2]:
    log-prob, entropy, with `entropy`), computed by the chunked head inside the model's own
    (FSDP2 root) forward. `targets[b, t]` is the token position t predicts (shifted labels),
    IGNORE where nothing is scored."""
    head = output_head(model)
    had_own = "forward" in head.__dict__
    previous = head.__dict__.get("forward")

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T] | [B, T, 2]
        logp, ent = head_scores(head, hidden, targets, chunk, entropy)
        return logp if ent is None else torch.stack([logp, ent], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        if had_own:
            head.forward = previous
        else:
            del head.forward


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] labels -> [B, T] targets: position t predicts labels[t + 1]; the last position
    predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], pad], dim=1)


def label_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a causal LM over `batch` (input_ids/attention_mask/position_ids/labels,
    [B, T]) -> (log-probs [B, T-1] of labels[:, 1:], 0.0 where IGNORE; mask [B, T-1] bool),
    through the chunked head."""
    targets = shifted_targets(batch["labels"])
    with scoring_head(model, targets, chunk):
        logp = model(**_model_inputs(batch)).logits  # [B, T]
    return logp[:, :-1], targets[:, :-1] != IGNORE


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    # No KV cache: a scoring forward never reuses it.
    return {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")} | {
        "use_cache": False
    }


def forward_nll_sum(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_nll_sum` of one forward over `batch`: (summed NLL of the label tokens, their
    count). `chunk` tokens per pass through the head; 0 = full logits (the unchunked path)."""
    if not chunk:
        return token_nll_sum(model(**_model_inputs(batch)).logits, batch["labels"])
    logp, mask = label_logps(model, batch, chunk)
    return -logp.sum(), mask.sum()


def forward_sequence_logps(
    model: nn.Module, batch: dict[str, torch.Tensor], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logps` of one forward over `batch`: (summed label log-prob per row [B], label
    count per row [B]). `chunk` as in `forward_nll_sum`."""
    if not chunk:
        return sequence_logps(model(**_model_inputs(batch)).logits, batch["labels"])
    logp, mask = label_logps(model, batch, chunk)
    return logp.sum(-1), mask.sum(-1)
