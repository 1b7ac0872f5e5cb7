"""distill: on-policy distillation (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes"; TRL's GKDTrainer at lmbda 1).

The student learns where it actually goes: each step it samples answers to its share of the
prompts (the online-RL rollout engine: in process or a rollout server, single- or multi-turn),
the frozen teacher scores every token of them, and one optimizer step lowers the per-token
divergence (`loss`: reverse KL by default, forward KL, or JSD with `beta`) between the two
next-token distributions at `temperature`. The stage (`posttrain.stages.distill`) runs the
online-RL loop (`posttrain.rl.loop.run_loop`: setup, checkpoints, resume, held-out evaluations,
outputs) with its own update (`posttrain.rl.distill_update`).

The teacher (`posttrain.models.teacher`) is a second model on its own base (the `teacher_base`
role; a wider model of the student's family, say), sharded like the student, frozen; built
first, so a teacher of another vocabulary is refused before the student loads.

Records: `train` adds `teacher_kl` (the step's mean per-token divergence, = the loss with
token_mean) and `teacher_agreement` (teacher-forced argmax agreement on the student's answers);
held-out (`eval`): the student's reward and KL to its starting policy (as GRPO's), and on the
student's held-out answers `teacher_kl`, `teacher_agreement`; the teacher's own held-out reward
once (`teacher_reward`), so the headline says how much of the reward gap between the starting
policy and the teacher the student closed (`reward_gap_closed`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from posttrain.distributed.runtime import all_reduce_sum
from posttrain.models.adapters import POLICY
from posttrain.models.loading import load_tokenizer
from posttrain.models.teacher import build_teacher
from posttrain.models.vocab import shared_vocab_size
from posttrain.rl.distill_losses import teacher_gap_closed
from posttrain.rl.distill_update import DistillStats, distill_update, micro_divergence
from posttrain.rl.heldout import evaluate, heldout_batches
from posttrain.rl.loop import Record, run_loop, write_record
from posttrain.rl.metrics import rollout_totals, step_flops
from posttrain.rl.rollout.collect import RolloutBatch, RolloutSetup, generate
from posttrain.rl.rollout.engine import build_engine
from posttrain.rl.rollout.sample import Rollout
from posttrain.rl.setup import RLRun, one_step_shapes
from posttrain.runtime.context import StageContext
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import MetricsWriter

log = logging.getLogger("posttrain.distill")


class Teacher:
    """The teacher as the stage uses it: the model, the shared vocabulary, its parameter count
    (FLOPs), and its held-out figures once measured."""

    def __init__(self, ctx: StageContext) -> None:
        student_tok = load_tokenizer(ctx.role_dir("base") / "tokenizer")
        self.model, _ = build_teacher(ctx, student_tok)
        self.vocab = shared_vocab_size(student_tok)
        self.params = self.model.causal_lm.num_parameters()
        self.heldout: dict[str, float] | None = None


def run_distill(ctx: StageContext) -> dict[str, Any]:
    """The distillation stage: `run_loop` with the distillation step (`distill_step`) and the
    held-out evaluation with the teacher's view; no critic, no KL penalty."""
    cfg = ctx.section
    teacher = Teacher(ctx)

    def heldout(s: RolloutSetup, rows: list[dict], step: int, sft: Any, metrics: Any, path: Any):
        return evaluate_with_teacher(s, rows, step, sft, metrics, path, teacher)

    return run_loop(
        ctx,
        partial(distill_step, teacher=teacher),
        summary={
            "loss_type": cfg.loss,
            "beta": cfg.beta,
            "temperature": cfg.temperature,
            "teacher": ctx.stage.roles["teacher"],
            "teacher_base": ctx.stage.roles["teacher_base"],
            "teacher_params": teacher.params,
        },
        heldout=heldout,
        headline=headline,
        shapes=check_shapes,
        # Neither the policy's nor the reference's log-probs: the loss reads logits.
        passes=lambda *_: (False, False),
    )


# One optimizer step per rollout over all its answers.
check_shapes = one_step_shapes("distillation", "answers")


def distill_step(
    run: RLRun, rb: RolloutBatch, step: int, lag: torch.Tensor, teacher: Teacher
) -> Record:
    """The update of logged step `step` + 1 (`posttrain.rl.loop.Update`): the teacher's scores
    of the student's rollout (rewarded when the stage has reward functions) and the update;
    then the step's record."""
    heartbeat.beat(phase="update")
    stats = distill_update(
        run.tr,
        teacher.model,
        rb.rollout,
        run.ctx.section,
        run.batch.micro_batch_size,
        teacher.vocab,
        step + 1,
        run.rollouts.packed,
    )
    return partial(record, run, step + 1, stats, teacher.params)


def record(
    run: RLRun,
    step: int,
    stats: DistillStats,
    teacher_params: int,
    rb: RolloutBatch,
    t0: float,
    t_train: float,
    timing: dict[str, float],
) -> None:
    """The `train` record of logged step `step` (`write_record`) with the distillation
    step's means. FLOPs: generation, the student's forward and backward, the teacher's forward
    over the rollout."""
    tr, ro = run.tr, rb.rollout
    totals = rollout_totals(ro, run.rollouts.device)
    flops = step_flops(ro, tr.n_matmul, tr.n_trainable, tr.model.config, 0, 1, False)
    flops += 2 * teacher_params * ro.tokens()
    write_record(run, step, rb, totals, stats, t0, t_train, timing, flops)


def evaluate_with_teacher(
    s: RolloutSetup,
    rows: list[dict[str, Any]],
    step: int,
    sft: dict[str, float] | None,
    metrics: MetricsWriter,
    samples_path: Path | None,
    teacher: Teacher,
) -> tuple[dict[str, float], dict[str, float]]:
    """GRPO's held-out evaluation (`posttrain.rl.heldout.evaluate`) plus the teacher's view:
    the divergence and agreement on the student's held-out answers (scored as `evaluate`
    samples them), and (once) the teacher's own held-out reward; written as `eval` records and
    added to the student's figures."""
    sums: Counter[str] = Counter()

    def score_by_teacher(ro: Rollout, w: float) -> None:
        per_token, mask, s_logits, t_logits = micro_divergence(
            s.model, teacher.model, ro, list(range(ro.n)), s.cfg, teacher.vocab, s.packed, s.device
        )
        same = (s_logits.argmax(-1) == t_logits.argmax(-1)).float()
        sums["div"] += w * float((per_token * mask).sum())
        sums["agree"] += w * float((same * mask).sum())
        sums["tokens"] += w * float(mask.sum())

    pol, sft = evaluate(s, rows, step, sft, metrics, samples_path, each=score_by_teacher)
    if teacher.heldout is None:
        teacher.heldout = teacher_heldout(s, rows, teacher)
        metrics.write("eval", step=step, **teacher.heldout)
    t = {k: all_reduce_sum(v, s.device) for k, v in sums.items()}
    n = max(1.0, t["tokens"])
    scored = {"teacher_kl": t["div"] / n, "teacher_agreement": t["agree"] / n}
    metrics.write("eval", step=step, **{f"eval_{k}": v for k, v in scored.items()})
    log.info(
        "held-out: %s %.4f to the teacher, agreement %.3f; teacher reward %.4f",
        s.cfg.loss,
        scored["teacher_kl"],
        scored["teacher_agreement"],
        teacher.heldout["teacher_reward"],
    )
    return pol | scored | teacher.heldout, sft


@torch.no_grad()
def teacher_heldout(s: RolloutSetup, rows: list[dict[str, Any]], teacher: Teacher) -> dict:
    """The teacher's own answers to the held-out prompts (in process, whatever engine the
    student samples with), rewarded like the student's: {"teacher_reward", "teacher_stop_rate"}."""
    engine_cfg = s.cfg.rollout.model_copy(update={"engine": "hf"})
    engine = build_engine(engine_cfg, teacher.model, POLICY, s.world)
    ts = replace(s, model=teacher.model, engines={POLICY: engine})
    sums: Counter[str] = Counter()
    for chunk, w, seed in heldout_batches(s, rows):
        ro = generate(ts, chunk, seed, POLICY)
        s.rewarder(ro, chunk)
        sums["reward"] += w * float(ro.scored["scores"].sum())
        sums["stopped"] += w * float(ro.stopped.sum())
        sums["n"] += w * ro.n
    t = {k: all_reduce_sum(v, s.device) for k, v in sums.items()}
    n = max(1.0, t["n"])
    return {"teacher_reward": t["reward"] / n, "teacher_stop_rate": t["stopped"] / n}


def headline(final: dict[str, float]) -> dict[str, float]:
    """The distillation figures a report leads with, beside the RL ones: the held-out
    divergence to the teacher, agreement, the teacher's reward and the share of the reward
    gap closed (absent when the teacher is not ahead of the starting policy)."""
    out = {
        "eval_teacher_kl": final["teacher_kl"],
        "eval_teacher_agreement": final["teacher_agreement"],
        "teacher_reward": final["teacher_reward"],
    }
    start = final["reward"] - final["reward_gain"]
    closed = teacher_gap_closed(start, final["reward"], final["teacher_reward"])
    if closed is not None:
        out["reward_gap_closed"] = closed
    return out
