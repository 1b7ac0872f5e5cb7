"""distill: on-policy distillation (GKD, Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes"; TRL's GKDTrainer at lmbda 1).

The student learns where it actually goes: each step it samples answers to its share of the
prompts, the frozen teacher scores every token of them, and one optimizer step lowers the
per-token divergence (`loss`) between the two next-token distributions at `temperature`: the
online-RL loop (`posttrain.rl.loop.run_loop`) with its own update (`distill_update`). The
teacher (`posttrain.models.teacher`, on its own base) is built first, so a teacher of another
vocabulary is refused before the student loads.

The update, per micro-batch of rollout rows: the teacher's logits at the response positions (no
grad), the student's (with grad), both sliced to the shared vocabulary (heads padded to
different sizes within a family), the per-token divergence
(`posttrain.rl.distill_losses.token_divergence`, chunked: no full fp32 log-softmax of either
model is ever held), then backward. The step's loss is a mean over every rank's response tokens
(`token_mean`) or answers (`sequence_mean`): each rank backpropagates its sum x world / global
count, and FSDP's gradient averaging divides the world back, so the result does not depend on
how rows are split over ranks or micro-batches. Each forward of a sharded model is a
collective: every rank runs as many micro-batches as the rank with the most rows; a rank out of
rows runs a filler row of weight 0.

Records: `train` adds `teacher_kl` and `teacher_agreement` (teacher-forced argmax agreement on
the student's answers); `eval` adds both on the student's held-out answers and the teacher's own
held-out reward once (`teacher_reward`), so the headline says how much of the reward gap between
the starting policy and the teacher the student closed (`reward_gap_closed`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
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
from posttrain.models.loading import load_tokenizer
from posttrain.models.sequence_split import group_of
from posttrain.models.teacher import build_teacher, teacher_logits
from posttrain.models.vocab import shared_vocab_size
from posttrain.rl.distill_losses import objective_sum, teacher_gap_closed, token_divergence
from posttrain.rl.heldout import evaluate, heldout_batches, heldout_means
from posttrain.rl.loop import Record, run_loop, write_record
from posttrain.rl.metrics import UpdateStats, add_rollout_sums, rollout_totals, step_flops
from posttrain.rl.rollout.collect import RolloutBatch, RolloutSetup, generate, reward
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.sample import Rollout, balanced_groups, forward_inputs, row_tokens
from posttrain.rl.setup import RLRun, one_step_shapes
from posttrain.runtime.context import StageContext
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import MetricsWriter
from posttrain.train.session import TrainSession

log = logging.getLogger("posttrain.distill")


class Teacher:
    """The teacher as the stage uses it, with its held-out figures once measured."""

    def __init__(self, ctx: StageContext) -> None:
        student_tok = load_tokenizer(ctx.role_dir("base") / "tokenizer")
        self.model, _ = build_teacher(ctx, student_tok)
        self.vocab = shared_vocab_size(student_tok)
        self.params = self.model.causal_lm.num_parameters()
        self.heldout: dict[str, float] | None = None


def run_distill(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    teacher = Teacher(ctx)
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
        heldout=partial(evaluate_with_teacher, teacher=teacher),
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
    """`posttrain.rl.loop.Update`: the distillation update; its record's FLOPs add the
    teacher's forward."""
    heartbeat.beat(phase="update")
    cfg, micro, packed = run.ctx.section, run.batch.micro_batch_size, run.rollouts.packed
    stats = distill_update(
        run.tr,
        teacher.model,
        rb.rollout,
        cfg,
        micro,
        teacher.vocab,
        step + 1,
        packed,
        run.rollouts.by_tokens,
    )

    def record(rb: RolloutBatch, t0: float, t_train: float, timing: dict[str, float]) -> None:
        ro = rb.rollout
        totals = rollout_totals(ro, run.rollouts.device, cfg.kl.estimator, run.rollouts.counted)
        flops = step_flops(ro, run.tr, 0, 1, False) + 2 * teacher.params * ro.tokens()
        write_record(run, step + 1, rb, totals, stats, t0, t_train, timing, flops)

    return record


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
    divergence and agreement on the student's held-out answers, and (once) the teacher's own
    held-out reward."""
    sums: Counter[str] = Counter()

    def score_by_teacher(ro: Rollout, w: float) -> None:
        # Under sequence parallelism each rank of a group scores its own tokens of the same
        # answers (`mask`), so the group's sums add up to the answers' once.
        per_token, mask, same = micro_divergence(
            s.model,
            teacher.model,
            ro,
            list(range(ro.n)),
            s.cfg,
            teacher.vocab,
            s.packed,
            s.device,
            s.sp,
        )
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
    engine = build_engine(engine_cfg, teacher.model, POLICY, s.all_ranks)
    ts = replace(s, model=teacher.model, engines={POLICY: engine})
    sums: Counter[str] = Counter()
    for chunk, w, seed in heldout_batches(s, rows):
        ro = generate(ts, chunk, seed, POLICY)
        reward(s, ro, chunk)  # once per sequence-parallel group
        # A sequence-parallel group's ranks sample the same answers: its first counts them.
        add_rollout_sums(sums, ro, kl=None, weight=w * s.counted)
    means = heldout_means(sums, s.device, kl=False)
    return {"teacher_reward": means["reward"], "teacher_stop_rate": means["stop_rate"]}


def headline(final: dict[str, float]) -> dict[str, float]:
    """The distillation figures a report leads with (`reward_gap_closed` absent when the
    teacher is not ahead of the starting policy)."""
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


@dataclass(frozen=True)
class DistillStats(UpdateStats):
    """One distillation step over all ranks: means of loss, teacher_kl and teacher_agreement;
    updates 0 when the rollout had no response token."""

    tokens: int  # response tokens over all ranks


def micro_divergence(
    student: torch.nn.Module,
    teacher: torch.nn.Module,
    ro: Rollout,
    rows: list[int],
    cfg: Any,
    vocab: int,
    packed: bool,
    device: torch.device,
    sp: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token divergence [n, R] with grad to the student, mask [n, R] of the tokens scored,
    argmax agreement [n, R]) of rollout rows `rows`, 0 off the mask. Packed rows: both heads
    run on the scored positions only ([1, M, vocab] each, M = the mask's tokens: no logits for
    padding), scattered back to [n, R]. With `sp` both models take this rank's shard of the
    packed rows (the teacher's heads split like the student's) and M is the tokens this rank
    scores (`forward_inputs`), so the logits shrink with the group too."""
    inp, scored = forward_inputs(ro, rows, packed, device, sp)  # scored [n, R] on the host
    flat = scored.reshape(-1).nonzero().squeeze(1)  # [M] on the host
    if packed:  # index [n, R] -> [1, M]: the heads see the scored positions only
        inp["index"] = inp["index"].reshape(1, -1)[:, flat.to(device, non_blocking=True)]
    t_logits = teacher_logits(teacher, inp, vocab)  # [1, M | n, R, vocab], no grad
    s_logits = student(POLICY, **inp)[..., :vocab]
    mask = scored.to(device)  # [n, R]
    if not packed:
        per_token = token_divergence(
            s_logits, t_logits, mask, cfg.loss, beta=cfg.beta, temperature=cfg.temperature
        )
        return per_token, mask, _agreement(s_logits, t_logits) * mask
    ones = torch.ones(1, len(flat), device=device)
    per_m = token_divergence(
        s_logits, t_logits, ones, cfg.loss, beta=cfg.beta, temperature=cfg.temperature
    )  # [1, M]
    at = flat.to(device, non_blocking=True)
    per_token = per_m.new_zeros(mask.numel()).index_put((at,), per_m[0]).view_as(mask)
    same = mask.new_zeros(mask.numel()).index_put((at,), _agreement(s_logits, t_logits)[0])
    return per_token, mask, same.view_as(mask)


def _agreement(s_logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] x 2 -> [...] 1.0 where student and teacher pick the same next token."""
    return (s_logits.detach().argmax(-1) == t_logits.argmax(-1)).float()


def step_counts(
    answer_tokens: torch.Tensor, counted: float, device: torch.device
) -> tuple[int, int]:
    """(response tokens, answers with one) over all ranks, from each answer's length [N]; a
    rank's weight `counted` (0 after a sequence-parallel group's first). One collective."""
    counts = all_reduce_sums(
        {"tokens": answer_tokens.sum() * counted, "answers": (answer_tokens > 0).sum() * counted},
        device,
    )
    return int(counts["tokens"]), int(counts["answers"])


def distill_update(
    tr: TrainSession,
    teacher: torch.nn.Module,
    ro: Rollout,
    cfg: Any,
    micro: int,
    vocab: int,
    step: int,
    packed: bool = False,
    by_tokens: int | None = None,
) -> DistillStats:
    """One optimizer step of the student (`tr.model`) towards `teacher` on this rank's rollout
    `ro`, `micro` rows per forward, or with `by_tokens` (`batch.by_tokens`) as many rows as fit
    that many tokens (module docstring). `step`: the logged step (1-based). The device is read
    for the counts, once for the guard and once for the statistics, not per forward.
    Under sequence parallelism a group's ranks hold the same rows, each scoring its shard's
    tokens: the counts are the group's first rank's (`counted`), the divergence sums are each
    rank's own tokens, and a `sequence_mean` answer divides by its whole length, not its
    shard's; `world` stays all ranks (FSDP averages over all of them)."""
    device, world = tr.dist.device, tr.dist.world_size
    sp, counted = group_of(tr.dist), tr.dist.counted
    answer_tokens = ro.mask.sum(1)  # [N] each answer's whole length, on the host
    tokens, answers = step_counts(answer_tokens, counted, device)
    if not tokens:
        return DistillStats({}, math.nan, math.nan, 0, 0)
    count = tokens if cfg.reduction == "token_mean" else answers
    lengths = row_tokens(ro)
    groups = balanced_groups(ro.n, micro, lambda i: lengths[i], by_tokens, device)
    sums: dict[str, torch.Tensor] = {}
    share = torch.zeros((), device=device)
    for k, group in enumerate(groups):
        chunk, weight = group, 1.0
        if not chunk:  # this rank is out of rows: a filler forward that counts for nothing
            chunk, weight = [0], 0.0
        grad_sync(tr.model, k == len(groups) - 1)
        per_token, mask, same = micro_divergence(
            tr.model, teacher, ro, chunk, cfg, vocab, packed, device, sp
        )
        whole = answer_tokens[chunk].to(device, non_blocking=True)  # [n]
        objective = objective_sum(per_token, mask, cfg.reduction, whole)
        objective = objective * (weight * world / count)
        tr.backward(objective)
        share = share + objective.detach() / world
        with torch.no_grad():
            keep = mask * weight
            for name, v in (("divergence", per_token.detach()), ("agree", same)):
                v = (v * keep).sum()
                sums[name] = sums[name] + v if name in sums else v
    # The mean loss, the same on every rank: read with the grad norm.
    loss, norm, lr = tr.optimizer_step(
        cfg.optim.max_grad_norm, loss=all_reduce_on_device(share), step=step
    )
    t = all_reduce_sums(sums, device)
    means = {
        "loss": loss,
        "teacher_kl": t["divergence"] / tokens,
        "teacher_agreement": t["agree"] / tokens,
    }
    return DistillStats(means, norm, lr, 1, tokens)
