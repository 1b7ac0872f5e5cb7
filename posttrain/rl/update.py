"""PPO and the GRPO family (`posttrain.stages.ppo`, `posttrain.stages.grpo`): the online-RL loop
(`posttrain.rl.loop`) with the clipped update's step (`clipped_step`): a scored rollout's
advantages (the registered algorithm's, `posttrain.rl.algorithms`), then `update_epochs` passes
over it in shuffled minibatches of micro x accum sequences per rank (x ranks): clipped policy
loss - entropy bonus (+ KL when it goes in the loss) and, with a critic, vf_coef x the clipped
value loss, aggregated as `loss_aggregation` says (`losses.loss_weights`); then the step's record,
after the KL controller's update from the rollout's KL.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from posttrain.config.batch import ResolvedBatch
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_on_device, all_reduce_sum, all_reduce_sums
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import POLICY
from posttrain.models.roles import VALUE
from posttrain.models.sequence_split import group_of
from posttrain.rl.algorithms import ALGORITHMS, Algorithm
from posttrain.rl.algorithms.advantages import ADVANTAGES
from posttrain.rl.loop import Record, run_loop, write_record
from posttrain.rl.losses import (
    Reduce,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    kl_penalty,
    loss_weights,
    truncated_importance_weights,
)
from posttrain.rl.metrics import UpdateStats, rollout_totals, step_flops
from posttrain.rl.rollout.collect import RolloutBatch, rollout_seed
from posttrain.rl.rollout.sample import (
    Rollout,
    forward_groups,
    forward_inputs,
    response_logps,
    scored_positions,
)
from posttrain.rl.rollout.sp_shard import group_sum
from posttrain.rl.setup import RLRun
from posttrain.runtime.context import StageContext
from posttrain.train.session import TrainSession


@dataclass(frozen=True)
class Advantages:
    """What the update of one rollout of N sequences optimises towards."""

    advantages: torch.Tensor  # [N, R] per token, 0 on padding
    returns: torch.Tensor | None  # [N, R] the critic's value targets; None without a critic
    kl_coef: float  # the KL coefficient of this step (the controller's before this rollout)
    kl_in_loss: float  # the KL term's weight in the loss: kl_coef, or 0 when in the reward
    # [N] bool: rows sampled by older weights than the update's (`posttrain.rl.rollout.offpolicy`),
    # weighted by truncated importance weights against their `behaviour_logps`; None: none
    stale: torch.Tensor | None = None


def compute_advantages(
    algo: Algorithm,
    ro: Rollout,
    cfg: Any,
    kl_coef: float,
    placement: str,
    reduce: Reduce | None,
    lag: torch.Tensor | None = None,
) -> Advantages:
    """Step 3: the algorithm's advantages (`posttrain.rl.algorithms`) with the KL penalty
    where `placement` ("reward" or "loss") puts it: subtracted from the rewards before the
    advantages, or added to the loss by the update. `reduce` sums statistics over ranks (PPO's
    and REINFORCE++'s whitening). `lag` [N]: updates each row's sampler was behind."""
    advantages = ADVANTAGES[algo.advantage]
    adv, returns = advantages(ro, cfg, kl_coef if placement == "reward" else 0.0, reduce)
    stale = lag > 0 if lag is not None and "behaviour_logps" in ro.scored else None
    return Advantages(adv, returns, kl_coef, kl_coef if placement == "loss" else 0.0, stale)


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimizer step on this rank, and how their losses are weighted."""

    rows: torch.Tensor  # [B] rollout row indices (B = micro x accum)
    weights: torch.Tensor  # [B, R] each token's weight in the objective (`loss_weights`)
    scale: float  # world / the minibatch's count over ranks (tokens or sequences)


@dataclass(frozen=True)
class MicroBatch:  # n rows of a minibatch, laid out on the device before its first forward
    rows: torch.Tensor  # [n] rollout row indices, on the device (indexes `device_rows`)
    # `Rollout.inputs` of the rows (input_ids [n, P+R], ...) or their `packed_inputs`
    inputs: dict[str, Any]
    mask: torch.Tensor  # [n, R] 1 on response tokens
    # [M] flat indices into [n * R] of the mask's tokens, found on the host (`scored_positions`)
    positions: torch.Tensor
    weights: torch.Tensor  # [n, R] each token's weight in the minibatch's objective
    scale: float  # the minibatch's
    # Sequence parallelism: `inputs` are this rank's shard of the packed rows, and `mask`,
    # `positions` and `weights` cover the response tokens it scores (`sp_shard`); None: all.
    sp: SequenceParallel | None = None


# The rollout's scores an update reads, [N, R] each, where the rollout has them.
SCORED_KEYS = ("logps", "ref_logps", "behaviour_logps", "values")


def device_rows(ro: Rollout, adv: Advantages, device: torch.device) -> dict[str, torch.Tensor]:
    """What every micro-batch of the update reads of the rollout, copied to the device once
    (a few [N, R] tensors): micro-batches index them there, so an extra micro-batch adds no
    host-to-device copies of its rows (each a wait for the device on a GPU). Without a policy
    scoring pass, "update_logps" [N, R] collects the update's own log-probs (see `update`)."""
    host = {"response": ro.response, "mask": ro.mask, "advantages": adv.advantages}
    host |= {"returns": adv.returns, "stale": adv.stale}
    host |= {k: ro.scored.get(k) for k in SCORED_KEYS}
    out = {k: v.to(device, non_blocking=True) for k, v in host.items() if v is not None}
    if "logps" not in out:
        out["update_logps"] = torch.zeros(ro.mask.shape, device=device)
    return out


def lay_out(
    ro: Rollout,
    mb: Minibatch,
    groups: list[list[int]],
    packed: bool,
    device: torch.device,
    sp: SequenceParallel | None = None,
) -> list[MicroBatch]:
    """The micro-batches of minibatch `mb`, one per group of its positions (`forward_groups`),
    built on the host and sent to the device before the first forward (as the SFT step's);
    with `sp`, this rank's shard of each (`forward_inputs`)."""
    micros = []
    for g in groups:
        at = torch.tensor(g)
        rows = mb.rows[at]
        inputs, mask = forward_inputs(ro, rows, packed, device, sp)  # mask [n, R] on the host
        micros.append(
            MicroBatch(
                rows.to(device, non_blocking=True),
                inputs,
                mask.to(device, non_blocking=True),
                scored_positions(mask).to(device, non_blocking=True),
                (mb.weights[at] * (mask > 0)).to(device, non_blocking=True),
                mb.scale,
                sp,
            )
        )
    return micros


def update(
    tr: TrainSession,
    ro: Rollout,
    adv: Advantages,
    cfg: Any,
    batch: ResolvedBatch,
    seed: int,
    step: int,
    chunk_tokens: int = 0,
    packed: bool = False,
    by_tokens: int | None = None,
) -> UpdateStats:
    """Step 4: `update_epochs` passes of clipped updates over one rollout; pass e shuffles the
    rows with `seed` + e. `step`: the rollout's logged step (1-based), for the guard's records.
    `chunk_tokens`: tokens per pass through the LM head (0 = full logits); `by_tokens`: tokens
    per forward (`batch.by_tokens`; None: micro_batch_size rows each). The device is read once
    per optimizer step (the guard's loss and grad norm) and once at the end (the statistics)."""
    device, world = tr.dist.device, tr.dist.world_size
    sp, counted = group_of(tr.dist), tr.dist.counted
    per_update = batch.micro_batch_size * batch.grad_accum_steps
    # None only on ppo (token_mean); a grpo section holds its algorithm's (GRPOConfig presets).
    aggregation = cfg.loss_aggregation or "token_mean"
    dev = device_rows(ro, adv, device)
    sums: dict[str, torch.Tensor] = {}
    norms: list[float] = []
    for epoch in range(cfg.update_epochs):
        g = torch.Generator().manual_seed(seed + epoch)
        perm = torch.randperm(ro.n, generator=g)
        for u in range(ro.n // per_update):
            rows = perm[u * per_update : (u + 1) * per_update]
            # The mean over the whole minibatch on every rank: per-token weights [rows, R] that
            # depend on their row only (the mask, or the mask over the row's tokens or over
            # max_new_tokens) and a count summed over ranks (tokens or sequences). Each rank
            # scales its weighted sum by world / global count, and FSDP's gradient averaging
            # divides the world back: exactly the global mean at any number of ranks.
            # A sequence-parallel group's ranks hold the same rows: the first counts them.
            weights, count = loss_weights(ro.mask[rows], aggregation, cfg.rollout.max_new_tokens)
            total = all_reduce_sum(count * counted, device)
            mb = Minibatch(rows, weights, world / max(1.0, total))
            groups = forward_groups(ro, rows, batch.micro_batch_size, by_tokens, device)
            micros = lay_out(ro, mb, groups, packed, device, sp)
            share = minibatch_backward(tr, dev, adv, micros, cfg, chunk_tokens, sums)
            # The same on every rank, for the guard: a device tensor, read with the grad norm.
            objective = all_reduce_on_device(share)
            _, norm, lr = tr.optimizer_step(
                cfg.optim.max_grad_norm, loss=objective, step=step, epoch=epoch, update=u
            )
            norms.append(norm)
    if "update_logps" in dev:
        # No policy scoring pass (the rollout's only update): the update's own log-probs,
        # taken before its one optimizer step, are the sampling weights'. Kept as the rollout's
        # so its KL to the reference (the step's `kl`, the adaptive controller's input) is
        # measured, not read as 0.
        ro.scored["logps"] = dev["update_logps"].cpu()
    tot = all_reduce_sums(sums, device)  # one collective and one read for every statistic
    n_tok = max(1.0, tot.pop("tokens"))
    return UpdateStats(
        {k: v / n_tok for k, v in tot.items()}, sum(norms) / len(norms), lr, len(norms)
    )


def minibatch_backward(
    tr: TrainSession,
    dev: dict[str, torch.Tensor],
    adv: Advantages,
    micros: list[MicroBatch],
    cfg: Any,
    chunk_tokens: int,
    sums: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Forward and backward of a minibatch's micro-batches (`lay_out`); gradients are synced
    over ranks by the last forward's backward. Adds each token statistic's sum to `sums`, on
    the device. Returns this rank's share of the minibatch's objective (summed over ranks: the
    objective), a 0-dim device tensor."""
    critic = adv.returns is not None
    share = torch.zeros((), device=tr.dist.device)
    for k, mi in enumerate(micros):
        last = k == len(micros) - 1
        grad_sync(tr.model, last and not critic)
        share = share + policy_backward(tr, dev, adv, mi, cfg, chunk_tokens, sums)
        if critic:
            grad_sync(tr.model, last)
            share = share + value_backward(tr, dev, mi, cfg, sums)
    return share


def add_sums(sums: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], mask: torch.Tensor):
    """sums[name] += the masked sum of each per-token statistic [n, R], on the device."""
    for name, v in stats.items():
        s = (v.detach() * mask).sum()
        sums[name] = sums[name] + s if name in sums else s


def policy_backward(
    tr: TrainSession,
    dev: dict[str, torch.Tensor],
    adv: Advantages,
    mi: MicroBatch,
    cfg: Any,
    chunk_tokens: int,
    sums: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The policy's objective on one micro-batch, backward; as `value_backward`."""
    logp, ent = response_logps(
        tr.model,
        POLICY,
        mi.inputs,
        dev["response"][mi.rows],
        mi.mask,
        chunk_tokens,
        entropy=True,
        temperature=cfg.rollout.temperature,
        positions=mi.positions,
    )  # [n, R] each, under the sampling temperature
    assert ent is not None
    old, ref, behaviour = (
        dev[k][mi.rows] if k in dev else None for k in ("logps", "ref_logps", "behaviour_logps")
    )
    if mi.sp is not None:
        logp, old = whole_rows(logp, old, mi)
    if "update_logps" in dev:  # the update's own, for the rollout's KL (see `update`)
        dev["update_logps"][mi.rows] = logp.detach().float()
    lagged = None
    if "stale" in dev and behaviour is not None:
        lagged = (behaviour, dev["stale"][mi.rows])
    per_token, stats = policy_terms(
        logp, ent, old, ref, dev["advantages"][mi.rows], cfg, adv.kl_in_loss, lagged
    )
    objective = (per_token * mi.weights).sum() * mi.scale
    tr.backward(objective)
    add_sums(sums, stats, mi.mask)
    return objective.detach() / tr.dist.world_size


def whole_rows(
    logp: torch.Tensor, old: torch.Tensor | None, mi: MicroBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence parallelism: `logp` [n, R] holds this rank's log-probs on the tokens it scores
    (`mi.mask`), 0 elsewhere. -> (logp with the old log-probs on the others: ratio 1, finite
    terms, no gradient, weight 0; the old log-probs [n, R]: the rollout's, or without a policy
    scoring pass the group's detached log-probs summed into whole rows, as the unsplit update
    takes its own)."""
    mine = mi.mask > 0
    if old is None:
        old = group_sum(logp.detach().float() * mi.mask, mi.sp)
    return torch.where(mine, logp, old.to(logp.dtype)), old


def policy_terms(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    cfg: Any,
    kl_in_loss: float,
    lagged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy's per-token objective [n, R] (clipped surrogate - entropy_coef x entropy (+
    kl_in_loss x KL)) and the per-token statistics [n, R] the update reports, from its
    log-probs and entropy [n, R] (with grad), the rollout's log-probs under the weights before
    this update (None: the update's own, detached: the rollout's only update, before which
    nothing changed the weights) and under the reference (None: the KL does not count), and
    the advantages [n, R]. `lagged`: (log-probs [n, R] under the weights that sampled, rows [n]
    sampled one update behind): the surrogate of those rows is weighted by the truncated
    importance weights."""
    if old_logp is None:
        old_logp = logp.detach()
    pg, clipped = clipped_policy_loss(
        logp, old_logp, advantages, cfg.clip_range, cfg.clip_range_high
    )  # clip_range_high None = clip_range on both sides
    stats = {}
    if lagged is not None:
        w, truncated = truncated_importance_weights(
            old_logp, lagged[0], lagged[1], cfg.rollout.importance_weight_cap
        )
        pg = w * pg
        stats |= {"is_weight": w, "is_clip_frac": truncated.float()}
    # No entropy bonus: the entropy stays out of the graph (reported only), so the head's
    # backward skips its term (a [chunk, vocab] exp and products per chunk) instead of
    # propagating zeros through it.
    per_token = pg - cfg.entropy_coef * entropy if cfg.entropy_coef else pg
    ratio_log = logp.detach() - old_logp
    stats |= {
        "policy_loss": pg,
        "entropy": entropy,
        "clip_frac": clipped.float(),
        "approx_kl": 0.5 * ratio_log**2,
    }
    if ref_logp is not None:
        kl_t = kl_penalty(logp, ref_logp, cfg.kl.estimator)
        if kl_in_loss:
            per_token = per_token + kl_in_loss * kl_t
        stats["kl_loss"] = kl_t
    stats["tokens"] = torch.ones_like(pg)
    return per_token, stats


def value_backward(
    tr: TrainSession,
    dev: dict[str, torch.Tensor],
    mi: MicroBatch,
    cfg: Any,
    sums: dict[str, torch.Tensor],
) -> torch.Tensor:
    """The critic's objective on one micro-batch (vf_coef x the clipped value loss against the
    returns), backward; its statistics summed into `sums`. Returns this rank's share of the
    objective (its value / world), on the device."""
    values = tr.model(VALUE, **mi.inputs)  # [n, R]
    vf, vclipped = clipped_value_loss(
        values, dev["values"][mi.rows], dev["returns"][mi.rows], cfg.value_clip
    )
    value_objective = cfg.vf_coef * (vf * mi.weights).sum() * mi.scale
    tr.backward(value_objective)
    add_sums(sums, {"value_loss": vf, "value_clip_frac": vclipped.float()}, mi.mask)
    return value_objective.detach() / tr.dist.world_size


def run_online_rl(ctx: StageContext, algorithm: str) -> dict[str, Any]:
    algo = ALGORITHMS[algorithm]
    step = partial(clipped_step, algo=algo)
    return run_loop(ctx, step, critic=algo.critic, kl_placement=algo.kl_placement)


def clipped_step(
    run: RLRun, rb: RolloutBatch, step: int, lag: torch.Tensor, algo: Algorithm
) -> Record:
    """`posttrain.rl.loop.Update` of `algo`: advantages, the clipped update; its `record`
    updates the KL controller from the rollout's KL first."""
    s, cfg = run.rollouts, run.ctx.section
    adv = compute_advantages(algo, rb.rollout, cfg, run.ctl.coef, run.placement, run.reduce, lag)
    update_seed = rollout_seed(s.seed, step, s.rank) + 1
    stats = update(
        run.tr,
        rb.rollout,
        adv,
        cfg,
        run.batch,
        update_seed,
        step + 1,
        s.chunk_tokens,
        s.packed,
        s.by_tokens,
    )

    def record(rb: RolloutBatch, t0: float, t_train: float, timing: dict[str, float]) -> None:
        ro = rb.rollout
        totals = rollout_totals(ro, s.device, cfg.kl.estimator, s.counted)
        # Not scored when it does not count (then the coefficient is fixed). The controller sees
        # the recipe's estimator, the one `kl.target` is stated in and the step's `kl` reports.
        if "kl" in totals:
            run.ctl.update(totals["kl"] / totals["n"], int(totals["n"]))
        flops = step_flops(ro, run.tr, len(s.roles), cfg.update_epochs, run.critic)
        if adv.returns is not None:
            ev = explained_variance(ro.scored["values"], adv.returns, ro.mask, run.reduce)
            timing = timing | {"explained_var": ev}
        loss = stats.means["policy_loss"]
        loss += cfg.vf_coef * stats.means["value_loss"] if run.critic else 0.0
        write_record(
            run, step + 1, rb, totals, stats, t0, t_train, timing, flops, loss, adv.kl_coef
        )

    return record
