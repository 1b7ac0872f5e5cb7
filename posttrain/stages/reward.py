"""reward: a Bradley-Terry reward model on preference pairs, LoRA + a trained score head.

Algorithm choices:
- Model: the base as a sequence classifier with one output, scored at the last non-pad token;
  LoRA on the body, the score head trained in full. The text is formatted with the chat
  template recorded at SFT (the guard refuses another unless the recipe allows it), so the
  reward model sees exactly the format the policy will produce.
- Loss per pair: -log sigmoid(r_chosen - r_rejected - margin), averaged over the pairs of the
  global batch (every micro-batch holds the same number of pairs, so each backprops
  sum(losses) * world / global_pairs and FSDP's gradient averaging divides the world back out).
- Held-out pairs at step 0 and at the end: accuracy, mean margin, reward mean/std for chosen
  and rejected. `reward.min_accuracy` becomes a gate the flow enforces before any RL stage.
- Sequence parallelism (`infra.sequence_parallel` N > 1): the N ranks of a group take the same
  pairs, each a slice of every micro-batch's tokens (`Training.lay_out`, and the held-out
  batches' own split); each row's score is read on the rank holding its last token and summed
  over the group (`shard_scores` in models/reward.py), so every rank computes the same pair
  losses; figures summed over the world are taken from the group's first rank only.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from posttrain.data.pref_prepare import guard_template, prepare
from posttrain.data.segments import pair_tokens
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum
from posttrain.models.loading import base_dtype, load_tokenizer
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.models.reward import pair_batch, pair_scores, score_model_for_training
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main
from posttrain.train.loop import Draw, StepBatch, Training, add_sums, open_training, plan_steps
from posttrain.train.losses import bradley_terry_loss, pair_outcome, pair_tie

log = logging.getLogger("posttrain.reward")


@torch.no_grad()
def heldout_pairs(loop: Training, pairs: list[dict], margin: float) -> dict[str, float]:
    """Pair accuracy, margin, loss and reward statistics over held-out pairs. With sequence
    parallelism each rank scores its shard of each (padding-free) batch; the group's ranks hold
    the same scores, counted from its first."""
    acc = {k: 0.0 for k in ("n", "correct", "ties", "margin", "loss", "c", "c2", "r", "r2")}
    split = loop.sp is not None
    counted = loop.tr.dist.counted
    for w, batch in loop.heldout_batches(pairs, flat=split, split=split):
        w *= counted
        rc, rr = pair_scores(loop.model, batch)
        acc["n"] += w * rc.numel()
        loss = bradley_terry_loss(rc, rr, margin)
        figures = {"correct": pair_outcome(rc, rr), "ties": pair_tie(rc, rr), "margin": rc - rr}
        figures |= {"loss": loss, "c": rc, "c2": rc**2}
        add_sums(acc, figures | {"r": rr, "r2": rr**2}, w)
    t = {k: all_reduce_sum(v, loop.device) for k, v in acc.items()}
    n = max(1.0, t["n"])

    def std(s: float, s2: float) -> float:
        return math.sqrt(max(0.0, s2 / n - (s / n) ** 2))

    return {
        "accuracy": t["correct"] / n,
        "ties": t["ties"] / n,
        "margin": t["margin"] / n,
        "loss": t["loss"] / n,
        "chosen_mean": t["c"] / n,
        "chosen_std": std(t["c"], t["c2"]),
        "rejected_mean": t["r"] / n,
        "rejected_std": std(t["r"], t["r2"]),
        "pairs": t["n"],
    }


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    ingest = ctx.role_manifest("base")["summary"]
    tok = load_tokenizer(ctx.role_dir("base") / "tokenizer")
    # The policy it will judge formats its text with the template it recorded (ingest's when
    # the reward model is trained beside the base).
    policy_sha = ctx.role_manifest("policy")["summary"].get("chat_template_sha256")
    template_sha = guard_template(tok, policy_sha, ctx.stage.name, cfg, ctx.stage.roles["policy"])
    data = prepare(cfg.data, tok, ctx.recipe.run.seed)
    batch, total_steps = plan_steps(ctx, data, len(data.train))

    model, weights = score_model_for_training(
        ingest["model_dir"],
        tok.pad_token_id,
        base_dtype(ctx.recipe.infra),
        ingest.get("trust_remote_code", False),
        ctx.recipe.infra.attention,
    )
    prepare_for_training(model, cfg.activation_checkpointing)
    model = apply_lora(model, cfg.lora, task_type="SEQ_CLS")

    def heldout(loop: Training) -> dict[str, float]:
        return heldout_pairs(loop, data.eval, cfg.margin)

    draw = Draw(data.train, pair_tokens, pair_batch, tok.pad_token_id)
    loop = open_training(ctx, model, weights, batch, total_steps, data, draw, heldout)
    if (first := loop.heldout_at_start()) is not None:
        log.info("held-out accuracy at step 0: %.3f", first["accuracy"])
    for step in loop.steps():
        sb = loop.step_batch(step)
        loss, metrics = bradley_terry_step(loop, sb, cfg.margin)
        loop.finish_step(step, sb, loss=loss, **metrics)
    final = loop.heldout_at_end()
    log.info("held-out pairs: accuracy %.3f, margin %.3f", final["accuracy"], final["margin"])
    loop.close()
    return loop.tr.summary(
        ctx,
        eval_start=first,
        eval_final=final,
        gate=accuracy_gate(final["accuracy"], cfg.min_accuracy),
        chat_template_sha256=template_sha,
        **data.stats,
        headline=loop.tr.headline(eval_accuracy=final["accuracy"], eval_margin=final["margin"]),
    )


def bradley_terry_step(
    loop: Training, sb: StepBatch, margin: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step's forwards and backwards: each micro-batch of pairs is scored (chosen and
    rejected rows in one forward) and backprops sum(pair losses) * world / global_pairs, so
    every pair of the global batch weighs the same. Returns the step's mean loss over all ranks
    and its mean accuracy, margin and rewards, as device tensors (`Training.step_means`: read
    by `finish_step`). Under sequence parallelism every rank of a group computes the same
    pair losses from the group's scores; its first rank alone counts them in the metrics."""
    sums: dict[str, torch.Tensor] = {}
    counted = loop.tr.dist.counted
    for k, mb in enumerate(sb.micro):
        grad_sync(loop.model, k == len(sb.micro) - 1)
        rc, rr = pair_scores(loop.model, mb)  # [micro] each
        losses = bradley_terry_loss(rc, rr, margin)  # [micro]
        loop.tr.backward(losses.sum() * loop.world / loop.batch.global_batch_size)
        figures = {"loss": losses, "correct": pair_outcome(rc, rr), "margin": rc - rr}
        figures |= {"chosen": rc, "rejected": rr}
        add_sums(sums, {n: v * counted for n, v in figures.items()})
    g = loop.step_means(sums)
    return g["loss"], {
        "accuracy": g["correct"],
        "margin": g["margin"],
        "reward_chosen": g["chosen"],
        "reward_rejected": g["rejected"],
    }


def accuracy_gate(accuracy: float, min_accuracy: float | None) -> dict[str, Any]:
    """The gate the flow enforces before any RL stage."""
    if min_accuracy is None:
        return {"passed": True}
    passed = accuracy >= min_accuracy
    return {
        "passed": passed,
        "accuracy": accuracy,
        "min_accuracy": min_accuracy,
        "message": (
            f"held-out reward accuracy {accuracy:.3f} "
            f"{'>=' if passed else '<'} reward.min_accuracy {min_accuracy}"
            + ("" if passed else "; stopping before any RL stage")
        ),
    }


if __name__ == "__main__":
    stage_main(run)
