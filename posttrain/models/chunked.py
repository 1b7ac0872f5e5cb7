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
This eager loop is the reference; `infra.logits_head: compiled` runs the same per-chunk
functions compiled (`posttrain.models.compiled_head`), which fuses them into passes that write
no [chunk, V] fp32 buffer.

Architectures whose logits are a transform of the head's output (`LogitTransform`) get it
applied per chunk: z above is then l = f(h W^T + b), and dL/d(hW^T+b) = dL/dl * f'. Gemma-2/3
soft-cap (l = c tanh(u / c), f' = 1 - (l / c)^2: one more [chunk, V] buffer in backward), Cohere
multiplies by `logit_scale` and Granite divides by `logits_scaling` (f' a constant).

FSDP2: the embedding, final norm and head belong to the ROOT module, whose weights are gathered
only inside the root forward, and whose gradient reduce-scatter hooks are set up there. So the
head is never called from outside the model: `scoring_head` swaps the head's forward for the
duration of a model call, so the model's own forward returns the scores as `.logits`
(`RoleModel.forward(targets=...)` does the same inside its own root forward).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.data.chat import IGNORE
from posttrain.models import compiled_head
from posttrain.models.varlen_attention import (
    SEGMENTS_KW,
    SEQUENCE_PARALLEL_KW,
    confined_attention,
)


@dataclass(frozen=True)
class LogitTransform:
    """How an architecture turns the head's output u [.., V] into logits l:
    l = scale * u, then, with a soft-cap c, l = c * tanh(l / c); then divided by a sampling
    `temperature` T (online RL scores its samples under the distribution it drew them from)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None and self.temperature == 1.0

    def apply_(self, u: torch.Tensor) -> torch.Tensor:
        """u -> l in place (u is a chunk's own fp32 buffer; nothing tracks its gradient)."""
        if self.scale != 1.0:
            u = u.mul_(self.scale)
        if self.softcap is not None:
            # The model's order (divide, tanh, multiply), so the rounding is the same too.
            u = u.div_(self.softcap).tanh_().mul_(self.softcap)
        if self.temperature != 1.0:
            u = u.div_(self.temperature)
        return u

    def logits(self, u: torch.Tensor) -> torch.Tensor:
        """u -> l out of place, differentiable (the unchunked path): the model's own order of
        operations, so the result equals its `.logits`."""
        if self.scale != 1.0:
            u = u * self.scale
        if self.softcap is not None:
            u = torch.tanh(u / self.softcap) * self.softcap
        if self.temperature != 1.0:
            u = u / self.temperature
        return u

    def grad_factor(self, logits: torch.Tensor) -> torch.Tensor | float | None:
        """dl/du from the transformed logits l [c, V]: scale / T * (1 - (l T / c)^2) with a
        soft-cap (a new [c, V] buffer), the constant scale / T without one, None for the
        identity."""
        factor = self.scale / self.temperature
        if self.softcap is not None:
            l_cap = logits if self.temperature == 1.0 else logits * self.temperature
            t = l_cap / self.softcap  # tanh(scale * u / c)
            return t.square_().neg_().add_(1.0).mul_(factor)
        return factor if factor != 1.0 else None


IDENTITY = LogitTransform()

# Config attributes of architectures that transform the head's output into the logits, and the
# model types (text configs) whose transformers 5.24 modeling code was read for what it does
# with each: soft-capping after the head (Gemma-2, Gemma-3 text, VaultGemma), multiplying
# (Cohere), dividing (Granite). Keyed by the model's own config (the one its forward reads), with
# a multimodal config's text config looked at too, so a transform set there is never missed.
# Not applied by the model, so nothing to do: `minicpm3` divides the *hidden states* by
# `logits_scaling` before the head (the chunked head receives them as its input), and Gemma-3's
# multimodal Gemma3ForConditionalGeneration does not soft-cap whatever its text config says. Any
# other model type that sets one of these to a non-trivial value is refused (its code is unread:
# the transform could be anything, e.g. granite vision models divide by the text config's value).
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
_SOFTCAP_TYPES = frozenset({"gemma2", "gemma3_text", "vaultgemma"})
_SCALE_TYPES = frozenset({"cohere", "cohere2"})
_DIVISOR_TYPES = frozenset({"granite", "granitemoe", "granitemoeshared", "granitemoehybrid"})
_NOT_APPLIED = {"minicpm3": "logits_scaling", "gemma3": "final_logit_softcapping"}


def logit_transform(config: Any) -> LogitTransform:
    """The `LogitTransform` of a model's own config; refuses a transform attribute (on it or on
    its text config) of an architecture not known to apply it as above."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", None)
    out = IDENTITY
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is None:
            value = getattr(text, name, None)
        if value is None or (name != "final_logit_softcapping" and value == 1):
            continue
        if name == "final_logit_softcapping" and model_type in _SOFTCAP_TYPES:
            out = LogitTransform(out.scale, float(value))
        elif name == "logit_scale" and model_type in _SCALE_TYPES:
            out = LogitTransform(out.scale * float(value), out.softcap)
        elif name == "logits_scaling" and model_type in _DIVISOR_TYPES:
            out = LogitTransform(out.scale / float(value), out.softcap)
        elif _NOT_APPLIED.get(model_type or "") == name:
            continue
        else:
            raise ValueError(
                f"{type(config).__name__}.{name}={value} (model_type {model_type!r}) transforms the "
                f"head's output into the logits in a way chunked scoring does not know (served: "
                f"final_logit_softcapping for {sorted(_SOFTCAP_TYPES)}, logit_scale for "
                f"{sorted(_SCALE_TYPES)}, logits_scaling for {sorted(_DIVISOR_TYPES)}): set "
                f"infra.logits_chunk_tokens: 0"
            )
    return out


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: LogitTransform
) -> torch.Tensor:
    """[c, H] -> [c, V] fp32 logits: the matmul in the compute dtype (as the unchunked head does),
    then upcast, so bf16 models get an fp32 log-softmax, then the architecture's transform."""
    return transform.apply_(F.linear(h, weight, bias).float())


def _eager_forward_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp [c], lse [c], entropy [c] | None) of one chunk of rows h [c, H]."""
    z = _chunk_logits(h, weight, bias, transform)  # [c, V]
    lse = torch.logsumexp(z, dim=-1)  # [c]
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return logp, lse, None
    p = (z - lse[:, None]).exp_()  # [c, V] softmax
    return logp, lse, lse - (p * z).sum(-1)


def _eager_backward_chunk(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    transform: LogitTransform,
    need_h: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(dL/dh [c, H] | None, dL/du [c, V] fp32, dL/db [V] | None) of one chunk, u = h W^T + b:
    z recomputed, dL/dz formed in z's buffer (at most two [c, V] fp32 buffers)."""
    z = _chunk_logits(h, weight, bias, transform)  # [c, V]
    # dl/du of the transform, taken from l before z's buffer becomes dL/dl.
    factor = transform.grad_factor(z)  # [c, V] | float | None
    lse_c = lse[:, None]
    gl = g_logp[:, None] if g_logp is not None else None
    if g_ent is not None and ent is not None:
        p = (z - lse_c).exp()  # [c, V]
        # dL/dz = -p * (g_logp + g_ent (z - E_p[z])) (+ g_logp at the target), in z's buffer
        gz = z.sub_(lse_c - ent[:, None]).mul_(g_ent[:, None])
        if gl is not None:
            gz.add_(gl)
        gz = gz.mul_(p).neg_()
        del p
    else:
        gz = z.sub_(lse_c).exp_()  # p, in z's buffer
        gz = gz.mul_(-gl) if gl is not None else gz.zero_()
    if gl is not None:
        gz[torch.arange(h.size(0), device=h.device), targets] += gl.squeeze(1)
    if factor is not None:
        gz = gz.mul_(factor)  # dL/dl -> dL/du (u = the head's output)
    grad_h = (gz.to(weight.dtype) @ weight).to(h.dtype) if need_h else None
    return grad_h, gz, (gz.sum(0) if bias is not None else None)


class ChunkedTargetLogps(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N], chunk, entropy, transform,
    compiled) -> (logp [N] fp32, entropy [N] fp32, or an empty tensor when not asked for).
    `compiled`: each chunk's work through `posttrain.models.compiled_head` instead of eagerly."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        with_entropy: bool,
        transform: LogitTransform,
        compiled: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.size(0)
        step = chunk if chunk > 0 else max(1, n)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        chunk_fn = (
            functools.partial(compiled_head.forward_chunk, _eager_forward_chunk)
            if compiled
            else _eager_forward_chunk
        )
        for s in range(0, n, step):
            rows = slice(s, s + step)
            logp_c, lse_c, ent_c = chunk_fn(
                hidden[rows], weight, bias, targets[rows], transform, with_entropy
            )
            logp[rows], lse[rows] = logp_c, lse_c
            if ent_c is not None:
                ent[rows] = ent_c
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.step, ctx.with_entropy, ctx.transform = step, with_entropy, transform
        ctx.compiled = compiled
        # An output the loss does not use gets None, not zeros: an entropy only reported (RL
        # without an entropy bonus) then costs its backward term nothing.
        ctx.set_materialize_grads(False)
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
        chunk_fn: Any = _eager_backward_chunk
        if ctx.compiled:
            chunk_fn = compiled_head.backward_chunk
            if g_logp is None:  # one graph either way: a zero gradient adds nothing
                g_logp = torch.zeros_like(lse)
        for s in range(0, hidden.size(0), step):
            rows = slice(s, s + step)
            h = hidden[rows]
            gh, gz, gb = chunk_fn(
                h,
                weight,
                bias,
                targets[rows],
                lse[rows],
                ent[rows] if use_ent else None,
                g_logp[rows] if g_logp is not None else None,
                g_ent[rows] if use_ent else None,
                ctx.transform,
                need_h,
            )  # [c, H] | None, [c, V] (fp32, or the weight's dtype compiled), [V] | None
            if grad_h is not None:
                grad_h[rows] = gh
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(gz.t(), h.float())
                else:
                    grad_w += gz.to(weight.dtype).t() @ h.to(weight.dtype)
            if grad_b is not None:
                grad_b += gb
            del gz, gh
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
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
    transform: LogitTransform = IDENTITY,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] (and the entropy [N] of each position's distribution when `entropy`)
    from hidden states [N, H] through a head of `weight` [V, H] / `bias` [V], its output made
    logits by `transform`; `chunk` tokens per pass (0 = all N at once), each chunk's work
    compiled when `compiled` (`posttrain.models.compiled_head`). fp32 results; exact gradients
    for hidden, weight and bias."""
    logp, ent = ChunkedTargetLogps.apply(
        hidden, weight, bias, targets, chunk, entropy, transform, compiled
    )
    return logp, (ent if entropy else None)


def head_scores(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    entropy: bool,
    transform: LogitTransform = IDENTITY,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position scores of `targets` [B, T] (IGNORE = not scored) from `hidden` [B, T, H]
    through `head` (an nn.Linear, not called: its weight is read) and the model's `transform`
    -> (logp [B, T], entropy [B, T] | None), 0.0 at IGNORE positions. Unlabelled positions
    never reach the head: in a prompt-heavy batch they are most of the tokens.

    `positions` [N]: the flat indices into [B * T] of the scored positions, taken on the host
    by the collator (`posttrain.data.segments.target_positions`): the head then gathers and
    scatters by index without waiting for the device. Without them (targets built on the
    device, as RL's sampled rows) they are found from `targets`, one host sync.

    Each chunk's work is compiled when the head was marked so at session build
    (`compiled_head.use_compiled_head`, `infra.logits_head`), eager otherwise."""
    if hidden.shape[:2] != targets.shape:
        raise ValueError(
            f"the LM head sees positions {tuple(hidden.shape[:2])} but the targets are "
            f"{tuple(targets.shape)}: align the targets with the positions given to the head "
            f"(shifted labels; the last `logits_to_keep` columns when that is set)"
        )
    if positions is None:
        positions = (targets != IGNORE).reshape(-1).nonzero().squeeze(1)  # [N], syncs
    flat_hidden = hidden.reshape(-1, hidden.size(-1))  # [B * T, H]
    logp_n, ent_n = chunked_target_logps(
        flat_hidden.index_select(0, positions),
        head.weight,
        head.bias,
        targets.reshape(-1).index_select(0, positions),
        chunk,
        entropy,
        transform,
        compiled_head.is_compiled(head),
    )  # [N]
    logp = _scatter_scores(logp_n, positions, targets.shape)
    return logp, (None if ent_n is None else _scatter_scores(ent_n, positions, targets.shape))


def _scatter_scores(
    values: torch.Tensor, positions: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    """values [N] at flat `positions` of a zero [B, T] tensor (differentiable)."""
    return values.new_zeros(shape.numel()).index_copy(0, positions, values).view(shape)


def output_head(model: nn.Module) -> nn.Linear:
    """The LM head of a causal LM (through peft wrappers), checked to be a plain linear layer
    and the model's logit transform to be one chunked scoring serves (`model_transform`)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(
            f"chunked log-probs need a plain nn.Linear LM head, got {type(head).__name__} "
            f"(an adapter on the head?): set infra.logits_chunk_tokens: 0"
        )
    model_transform(model)
    return head


def model_transform(model: nn.Module) -> LogitTransform:
    """`logit_transform` of a causal LM's config (through peft wrappers)."""
    return logit_transform(getattr(model, "config", None))


@contextmanager
def scoring_head(
    model: nn.Module,
    targets: torch.Tensor,
    chunk: int,
    entropy: bool = False,
    positions: torch.Tensor | None = None,
) -> Iterator[None]:
    """While active, the model's `.logits` are the log-probs of `targets` [B, T] ([B, T, 2]:
    log-prob, entropy, with `entropy`), computed by the chunked head inside the model's own
    (FSDP2 root) forward. `targets[b, t]` is the token position t predicts (shifted labels),
    IGNORE where nothing is scored. The model's own logit transform is switched off for the
    call (`_transform_off`): the chunked head applies it, and the model's forward would
    otherwise soft-cap or scale the log-probs the head returns. `positions`: the scored
    positions' flat indices, taken on the host (`head_scores`)."""
    head = output_head(model)
    transform = model_transform(model)
    had_own = "forward" in head.__dict__
    previous = head.__dict__.get("forward")

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T] | [B, T, 2]
        logp, ent = head_scores(head, hidden, targets, chunk, entropy, transform, positions)
        return logp if ent is None else torch.stack([logp, ent], dim=-1)

    head.forward = forward
    try:
        with _transform_off(model, transform):
            yield
    finally:
        if had_own:
            head.forward = previous
        else:
            del head.forward


@contextmanager
def _transform_off(model: nn.Module, transform: LogitTransform) -> Iterator[None]:
    """Neutral values, for the duration, where transformers 5.24's forward reads the transform
    after the head: `config.final_logit_softcapping` (Gemma), `config.logits_scaling` (Granite),
    and Cohere's `logit_scale`, which its causal LM copies from the config onto itself at
    construction. Restored afterwards, also on error."""
    if transform.identity:
        yield
        return
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    saved: list[tuple[Any, str, Any]] = []
    if model_type in _SOFTCAP_TYPES:
        saved.append((config, "final_logit_softcapping", None))
    elif model_type in _SCALE_TYPES:
        saved.append((config, "logit_scale", 1.0))
        saved += [(m, "logit_scale", 1.0) for m in model.modules() if "logit_scale" in m.__dict__]
    elif model_type in _DIVISOR_TYPES:
        saved.append((config, "logits_scaling", 1.0))
    kept = [getattr(obj, name) for obj, name, _ in saved]
    try:
        for obj, name, neutral in saved:
            setattr(obj, name, neutral)
        yield
    finally:
        for (obj, name, _), value in zip(saved, kept, strict=True):
            setattr(obj, name, value)


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] labels -> [B, T] targets: position t predicts labels[t + 1]; the last position
    predicts nothing."""
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], pad], dim=1)


def label_logps(
    model: nn.Module, batch: dict[str, Any], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a causal LM over `batch` (input_ids/attention_mask/position_ids/labels,
    [B, T]; `target_positions` from the collator when it took them) -> (log-probs [B, T-1] of
    labels[:, 1:], 0.0 where IGNORE; mask [B, T-1] bool), through the chunked head."""
    targets = shifted_targets(batch["labels"])
    with scoring_head(model, targets, chunk, positions=batch.get("target_positions")):
        logp = model_call(model, batch).logits  # [B, T]
    return logp[:, :-1], targets[:, :-1] != IGNORE


def model_call(model: nn.Module, batch: dict[str, Any]) -> Any:
    """One scoring forward (no KV cache) over a padded batch (input_ids/attention_mask/
    position_ids [B, T]) or a padding-free one (input_ids/position_ids [1, N] and `segments`,
    `posttrain.data.segments`), whose rows' attention stays inside each row."""
    keys = ("input_ids", "attention_mask", "position_ids")
    inputs = {k: batch[k] for k in keys if k in batch} | {"use_cache": False}
    segments = batch.get("segments")
    if segments is None:
        return model(**inputs)
    # A sequence-parallel shard (`posttrain.models.sequence_split`): this rank's slice of
    # the tokens, the segments of the whole sequence, and the group that exchanges them.
    sp = batch.get("sequence_parallel")
    with confined_attention(model) as native:
        # Flash-attention finds the rows from the position ids itself; anything else reads
        # them from the segments, handed down to every attention call as a keyword, and gets
        # an all-ones attention mask: without one, transformers looks for packed rows in the
        # position ids with a `.all()` read to the host every forward (the segments' mask
        # builder returns no mask either way).
        if native and sp is None:
            return model(**inputs)
        if native:
            raise ValueError(
                "sequence parallelism runs through posttrain's varlen attention: set "
                "infra.attention: sdpa (on CUDA in half precision it uses torch's flash varlen "
                "kernel), not flash_attention_2"
            )
        ones = torch.ones_like(inputs["input_ids"])  # [1, N]
        extra = {SEGMENTS_KW: segments} | ({SEQUENCE_PARALLEL_KW: sp} if sp is not None else {})
        return model(**(inputs | {"attention_mask": ones}), **extra)
