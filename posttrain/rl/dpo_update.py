"""Online DPO's step after the rollout (`posttrain.rl.online_dpo`): the judge's pairs and
the DPO update over them.

1. `judge`: each prompt's samples are consecutive rows of the rank's rollout (its group of
   samples_per_prompt); their summed reward (`ro.scored["scores"]`, the reward model's and/or
   the reward functions', as GRPO scores rollouts, with `missing_eos_penalty`) ranks them, and
   `posttrain.rl.pair_select.select_pairs` takes each group's best and worst as a (chosen,
   rejected) pair, skipping groups whose scores tie within `tie_eps`. With both judges, their
   agreement on the groups (`judge_agreement`) is measured too.
2. `dpo_update`: one optimizer step over the pairs of all ranks. Per pair, the policy's log-prob
   of each response (summed over the tokens the rollout's response mask covers, with grad) and
   the reference's (the rollout's reference scoring pass, no grad), under the sampling
   temperature as the RL update reads them; the loss from the preference-loss registry
   (`posttrain.train.preference_losses`), averaged over every rank's pairs.

Each forward of the sharded model is a collective: every rank runs as many micro-batches as the
rank with the most pairs, a rank out of pairs a filler pair with weight 0. A step where no rank
has a pair takes no optimizer step.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum, all_reduce_sums, min_max
from posttrain.models.adapters import POLICY
from posttrain.rl.algorithms.advantages import shaped_scores
from posttrain.rl.pair_select import PairSelection, judge_agreement, select_pairs
from posttrain.rl.rewarder import FUNCTION
from posttrain.rl.rollout.sample import Rollout, model_inputs, response_logps
from posttrain.train.preference_losses import PreferenceLoss
from posttrain.train.session import TrainSession


@dataclass(frozen=True)
class Judged:
    """One rank's rollout as the judge saw it."""

    rows: list[tuple[int, int]]  # (chosen row, rejected row) of each pair, in group order
    selection: PairSelection  # per group: the pairs, informative and all-equal counts
    # the reward model's agreement with the reward functions on this rank's groups; None
    # without both judges
    agreement: float | None


def group_scores(scores: torch.Tensor, group: int) -> list[list[float]]:
    """[N] scores of consecutive groups of `group` samples -> one list of scores per group."""
    if scores.numel() % group:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group}")
    return scores.view(-1, group).tolist()


def judge(ro: Rollout, cfg: Any, rm_weight: float | None) -> Judged:
    """The pairs of this rank's rollout `ro` (scored and rewarded): `select_pairs` over its
    groups' shaped scores, as rollout rows. `rm_weight`: the reward model's weight in the sum
    (None: no reward model); with reward functions (or an environment) beside it, each judge's
    own scores - the reward model's, and the sum minus its share - go to `judge_agreement`."""
    k = cfg.rollout.samples_per_prompt
    sel = select_pairs(group_scores(shaped_scores(ro, cfg), k), tie_eps=cfg.tie_eps)
    rows = [(g * k + c, g * k + r) for g, c, r in sel.pairs]
    agreement = None
    if rm_weight is not None and any(key.startswith(FUNCTION) for key in ro.scored):
        rm = ro.scored["rm_scores"]
        rest = ro.scored["scores"] - rm_weight * rm
        agreement = judge_agreement(group_scores(rm, k), group_scores(rest, k), cfg.tie_eps)
    return Judged(rows, sel, agreement)


def judge_metrics(judged: Judged, device: torch.device) -> dict[str, float]:
    """Over all ranks: `informative_frac` (groups that gave a pair), `all_equal` (groups
    skipped because their scores tie), `pairs`, and `judge_agreement` (mean of the ranks
    that measured one) when both judges scored."""
    sel = judged.selection
    ok = judged.agreement is not None and math.isfinite(judged.agreement)
    t = all_reduce_sums(
        {
            "informative": float(sel.informative),
            "groups": float(sel.informative + sel.all_equal),
            "all_equal": float(sel.all_equal),
            "pairs": float(len(judged.rows)),
            "agreement": judged.agreement if ok else 0.0,
            "measured": float(ok),
        },
        device,
    )
    out = {
        "informative_frac": t["informative"] / max(1.0, t["groups"]),
        "all_equal": t["all_equal"],
        "pairs": t["pairs"],
    }
    if t["measured"]:
        out["judge_agreement"] = t["agreement"] / t["measured"]
    return out


@dataclass(frozen=True)
class DPOStats:
    """What the DPO step over one rollout's pairs measured, over all ranks."""

    # means over the pairs: loss, accuracy, margin, chosen_reward, rejected_reward (empty when
    # no rank had a pair)
    means: dict[str, float]
    pairs: int  # over all ranks
    local_pairs: int  # this rank's
    grad_norm: float  # before clipping; NaN without a step
    lr: float  # of the optimizer step; NaN without one
    updates: int  # optimizer steps taken: 1, or 0 when no rank had a pair


def sequence_logps(
    model: torch.nn.Module,
    ro: Rollout,
    rows: list[int],
    chunk_tokens: int,
    temperature: float,
    packed: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy log-probs [n] with grad, reference log-probs [n] from the rollout's scoring
    pass, lengths [n]) of the responses of `rows`: sums over each response's masked tokens."""
    mask = ro.mask[rows].to(device)  # [n, R]
    logp, _ = response_logps(
        model,
        POLICY,
        model_inputs(ro, rows, packed, device),
        ro.response[rows].to(device),
        mask,
        chunk_tokens,
        temperature=temperature,
    )  # [n, R]
    ref = ro.scored["ref_logps"][rows].to(device)  # [n, R], 0 off the mask
    return (logp * mask).sum(1), (ref * mask).sum(1), mask.sum(1)


def dpo_update(
    tr: TrainSession,
    ro: Rollout,
    pairs: list[tuple[int, int]],
    loss_fn: PreferenceLoss,
    cfg: Any,
    micro_pairs: int,
    step: int,
    chunk_tokens: int = 0,
    packed: bool = False,
) -> DPOStats:
    """One optimizer step on the mean of `loss_fn` over every rank's pairs (this rank's:
    `pairs`, rows of `ro`), `micro_pairs` pairs (chosen and rejected rows together) per
    forward. Each rank backpropagates sum(its pair losses) x world / global pairs, and FSDP's
    gradient averaging divides the world back: the global mean at any number of ranks. `step`:
    the logged step (1-based), for the guard's records."""
    device, world = tr.dist.device, tr.dist.world_size
    total = int(all_reduce_sum(len(pairs), device))
    if not total:
        return DPOStats({}, 0, 0, math.nan, math.nan, 0)
    n_micro = int(min_max(math.ceil(len(pairs) / micro_pairs), device)[1])
    scale = world / total
    sums: Counter[str] = Counter()
    share = 0.0
    for k in range(n_micro):
        chunk = pairs[k * micro_pairs : (k + 1) * micro_pairs]
        weight = torch.ones(len(chunk), device=device)
        if not chunk:  # this rank is out of pairs: a filler forward that counts for nothing
            chunk, weight = [(0, 0)], torch.zeros(1, device=device)
        grad_sync(tr.model, k == n_micro - 1)
        rows = [c for c, _ in chunk] + [r for _, r in chunk]
        pol, ref, lengths = sequence_logps(
            tr.model, ro, rows, chunk_tokens, cfg.rollout.temperature, packed, device
        )
        n = len(chunk)
        losses, chosen, rejected = loss_fn(
            pol[:n], pol[n:], ref[:n], ref[n:], lengths[:n], lengths[n:]
        )  # [n] each
        objective = (losses * weight).sum() * scale
        tr.backward(objective)
        share += float(objective.detach()) / world
        for name, v in (
            ("loss", losses.detach()),
            ("accuracy", (chosen > rejected).float()),
            ("margin", chosen - rejected),
            ("chosen_reward", chosen),
            ("rejected_reward", rejected),
        ):
            sums[name] += float((v * weight).sum())
    loss = all_reduce_sum(share, device)  # the mean loss over all pairs, the same on every rank
    norm, lr = tr.optimizer_step(cfg.optim.max_grad_norm, loss=loss, step=step)
    means = {k: v / total for k, v in all_reduce_sums(dict(sums), device).items()}
    return DPOStats(means, total, len(pairs), norm, lr, 1)
