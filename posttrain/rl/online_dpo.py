"""online_dpo: DPO on the policy's own answers, judged as they are sampled (online DPO, Guo et
al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's OnlineDPOTrainer).

Offline DPO learns from pairs someone else's model wrote; here every step's pairs are the
current policy's, so what it learns is about its own mistakes and the pairs move with it. The
stage runs the online-RL loop (`posttrain.rl.loop.run_loop`) with its own step (`dpo_step`):
1. the rollout is scored by the reference (always: its log-probs are DPO's) and rewarded as
   GRPO's is (`ro.scored["scores"]`, with `missing_eos_penalty`);
2. `judge`: a prompt's samples (its group: consecutive rows) are ranked by their reward;
   `posttrain.rl.pair_select.select_pairs` takes each group's best and worst as a (chosen,
   rejected) pair, skipping groups that tie within `tie_eps`. With both judges, their agreement
   (`judge_agreement`) is measured too;
3. `dpo_update`: one optimizer step over the pairs of all ranks, on the summed log-probs of each
   response (the policy's with grad, the reference's from the rollout's scoring pass, both under
   the sampling temperature, as in the RL update) and the preference-loss registry's loss
   (`posttrain.train.preference_losses`).

Each forward of the sharded model is a collective: every rank runs as many micro-batches as the
rank with the most pairs, a rank out of pairs a filler pair with weight 0. A step where no rank
has a pair takes no optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import (
    all_reduce_on_device,
    all_reduce_sum,
    all_reduce_sums,
)
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import POLICY
from posttrain.models.sequence_split import group_of, sum_over_group
from posttrain.rl.algorithms.advantages import shaped_scores
from posttrain.rl.loop import Record, run_loop, write_record
from posttrain.rl.metrics import UpdateStats, rollout_totals, step_flops, token_train_flops
from posttrain.rl.pair_select import PairSelection, judge_agreement, select_pairs
from posttrain.rl.rewarder import FUNCTION
from posttrain.rl.rollout.collect import RolloutBatch
from posttrain.rl.rollout.sample import (
    Rollout,
    balanced_groups,
    forward_inputs,
    response_logps,
    row_tokens,
    scored_positions,
)
from posttrain.rl.setup import RLRun, one_step_shapes
from posttrain.runtime.context import StageContext
from posttrain.train.losses import pair_outcome
from posttrain.train.preference_losses import (
    PreferenceLoss,
    loss_hyperparameters,
    preference_loss,
)
from posttrain.train.session import TrainSession


def run_online_dpo(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    return run_loop(
        ctx,
        partial(dpo_step, loss_fn=bound_loss(cfg)),
        summary={"loss_type": cfg.loss, "beta": cfg.beta, "tie_eps": cfg.tie_eps},
        shapes=check_shapes,
        # The policy's log-probs are the update's own; the reference's are DPO's, whatever kl.
        passes=lambda *_: (False, True),
    )


def bound_loss(cfg: Any) -> PreferenceLoss:
    hp = {"beta": cfg.beta, "label_smoothing": cfg.label_smoothing, "gamma": cfg.simpo_gamma}
    return preference_loss(cfg.loss, **{k: hp[k] for k in loss_hyperparameters(cfg.loss)})


# One optimizer step per rollout over all its pairs (chosen and rejected rows together).
check_shapes = one_step_shapes("online DPO", "pairs (half as many as its sequences)")


def dpo_step(
    run: RLRun, rb: RolloutBatch, step: int, lag: torch.Tensor, loss_fn: PreferenceLoss
) -> Record:
    """`posttrain.rl.loop.Update`: the judge's pairs and the DPO step over them; its record
    has the judge's figures (loss, grad_norm and lr null on a step without pairs)."""
    s, cfg = run.rollouts, run.ctx.section
    judged = judge(rb.rollout, cfg, s.rewarder.rm_weight)
    micro = max(1, run.batch.micro_batch_size // 2)
    stats = dpo_update(
        run.tr,
        rb.rollout,
        judged.rows,
        loss_fn,
        cfg,
        micro,
        step + 1,
        s.chunk_tokens,
        s.packed,
        s.by_tokens,
    )

    def record(rb: RolloutBatch, t0: float, t_train: float, timing: dict[str, float]) -> None:
        ro = rb.rollout
        timing = timing | judge_metrics(judged, s.device, s.counted)
        totals = rollout_totals(ro, s.device, cfg.kl.estimator, s.counted)
        # No policy scoring pass: the rollout's KL would read as 0 (the held-out KL is measured).
        totals.pop("kl", None)
        # Generation and the scoring passes, then forward+backward over the pairs' rows (at the
        # rollout's mean row length).
        flops = step_flops(ro, run.tr, len(s.roles), 0, False)
        if stats.updates:
            flops += token_train_flops(run.tr, ro) * (ro.tokens() / ro.n) * 2 * stats.local_pairs
        write_record(run, step + 1, rb, totals, stats, t0, t_train, timing, flops)

    return record


@dataclass(frozen=True)
class Judged:
    """One rank's rollout as the judge saw it."""

    rows: list[tuple[int, int]]  # (chosen row, rejected row) of each pair, in group order
    selection: PairSelection  # per group: the pairs, informative and all-equal counts
    # the reward model's agreement with the reward functions on this rank's groups; None
    # without both judges
    agreement: float | None


def group_scores(scores: torch.Tensor, group: int) -> list[list[float]]:  # [N] -> per group
    if scores.numel() % group:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {group}")
    return scores.view(-1, group).tolist()


def judge(ro: Rollout, cfg: Any, rm_weight: float | None) -> Judged:
    """The pairs of this rank's scored rollout, as rollout rows. `rm_weight`: the reward
    model's weight in the sum (None: none); with reward functions beside it, each judge's own
    scores - the reward model's, and the sum minus its share - go to `judge_agreement`."""
    k = cfg.rollout.samples_per_prompt
    sel = select_pairs(group_scores(shaped_scores(ro, cfg), k), tie_eps=cfg.tie_eps)
    rows = [(g * k + c, g * k + r) for g, c, r in sel.pairs]
    agreement = None
    if rm_weight is not None and any(key.startswith(FUNCTION) for key in ro.scored):
        rm = ro.scored["rm_scores"]
        rest = ro.scored["scores"] - rm_weight * rm
        agreement = judge_agreement(group_scores(rm, k), group_scores(rest, k), cfg.tie_eps)
    return Judged(rows, sel, agreement)


def judge_metrics(judged: Judged, device: torch.device, counted: float = 1.0) -> dict[str, float]:
    """The judge's figures over all ranks (`judge_agreement`: mean of the ranks that
    measured one). `counted`: this rank's weight (0 on a sequence-parallel rank after its
    group's first, which judged the same rows)."""
    sel = judged.selection
    ok = judged.agreement is not None and math.isfinite(judged.agreement)
    figures = {
        "informative": float(sel.informative),
        "groups": float(sel.informative + sel.all_equal),
        "all_equal": float(sel.all_equal),
        "pairs": float(len(judged.rows)),
        "agreement": judged.agreement if ok else 0.0,
        "measured": float(ok),
    }
    t = all_reduce_sums({k: v * counted for k, v in figures.items()}, device)
    out = {
        "informative_frac": t["informative"] / max(1.0, t["groups"]),
        "all_equal": t["all_equal"],
        "pairs": t["pairs"],
    }
    if t["measured"]:
        out["judge_agreement"] = t["agreement"] / t["measured"]
    return out


@dataclass(frozen=True)
class DPOStats(UpdateStats):
    """The DPO step over all ranks' pairs: means of loss, accuracy, margin, chosen_reward and
    rejected_reward; empty, NaN and 0 updates when no rank had a pair."""

    pairs: int  # over all ranks
    local_pairs: int  # this rank's


def sequence_logps(
    model: torch.nn.Module,
    ro: Rollout,
    rows: list[int],
    chunk_tokens: int,
    temperature: float,
    packed: bool,
    device: torch.device,
    sp: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy log-probs [n] with grad, reference log-probs [n], lengths [n]) of the
    responses of `rows`: sums over each response's masked tokens. With `sp` the forward takes
    this rank's shard of the packed rows and scores the tokens it holds; the group's parts add
    up to whole rows (`sum_over_group`: identity backward, each rank's gradient reaches its own
    tokens), the same on every rank of the group."""
    inputs, scored = forward_inputs(ro, rows, packed, device, sp)  # scored [n, R] on the host
    mine = scored.to(device, non_blocking=True)  # [n, R]: every response token without sp
    logp, _ = response_logps(
        model,
        POLICY,
        inputs,
        ro.response[rows].to(device, non_blocking=True),
        mine,
        chunk_tokens,
        temperature=temperature,
        positions=scored_positions(scored).to(device, non_blocking=True),
    )  # [n, R]
    pol = (logp * mine).sum(1)  # [n]: this rank's part of each row under sp
    if sp is not None:
        pol = sum_over_group(pol, sp)
    mask = ro.mask[rows].to(device, non_blocking=True)  # [n, R], the whole rows
    ref = ro.scored["ref_logps"][rows].to(device, non_blocking=True)  # [n, R], 0 off the mask
    return pol, (ref * mask).sum(1), mask.sum(1)


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
    by_tokens: int | None = None,
) -> DPOStats:
    """One optimizer step on the mean of `loss_fn` over every rank's pairs, `micro_pairs` pairs
    per forward, or with `by_tokens` (`batch.by_tokens`) as many pairs as fit that many tokens
    (both rows of a pair in one forward). Each rank backpropagates sum(its pair losses) x world
    / global pairs, and FSDP's gradient averaging divides the world back: the global mean at any
    number of ranks. The device is read once for the guard and once for the statistics.
    Under sequence parallelism a group's ranks hold the same pairs and compute the same pair
    losses (each scoring its shard of the rows): the first counts them (`counted`), so `total`
    is the global pair count while `world` stays all ranks (FSDP averages over all of them, and
    the group's gradient parts add up to its pairs' gradient)."""
    device, world = tr.dist.device, tr.dist.world_size
    sp, counted = group_of(tr.dist), tr.dist.counted
    total = int(all_reduce_sum(len(pairs) * counted, device))
    if not total:
        return DPOStats({}, math.nan, math.nan, 0, 0, 0)
    tokens = row_tokens(ro)
    groups = balanced_groups(
        len(pairs),
        micro_pairs,
        lambda p: tokens[pairs[p][0]] + tokens[pairs[p][1]],
        by_tokens,
        device,
    )
    scale = world / total
    sums: dict[str, torch.Tensor] = {}
    share = torch.zeros((), device=device)
    for k, group in enumerate(groups):
        chunk = [pairs[p] for p in group]
        weight = torch.ones(len(chunk), device=device)
        if not chunk:  # this rank is out of pairs: a filler forward that counts for nothing
            chunk, weight = [(0, 0)], torch.zeros(1, device=device)
        grad_sync(tr.model, k == len(groups) - 1)
        rows = [c for c, _ in chunk] + [r for _, r in chunk]
        pol, ref, lengths = sequence_logps(
            tr.model, ro, rows, chunk_tokens, cfg.rollout.temperature, packed, device, sp
        )
        n = len(chunk)
        losses, chosen, rejected = loss_fn(
            pol[:n], pol[n:], ref[:n], ref[n:], lengths[:n], lengths[n:]
        )  # [n] each
        objective = (losses * weight).sum() * scale
        tr.backward(objective)
        share = share + objective.detach() * counted / world
        add_pair_sums(sums, losses.detach(), chosen, rejected, weight * counted)
    # The mean loss over all pairs, the same on every rank: read with the grad norm.
    loss = all_reduce_on_device(share)
    _, norm, lr = tr.optimizer_step(cfg.optim.max_grad_norm, loss=loss, step=step)
    means = {k: v / total for k, v in all_reduce_sums(sums, device).items()}
    return DPOStats(means, norm, lr, 1, total, len(pairs))


def add_pair_sums(
    sums: dict[str, torch.Tensor],
    losses: torch.Tensor,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    weight: torch.Tensor,
) -> None:
    """sums[name] += the weighted sum of each pair statistic ([n] each, on the device)."""
    for name, v in (
        ("loss", losses),
        ("accuracy", pair_outcome(chosen, rejected)),
        ("margin", chosen - rejected),
        ("chosen_reward", chosen),
        ("rejected_reward", rejected),
    ):
        v = (v * weight).sum()
        sums[name] = sums[name] + v if name in sums else v
