"""PPO and the GRPO family (`posttrain.stages.ppo`, `posttrain.stages.grpo`): the online-RL loop
(`posttrain.rl.loop`) with the clipped update's step: the registered algorithm's advantages
(`posttrain.rl.algorithms`), the clipped update (`posttrain.rl.update`), the KL controller's
update from the rollout's KL, and the step's `train` record."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

from posttrain.distributed.runtime import min_max
from posttrain.rl.algorithms import ALGORITHMS, Algorithm
from posttrain.rl.loop import Record, run_loop
from posttrain.rl.losses import explained_variance
from posttrain.rl.metrics import rollout_totals, step_flops, train_metrics
from posttrain.rl.rollout.collect import RolloutBatch, rollout_seed
from posttrain.rl.setup import RLRun
from posttrain.rl.update import Advantages, UpdateStats, compute_advantages, update
from posttrain.stages.common import StageContext


def run_online_rl(ctx: StageContext, algorithm: str) -> dict[str, Any]:
    """The PPO/GRPO stage: `run_loop` with the clipped update's step (`clipped_step`)."""
    algo = ALGORITHMS[algorithm]
    step = partial(clipped_step, algo=algo)
    return run_loop(ctx, step, critic=algo.critic, kl_placement=algo.kl_placement)


def clipped_step(
    run: RLRun, rb: RolloutBatch, step: int, lag: torch.Tensor, algo: Algorithm
) -> Record:
    """The update of logged step `step` + 1 (`posttrain.rl.loop.Update`) of `algo`: the
    rollout's advantages and the clipped update over them; then the step's record (`record`)."""
    s, cfg = run.rollouts, run.ctx.section
    adv = compute_advantages(algo, rb.rollout, cfg, run.ctl.coef, run.placement, run.reduce, lag)
    update_seed = rollout_seed(s.seed, step, s.rank) + 1
    stats = update(
        run.tr, rb.rollout, adv, cfg, run.batch, update_seed, step + 1, s.chunk_tokens, s.packed
    )
    return partial(record, run, step + 1, adv, stats)


def record(
    run: RLRun,
    step: int,
    adv: Advantages,
    stats: UpdateStats,
    rb: RolloutBatch,
    t0: float,
    t_train: float,
    timing: dict[str, float],
) -> None:
    """The `train` record of logged step `step` (1-based; every `log_every` and the last), from
    the rollout, its totals over ranks (`rollout_totals`: also the KL controller's update from
    the rollout's KL), its advantages and the update's stats; `t0`: when the step began;
    `timing`: the step's other fields (weight sync, the sampler's figures). Runs the same
    collectives on every rank."""
    totals = rollout_totals(rb.rollout, run.rollouts.device)
    if "kl" in totals:  # not scored when it does not count (then the coefficient is fixed)
        run.ctl.update(totals["kl"] / totals["n"], int(totals["n"]))
    cfg, tr, ro, device = run.ctx.section, run.tr, rb.rollout, run.rollouts.device
    widths = min_max(ro.width[1], device)
    flops = step_flops(
        ro,
        tr.n_matmul,
        tr.n_trainable,
        tr.model.config,
        len(run.rollouts.roles),
        cfg.update_epochs,
        run.critic,
    )
    step_s = time.perf_counter() - t0
    extra = (
        train_metrics(totals, adv.kl_coef, widths, rb, t_train, step_s, stats, run.rollouts.world)
        | timing
    )
    if adv.returns is not None:
        extra["explained_var"] = explained_variance(
            ro.scored["values"], adv.returns, ro.mask, run.reduce
        )
    loss = stats.means["policy_loss"] + (
        cfg.vf_coef * stats.means["value_loss"] if run.critic else 0.0
    )
    if step % cfg.log_every == 0 or step == run.n_rollouts:
        tr.record_step(
            step,
            loss=loss,
            grad_norm=stats.grad_norm,
            lr=stats.lr,
            local_tokens=ro.tokens(),
            seq_len=ro.tokens() / ro.n,
            t_start=t0,
            t_data=0.0,
            flops=flops,
            **extra,
        )
