"""orpo: reference-free preference tuning with the ORPO loss (Hong et al., 2024).

Algorithm choices:
- Policy = base + the SFT adapter, trained further (`start_adapter`); with no SFT adapter to
  continue, a fresh LoRA (`orpo.lora`) on the base, as in the paper, which runs ORPO instead of
  SFT. There is NO reference model: ORPO's penalty compares the policy's own odds of the chosen
  and rejected responses, so a step is one policy forward per pair (chosen and rejected rows in
  one batch) and the stage holds one adapter: less memory and about half DPO's forward compute.
- Per pair: mean per-token log-probs of the response tokens (final assistant turn + its
  end-of-turn); loss = NLL(chosen) + beta x -log sigmoid(log-odds(chosen) - log-odds(rejected))
  (`orpo_loss` in train/preference_losses.py). Pairs weigh equally: each micro-batch backprops
  sum(pair losses) * world / global_pairs, as dpo does.
- Held-out pairs at step 0 and at the end: accuracy (chosen's mean log-prob above rejected's),
  reward margin (beta x the mean log-prob difference), loss and chosen NLL.
- Sequence parallelism (`infra.sequence_parallel` N > 1): the N ranks of a group take the same
  pairs, each a slice of every micro-batch's tokens (`Training.lay_out`, and the held-out
  batches' own split); the rows' summed log-probs and token counts are all-reduced over the
  group (`forward_sequence_logps`), so every rank computes the same pair losses (the NLL term
  included) and backpropagates them through its own tokens; figures summed over the world are
  taken from the group's first rank only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from posttrain.data.pref_prepare import guard_template, prepare
from posttrain.data.segments import pair_tokens
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum
from posttrain.models.adapters import trainable_adapter
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.models.reward import pair_batch
from posttrain.runtime.context import StageContext, training_base
from posttrain.stages.common import stage_main
from posttrain.train.forward_logps import pair_logps
from posttrain.train.loop import Draw, StepBatch, Training, add_sums, open_training, plan_steps
from posttrain.train.preference_losses import orpo_loss

log = logging.getLogger("posttrain.orpo")


def start_adapter(ctx: StageContext) -> Path | None:
    """The adapter ORPO continues: its `from` policy's. None = it starts from the base, with a
    fresh LoRA (`lora`). The one place that decides where the policy comes from."""
    return ctx.adapter_dir("policy")


@torch.no_grad()
def heldout_orpo(loop: Training, pairs: list[dict], beta: float) -> dict[str, float]:
    """Accuracy (a tie counting half), ties, reward margin, ORPO loss, chosen NLL and log-odds
    ratio on held-out pairs. With sequence parallelism each rank scores its shard of each
    (padding-free) batch; the group's ranks hold the same figures, counted from its first."""
    keys = ("correct", "ties", "margin", "loss", "nll", "log_odds_ratio")
    s = dict.fromkeys(("n", *keys), 0.0)
    split = loop.sp is not None
    counted = loop.tr.dist.counted
    for w, batch in loop.heldout_batches(pairs, flat=split, split=split):
        w *= counted
        losses, m = orpo_loss(*pair_logps(loop.model, batch, loop.chunk_tokens), beta=beta)
        s["n"] += w * len(losses)
        add_sums(s, {"loss": losses} | {k: m[k] for k in keys if k != "loss"}, w)
    t = {k: all_reduce_sum(v, loop.device) for k, v in s.items()}
    n = max(1.0, t.pop("n"))
    out = {k: v / n for k, v in t.items()}
    out["accuracy"] = out.pop("correct")
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    base, tok, weights = training_base(ctx)
    adapter = start_adapter(ctx)
    # The policy it starts from recorded the template it learnt (from the base: ingest's).
    recorded = ctx.role_manifest("policy")["summary"].get("chat_template_sha256")
    template_sha = guard_template(tok, recorded, ctx.stage.name, cfg, ctx.stage.roles["policy"])
    data = prepare(cfg.data, tok, ctx.recipe.run.seed)
    batch, total_steps = plan_steps(ctx, data, len(data.train))

    prepare_for_training(base, cfg.activation_checkpointing)
    model = trainable_adapter(base, adapter) if adapter else apply_lora(base, cfg.lora)
    start = f"{ctx.stage.roles['policy']} adapter" if adapter else "fresh lora"

    def heldout(loop: Training) -> dict[str, float]:
        return heldout_orpo(loop, data.eval, cfg.beta)

    draw = Draw(data.train, pair_tokens, pair_batch, tok.pad_token_id)
    loop = open_training(ctx, model, weights, batch, total_steps, data, draw, heldout, start=start)
    if (first := loop.heldout_at_start()) is not None:
        log.info("held-out pair accuracy at step 0: %.3f", first["accuracy"])
    for step in loop.steps():
        sb = loop.step_batch(step)
        loss, metrics = orpo_step(loop, sb, cfg.beta)
        loop.finish_step(step, sb, loss=loss, **metrics)
    final = loop.heldout_at_end()
    log.info("held-out pair accuracy %.3f, margin %.4f", final["accuracy"], final["margin"])
    loop.close()
    return loop.tr.summary(
        ctx,
        beta=cfg.beta,
        start=start,
        eval_start=first,
        eval_final=final,
        chat_template_sha256=template_sha,
        **data.stats,
        headline=loop.tr.headline(
            eval_pref_accuracy=final["accuracy"],
            eval_margin=final["margin"],
            eval_nll=final["nll"],
        ),
    )


def orpo_step(
    loop: Training, sb: StepBatch, beta: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step: one policy forward per micro-batch of pairs, sum(pair losses) * world /
    global_pairs backpropagated. Returns the step's mean loss and metrics (in name order), as
    device tensors (`Training.step_means`: read by `finish_step`). Under sequence parallelism
    every rank of a group computes the same pair losses from the group's summed log-probs and
    the group's first rank alone counts them in the metrics."""
    sums: dict[str, torch.Tensor] = {}
    counted = loop.tr.dist.counted
    for k, mb in enumerate(sb.micro):
        grad_sync(loop.model, k == len(sb.micro) - 1)
        pc, pr, lc, lr_ = pair_logps(loop.model, mb, loop.chunk_tokens)  # [micro] each
        losses, m = orpo_loss(pc, pr, lc, lr_, beta=beta)
        loop.tr.backward(losses.sum() * loop.world / loop.batch.global_batch_size)
        figures = m | {"loss": losses, "policy_chosen_logps": pc, "policy_rejected_logps": pr}
        add_sums(sums, {n: v * counted for n, v in figures.items()})
    g = dict(sorted(loop.step_means(sums).items()))
    loss = g.pop("loss")
    return loss, {"accuracy": g.pop("correct"), **g}


if __name__ == "__main__":
    stage_main(run)
