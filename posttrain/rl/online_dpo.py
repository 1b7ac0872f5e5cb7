"""online_dpo: DPO on the policy's own answers, judged as they are sampled (online DPO, Guo et
al. 2024, "Direct Language Model Alignment from Online AI Feedback"; TRL's OnlineDPOTrainer).

Offline DPO learns from pairs someone else's model wrote; here every step's pairs are the
current policy's, so what it learns is about its own mistakes and the pairs move with it. The
stage (`posttrain.stages.online_dpo`) runs the online-RL loop (`posttrain.rl.loop.run_loop`:
setup, held-out evaluations, checkpoints, outputs) with its own step:
1. generate and score (`posttrain.rl.rollout.collect`): each rank samples samples_per_prompt answers
   for its share of prompts_per_step prompts; the reference scores them (always: its log-probs
   are DPO's), the judge rewards them - the reward model, the reward functions, or both summed
   with their weights, exactly as GRPO's rollouts are rewarded;
2. judge (`posttrain.rl.dpo_update.judge`): per prompt, the best answer is chosen and the worst
   rejected; a prompt whose answers tie within `tie_eps` gives no pair (`all_equal`);
3. update (`posttrain.rl.dpo_update.dpo_update`): one optimizer step on the preference loss
   (`loss`, `beta`) averaged over every rank's pairs, against the frozen reference (by default
   the policy the stage starts from).
Its `train` record holds DPO's figures over the step's pairs (accuracy, margin, chosen_reward,
rejected_reward), the judge's (informative_frac, all_equal, pairs, judge_agreement with both
judges) and the rollout's reward (score_mean). The policy's sampling temperature applies to the
log-probs of both models, as in the RL update (at the default 1.0, the models' own).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from posttrain.rl.dpo_update import DPOStats, Judged, dpo_update, judge, judge_metrics
from posttrain.rl.loop import Record, run_loop, write_record
from posttrain.rl.metrics import rollout_totals, step_flops
from posttrain.rl.rollout.collect import RolloutBatch
from posttrain.rl.rollout.sample import Rollout
from posttrain.rl.setup import RLRun, one_step_shapes
from posttrain.runtime.context import StageContext
from posttrain.telemetry.metrics import train_flops_per_token
from posttrain.train.preference_losses import (
    PreferenceLoss,
    loss_hyperparameters,
    preference_loss,
)


def run_online_dpo(ctx: StageContext) -> dict[str, Any]:
    """The online DPO stage: `run_loop` with the DPO step (`dpo_step`); no critic, and the KL
    (coef 0) is not applied."""
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
    """The section's preference loss with its hyperparameters bound (fails on a bad value)."""
    hp = {"beta": cfg.beta, "label_smoothing": cfg.label_smoothing, "gamma": cfg.simpo_gamma}
    return preference_loss(cfg.loss, **{k: hp[k] for k in loss_hyperparameters(cfg.loss)})


# One optimizer step per rollout over all its pairs (chosen and rejected rows together).
check_shapes = one_step_shapes("online DPO", "pairs (half as many as its sequences)")


def dpo_step(
    run: RLRun, rb: RolloutBatch, step: int, lag: torch.Tensor, loss_fn: PreferenceLoss
) -> Record:
    """The update of logged step `step` + 1 (`posttrain.rl.loop.Update`): the rollout's pairs
    (the judge's) and the DPO step over them; then the step's record, with the judge's
    figures."""
    s, cfg = run.rollouts, run.ctx.section
    judged = judge(rb.rollout, cfg, s.rewarder.rm_weight)
    stats = dpo_update(
        run.tr,
        rb.rollout,
        judged.rows,
        loss_fn,
        cfg,
        max(1, run.batch.micro_batch_size // 2),
        step + 1,
        s.chunk_tokens,
        s.packed,
    )
    return partial(record, run, step + 1, stats, judged)


def record(
    run: RLRun,
    step: int,
    stats: DPOStats,
    judged: Judged,
    rb: RolloutBatch,
    t0: float,
    t_train: float,
    timing: dict[str, float],
) -> None:
    """The `train` record of logged step `step` (`write_record`): DPO's means over the
    step's pairs in place of the clipped update's, the judge's figures; loss, grad_norm and lr
    are null on a step without pairs."""
    ro = rb.rollout
    timing = timing | judge_metrics(judged, run.rollouts.device)
    totals = rollout_totals(ro, run.rollouts.device)
    # No policy scoring pass: the rollout's KL would read as 0 (the held-out KL is measured).
    totals.pop("kl", None)
    # Generation and the scoring passes over the rollout, forward+backward over the pairs' rows.
    tr, roles = run.tr, len(run.rollouts.roles)
    flops = step_flops(ro, tr.n_matmul, tr.n_trainable, tr.model.config, roles, 0, False)
    flops += pair_flops(run, ro, stats)
    write_record(run, step, rb, totals, stats, t0, t_train, timing, flops)


def pair_flops(run: RLRun, ro: Rollout, stats: DPOStats) -> float:
    """This rank's training FLOPs of the DPO step: forward and backward over its pairs' rows
    (estimated at the rollout's mean row length)."""
    if not stats.updates:
        return 0.0
    cfg, seq_len = run.tr.model.config, ro.tokens() / ro.n
    per_tok = train_flops_per_token(
        run.tr.n_matmul, run.tr.n_trainable, cfg.num_hidden_layers, cfg.hidden_size, int(seq_len)
    )
    return per_tok * seq_len * 2 * stats.local_pairs
