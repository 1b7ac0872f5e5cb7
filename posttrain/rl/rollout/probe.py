"""The stale-sampler probe: after every weight refresh of a sampler that holds weights of its own
(the `fast` engine's merged copy), score one fixed token sequence with the sampler and with the
trainer's own scoring path and compare the log-probs. A sampler that silently kept the old
policy, folded the adapter wrongly or lost a weight on the way scores tokens differently than
the trainer does, and the stage fails with `StaleSampler` naming the engine and the figures
instead of training on rollouts of a policy it does not hold.

The probe: `PROBE_ROWS` rows of token ids drawn from the vocabulary with a fixed seed (the
figure is a function of the weights, never of the data), the second row shorter and
left-padded like a rollout batch. The figure: mean |log p_sampler - log p_trainer| over the
probe's predicted tokens (its max is recorded beside it). Tolerances by the sampler's dtype
(`rollout.sampler_probe_tolerance` overrides): fp32 1e-3 (both paths agree to ~1e-5 on CPU),
bf16 0.05 (bf16 rounds logits of magnitude ~20 by ~0.08: the mean of that noise stays well
under it, while a sampler a few updates behind or with a mis-scaled adapter does not). One
update of a small learning rate can move log-probs by less than bf16's noise: the probe
catches a sampler that never follows, or follows wrongly, not a single skipped small update.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from posttrain.data.chat import IGNORE
from posttrain.errors import StaleSampler
from posttrain.rl.rollout.engine import left_pad

PROBE_ROWS, PROBE_LEN = 2, 48
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.05, torch.float16: 0.05}


def probe_ids(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [PROBE_ROWS, PROBE_LEN], attn [same]): fixed token ids, the second row 3/4 as long
    and left-padded (pad id 0, masked)."""
    g = torch.Generator().manual_seed(20261207)
    lengths = [PROBE_LEN, PROBE_LEN * 3 // 4]
    rows = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
    return left_pad(rows, 0)


def _targets(ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[n, T-1]: the next token of each position, IGNORE where it is padding."""
    return ids[:, 1:].masked_fill(attn[:, 1:] == 0, IGNORE)


@torch.no_grad()
def trainer_logps(
    model: nn.Module, role: str, ids: torch.Tensor, attn: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """[n, T-1] log-probs of the probe's next tokens through the trainer's scoring path (the
    role model's forward, its chunked head when `chunk_tokens`), 0 on padding. A collective
    under FSDP2: every rank runs it."""
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    targets = _targets(ids, attn)
    was_training = model.training
    model.eval()  # no adapter dropout: the weights' scores, not the RNG's
    try:
        if chunk_tokens:
            y = model(role, ids, attn, pos, 0, ids.size(1) - 1, targets, chunk_tokens)
        else:
            logits = model(role, ids, attn, pos, 0, ids.size(1) - 1).float()  # [n, T-1, V]
            y = _gather(logits, targets)
    finally:
        model.train(was_training)
    return y.float().masked_fill(targets == IGNORE, 0.0).cpu()


@torch.no_grad()
def sampler_logps(plain: nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[n, T-1] the same log-probs through the sampler's plain causal LM (its own head and
    logit transform), 0 on padding."""
    device = next(plain.parameters()).device
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = plain(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
    targets = _targets(ids, attn)
    return _gather(logits[:, :-1].float(), targets).masked_fill(targets == IGNORE, 0.0).cpu()


def _gather(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits [n, T, V]) at targets [n, T] (IGNORE read as token 0)."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)


def compare(
    sampler: torch.Tensor,
    trainer: torch.Tensor,
    mask: torch.Tensor,
    tolerance: float,
    engine: str,
    version: int,
    what: str = "the probe's tokens",
) -> dict[str, float]:
    """The figures {sampler_probe_mean, sampler_probe_max} over the positions `mask` [n, T]
    (bool) of sampler/trainer [n, T] log-probs (over every rank: the worst), or `StaleSampler`
    when the mean exceeds `tolerance`. {} when no rank had a position to compare. `what`: the
    tokens compared, as the message names them. A collective under torch.distributed."""
    diff = (sampler - trainer).abs()[mask.bool()]
    # -inf where this rank compared nothing: the MAX over ranks then ignores it.
    figures = torch.tensor(
        [float(diff.mean()), float(diff.max())] if diff.numel() else [-math.inf] * 2,
        dtype=torch.float64,
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Every rank fails together: one rank's verdict would leave the others in a collective.
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        figures = figures.to(device)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    mean, worst = (float(x) for x in figures.cpu())
    if mean == -math.inf:
        return {}
    if not mean <= tolerance:  # NaN fails too
        raise StaleSampler(
            f"rollout.engine {engine!r}: after the weight refresh to policy version {version} "
            f"the sampler scores {what} {mean:.3g} nats per token apart from the "
            f"trainer on average (max {worst:.3g}; tolerance {tolerance:g}): it does not hold "
            "the weights the trainer has (stale weights, or wrongly merged or loaded ones), and "
            "rollouts from it would not be the policy's"
        )
    return {"sampler_probe_mean": mean, "sampler_probe_max": worst}
