"""sft: LoRA supervised fine-tuning with an explicit loop, sharded with FSDP2 at every world size.

Algorithm choices:
- Loss on assistant tokens only (template-derived mask), normalised by the number of target
  tokens in the whole global batch: each micro-batch contributes sum(NLL) * world / N_global, and
  FSDP's gradient averaging over ranks divides the world back out. So 2 ranks x micro 4 equals
  1 rank x micro 8, and accumulation 2x2 equals 1x4, even with unequal tokens per micro-batch.
- Sequence parallelism (`infra.sequence_parallel` P): the P ranks of a group take the same rows,
  each a slice of every micro-batch's tokens (`Training.lay_out`). Each rank's NLL and target
  count are its slice's, so the sums over all ranks are the global batch's (no row counted
  twice), and the gradients of its slice's loss reach the peers' tokens through the attention
  exchange: averaging over all world ranks again gives the global token-mean gradient.
- Batch order is a pure function of (seed, step) (`posttrain.data.batching.step_indices`), so a
  resumed run replays nothing and skips nothing.
- Gradient sync (reduce-scatter) only on the last micro-batch of an accumulation window.
- Held-out loss at step 0 (= the base model: LoRA B starts at zero) and at the end.

Outputs: adapter/ (peft format), data/{train,eval}.jsonl (exactly what was trained and held out),
metrics.jsonl, checkpoints/ (resume only; not part of the artifact's hashes).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from posttrain.data.batching import collate, pack_examples
from posttrain.data.chat import template_sha256
from posttrain.data.sft_data import prepare
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_on_device, all_reduce_sum
from posttrain.models.adapters import trainable_adapter
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.rl.teacher_answers import teacher_rows
from posttrain.runtime.context import StageContext, training_base
from posttrain.stages.common import stage_main
from posttrain.telemetry.records import read_metrics
from posttrain.train.forward_logps import forward_nll_sum
from posttrain.train.loop import Draw, StepBatch, Training, open_training, plan_steps
from posttrain.train.session import TrainSession

log = logging.getLogger("posttrain.sft")


@torch.no_grad()
def heldout_loss(loop: Training, examples: list[dict]) -> float | None:
    """Token-weighted held-out NLL, or None without held-out rows (eval_fraction 0 and no
    eval_path: there is no figure, and NaN would not be valid JSON in the manifest). With
    sequence parallelism each rank scores its shard: the NLL and token count are per-token
    sums, so summing them over every rank counts each token once."""
    if not examples:
        return None
    total, count = 0.0, 0.0
    for weight, batch in loop.heldout_batches(examples, loop.flat, split=True):
        nll, n = forward_nll_sum(loop.model, batch, loop.chunk_tokens)
        total += weight * nll.item()
        count += weight * n.item()
    return all_reduce_sum(total, loop.device) / max(1.0, all_reduce_sum(count, loop.device))


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    model, tok, weights = training_base(ctx)
    taught: dict[str, Any] = {}

    def teacher_answers(rows: list[dict]) -> list[dict]:
        answered, info = teacher_rows(ctx, rows)
        taught.update(teacher=ctx.stage.roles["teacher"], **info)
        return answered

    # With a teacher: its answers to the training prompts (off-policy distillation).
    rewrite = teacher_answers if ctx.has_role("teacher") else None
    data = prepare(cfg.data, tok, ctx.recipe.run.seed, rewrite)
    train = pack_examples(data.train, cfg.data.max_seq_len) if cfg.packing else data.train
    batch, total_steps = plan_steps(ctx, data, len(train))

    prepare_for_training(model, cfg.activation_checkpointing)
    # From the base: a new adapter shaped by `lora`. From a policy (an SFT round after RL, say):
    # that policy's adapter, trained further (its own shape; `lora` does not apply).
    start = ctx.adapter_dir("policy")
    model = apply_lora(model, cfg.lora) if start is None else trainable_adapter(model, start)

    def heldout(loop: Training) -> dict[str, float | None]:
        return {"loss": heldout_loss(loop, data.eval)}

    draw = Draw(train, sequence_tokens, collate, tok.pad_token_id)
    loop = open_training(ctx, model, weights, batch, total_steps, data, draw, heldout)
    if first := loop.heldout_at_start():
        first_eval = first["loss"]
        if first_eval is not None:
            log.info("held-out loss at step 0 (base): %.4f", first_eval)
    else:  # resumed: the step-0 figure is in the kept metrics
        first_eval = kept_start_loss(loop)
    for step in loop.steps():
        sb = loop.step_batch(step)
        loss, target_tokens = sft_step(loop, sb)
        loop.finish_step(step, sb, loss=loss, target_tokens=target_tokens)
    final_eval = loop.heldout_at_end()["loss"]
    if final_eval is not None:
        log.info("held-out loss after SFT: %.4f", final_eval)
    loop.close()
    summary = loop.tr.summary(
        ctx,
        eval_loss_start=first_eval,
        eval_loss_final=final_eval,
        chat_template_sha256=template_sha256(tok),
        **data.stats,
        **taught,
    )
    summary["headline"] = sft_headline(loop.tr, final_eval)
    return summary


def sequence_tokens(row: dict[str, Any]) -> int:
    return len(row["input_ids"])


def sft_step(loop: Training, sb: StepBatch) -> tuple[torch.Tensor, float]:
    """One step's forwards and backwards: each micro-batch backprops its summed NLL * world /
    N_global (the target tokens of the whole global batch), so every token weighs the same
    however the batch is split. Returns (the step's loss per target token as a 0-dim float64
    device tensor, N_global): nothing is read to the host here; the optimizer step reads the
    loss with the gradient norm, the step's one sync."""
    device = loop.device
    # Counted on the host (the collator's `target_positions`, a sequence-parallel shard's own):
    # reading a device tensor would wait for the last step's update.
    local_targets = sum(int(mb["target_positions"].numel()) for mb in sb.host)
    global_targets = all_reduce_sum(local_targets, device)
    step_nll = torch.zeros((), device=device)  # summed on the device
    for k, mb in enumerate(sb.micro):
        grad_sync(loop.model, k == len(sb.micro) - 1)
        nll, _ = forward_nll_sum(loop.model, mb, loop.chunk_tokens)
        loop.tr.backward(nll * loop.world / global_targets)
        step_nll += nll.detach().float()
    # float64 before the sum over ranks and the division: what the host did with float().
    return all_reduce_on_device(step_nll.double()) / global_targets, global_targets


def kept_start_loss(loop: Training) -> float | None:
    """A resumed run's step-0 held-out loss, from the `eval` record its first launch kept."""
    kept = read_metrics(loop.tr.metrics.path, "eval")
    return next((r["eval_loss"] for r in kept if r.get("step") == 0), None)


def sft_headline(tr: TrainSession, final_eval: float | None) -> dict[str, float]:
    """The figures a report leads with, rounded; absent ones left out."""
    last = tr.last
    return {
        k: round(v, 4)
        for k, v in (
            ("train_loss", last.get("loss")),
            ("eval_loss", final_eval),
            ("tokens/s", last.get("tokens_per_s")),
            ("mfu", last.get("mfu")),
            ("skipped_steps", tr.skipped_steps or None),
        )
        if v is not None
    }


if __name__ == "__main__":
    stage_main(run)
