"""The online-RL loop every online kind runs (PPO and the GRPO family, `posttrain.rl.update`;
online DPO, `posttrain.rl.online_dpo`; distillation, `posttrain.rl.distill`): its setup
(`posttrain.rl.setup`), its steps, held-out evaluations and outputs. A kind brings its update
(`Update`) and the roles it trains; the step around it is written once (`run_step`): generate
and score (`posttrain.rl.rollout.collect`), the kind's update, the new policy to the rollout
engine, the step's record (`posttrain.rl.metrics`) and checkpoint; held-out evaluations
(`posttrain.rl.heldout`) every `eval_every` and at the end.

All four roles live on one base (`posttrain.models.roles`), sharded together by FSDP2.
Checkpoints at rollout boundaries hold the trainable adapters and heads, optimizer, schedule and
the KL coefficient; rollouts are seeded by (seed, step, rank), so a resumed run samples what an
uninterrupted one would.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from posttrain.distributed.runtime import min_max
from posttrain.models.adapters import POLICY
from posttrain.models.roles import VALUE
from posttrain.rl.heldout import evaluate, quality_gate
from posttrain.rl.metrics import UpdateStats, sampler_metrics, train_metrics
from posttrain.rl.rewarder import Rewarder
from posttrain.rl.rollout.collect import RolloutBatch, collect_rollout, generate_round
from posttrain.rl.rollout.offpolicy import PolicySnapshot, Prefetch, score_behaviour, staleness
from posttrain.rl.setup import RLRun, setup
from posttrain.runtime.context import StageContext
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import memory_snapshot
from posttrain.train.checkpoint import data_position
from posttrain.train.session import save_adapter

log = logging.getLogger("posttrain.rl")


# (the rollout with its final timings, when the step began, its training seconds, the step's
# timing fields) -> None: the step's `train` record (and PPO's KL controller update).
Record = Callable[[RolloutBatch, float, float, dict[str, float]], None]
# A kind's update of logged step `step` + 1, after its rollout: (run, the rollout, `step`, each
# row's staleness [N]) -> its `Record`, called once the new policy is with the rollout engine.
Update = Callable[[RLRun, RolloutBatch, int, torch.Tensor], Record]


# `posttrain.rl.heldout.evaluate`'s signature: (rollout setup, held-out rows, logged step, the
# starting policy's figures or None, metrics, samples path) -> (policy's figures, starting's).
Evaluate = Callable[..., tuple[dict[str, float], dict[str, float]]]


def run_loop(
    ctx: StageContext,
    update: Update,
    summary: dict[str, Any] | None = None,
    heldout: Evaluate = evaluate,
    headline: Callable[[dict[str, float]], dict[str, float]] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The stage: setup (`options`: `setup`'s), the steps from the newest checkpoint with
    held-out evaluations, the outputs; returns the summary (with `summary`'s fields, and
    `headline(final figures)`'s in its headline). A rollout server lives as long as this call."""
    with ExitStack() as stack:
        run = setup(ctx, stack, **options)
        cfg, n = ctx.section, run.n_rollouts
        eval_rows = run.data.eval[: cfg.eval_prompts]
        samples = ctx.stage.out_dir / "eval_samples.jsonl" if ctx.is_main else None
        sft: dict[str, float] | None = None
        ahead = Ahead(run.tr.model) if cfg.rollout.max_staleness else None
        for step in range(run.tr.start_step, n):
            run_step(run, step, ahead, update)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < n:
                _, sft = heldout(run.rollouts, eval_rows, step + 1, sft, run.tr.metrics, samples)
        final, sft = heldout(run.rollouts, eval_rows, n, sft, run.tr.metrics, samples)
        extra = headline(final) if headline is not None else {}
        return finish(run, final, sft, headline_extra=extra, **(summary or {}))


class Ahead:
    """max_staleness 1 (`posttrain.rl.rollout.offpolicy`): the next step's generation in the
    background, and the policy adapter of the version that samples it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prefetch = Prefetch()
        self.snapshot = PolicySnapshot(model)


def run_step(run: RLRun, step: int, ahead: Ahead | None, update: Update) -> None:
    """Logged step `step` + 1, as every kind takes it (with `ahead`, the rollout was generated
    in the background during the last step)."""
    s, cfg = run.rollouts, run.ctx.section
    t0 = time.perf_counter()
    heartbeat.beat(phase="rollout")
    generated = ahead.prefetch.take(step) if ahead is not None else None
    prefetching = ahead is not None and step + 1 < run.n_rollouts
    if prefetching:
        ahead.prefetch.start(step + 1, partial(generate_round, s, run.data.train, step + 1, 0))
    rb = collect_rollout(s, run.data.train, step, generated)
    lag = staleness(rb.rollout, step, cfg.rollout.max_staleness)
    if ahead is not None:
        t = time.perf_counter()
        score_behaviour(s, rb.rollout, lag, ahead.snapshot, s.device)
        rb = replace(rb, scoring_s=rb.scoring_s + time.perf_counter() - t)
        ahead.snapshot.take()  # the weights the background rollout is sampled by
    record = update(run, rb, step, lag)
    # A server's stale-sampler check, on the log-probs scoring (or the update) left: a failure
    # ends the stage before the checkpoint and before the server gets this update.
    checked = s.engines[POLICY].check_rollout(rb.rollout, lag)
    # Generation on this step's own path: all of it, or with `ahead` the rounds sampled now.
    own = rb.generation_s - (generated.seconds if generated is not None else 0.0)
    t_train = time.perf_counter() - t0 - own - rb.scoring_s
    # The updated policy to the rollout engine, once the rollout generating ahead is done (no
    # request may be in flight while a server changes weights).
    if ahead is not None:
        t = time.perf_counter()
        ahead.prefetch.wait()  # what the step waited for, of generation
        rb = replace(rb, generation_s=own + time.perf_counter() - t)
    t = time.perf_counter()
    probe = s.engines[POLICY].sync_weights(run.tr.model)  # the `fast` engine's figures
    timing = {"sync_s": time.perf_counter() - t} | probe | checked
    if ahead is not None:
        timing["generation_overlapped_s"] = ahead.prefetch.seconds if prefetching else 0.0
    record(rb, t0, t_train, timing | sampler_metrics(rb.rollout, lag, s.device, s.counted))
    # A checkpoint at a boundary, with the KL coefficient and the data position a resume
    # starts from.
    position = data_position(step + 1, len(run.data.train), cfg.rollout.prompts_per_step, s.seed)
    extra = {"kl_coef": run.ctl.coef, "data": position}
    run.tr.maybe_checkpoint(step + 1, cfg.checkpoint_every, cfg.keep_checkpoints, extra=extra)


def write_record(
    run: RLRun,
    step: int,
    rb: RolloutBatch,
    totals: dict[str, float],
    stats: Any,
    t0: float,
    t_train: float,
    timing: dict[str, float],
    flops: float,
    loss: float | None = None,
    kl_coef: float | None = None,
) -> None:
    """The `train` record of logged step `step` (1-based; every `log_every` and the last).
    `loss` None: the one of `stats.means` (null on a step that took none); `kl_coef` None: no
    KL penalty, no `kl_coef` field. Same collectives on every rank."""
    cfg, tr, ro = run.ctx.section, run.tr, rb.rollout
    if loss is None:  # `loss` is the record's own field, not one of the means
        loss = stats.means.get("loss", math.nan)
        means = {k: v for k, v in stats.means.items() if k != "loss"}
        stats = UpdateStats(means, stats.grad_norm, stats.lr, stats.updates)
    widths = min_max(ro.width[1], run.rollouts.device)
    step_s = time.perf_counter() - t0
    world = run.rollouts.world
    extra = train_metrics(totals, kl_coef or 0.0, widths, rb, t_train, step_s, stats, world)
    if kl_coef is None:
        extra.pop("kl_coef")
    if step % cfg.log_every == 0 or step == run.n_rollouts:
        tr.record_step(
            step,
            loss=loss,
            grad_norm=stats.grad_norm,
            lr=stats.lr,
            # A sequence-parallel group's ranks hold the same rows: the first counts them, and
            # the group's FLOPs (whole rows: sampled alike on every rank, forwards split
            # between them) once, so MFU is the group's useful work over its N devices.
            local_tokens=ro.tokens() if run.rollouts.counted else 0,
            seq_len=ro.tokens() / ro.n,
            t_start=t0,
            t_data=0.0,
            flops=flops * run.rollouts.counted,
            **extra | timing,
        )


def finish(
    run: RLRun,
    final: dict[str, float],
    sft: dict[str, float],
    headline_extra: dict[str, float] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The stage's outputs after the final evaluation; returns the manifest summary."""
    ctx, cfg, tr = run.ctx, run.ctx.section, run.tr
    save_adapter(tr.model, ctx, selected_adapters=[POLICY])
    if run.critic:
        save_adapter(tr.model, ctx, name="critic", selected_adapters=[VALUE])
    tr.metrics.write("end", step=run.n_rollouts, **memory_snapshot(run.rollouts.device))
    tr.metrics.close()
    gate = quality_gate(cfg, final, sft)
    if not gate["passed"]:
        log.error("quality gate: %s", gate["message"])
    if ctx.is_main:
        write_reference(ctx, run.rollouts.rewarder)
    return tr.summary(
        ctx,
        algorithm=ctx.stage.name,
        kl_placement=run.placement,
        kl_estimator=cfg.kl.estimator,  # what eval_kl, the records' kl and max_kl measure
        kl_coef_final=run.ctl.coef,
        eval_final=final,
        eval_sft=sft,
        gate=gate,
        chat_template_sha256=run.template_sha,
        **run.data.stats,
        **fields,
        headline=tr.headline(
            eval_reward=final["reward"],
            sft_reward=sft["reward"],
            reward_gain=final["reward_gain"],
            eval_kl=final["kl"],
            kl_estimator=cfg.kl.estimator,  # beside the figure it names
            **(headline_extra or {}),
        ),
    )


def write_reference(ctx: StageContext, rewarder: Rewarder) -> None:
    """reference.json: what the policy was measured against and rewarded by."""
    reference: dict[str, Any] = {
        "reference": f"{ctx.stage.roles['reference']} adapter",
        "reference_fingerprint": ctx.role_ref("reference").fingerprint,
    }
    if ctx.has_role("teacher"):
        reference["teacher"] = ctx.stage.roles["teacher"]
        reference["teacher_fingerprint"] = ctx.role_ref("teacher").fingerprint
        reference["teacher_base"] = ctx.stage.roles["teacher_base"]
    if ctx.has_role("reward_model"):
        reference["reward_model"] = ctx.stage.roles["reward_model"]
        reference["reward_fingerprint"] = ctx.role_ref("reward_model").fingerprint
        reference["reward_model_weight"] = ctx.section.reward_model_weight
    reference["reward_functions"] = [
        {"label": f.label, "fn": f.fn_ref, "weight": f.weight, "sha256": f.sha256}
        for f in rewarder.funcs
    ]
    (ctx.stage.out_dir / "reference.json").write_text(json.dumps(reference, indent=2))
