"""sft: LoRA supervised fine-tuning with an explicit loop, sharded with FSDP2 at every world size.

Algorithm choices:
- Loss on assistant tokens only (template-derived mask), normalised by the number of target
  tokens in the whole global batch: each micro-batch contributes sum(NLL) * world / N_global, and
  FSDP's gradient averaging over ranks divides the world back out. So 2 ranks x micro 4 equals
  1 rank x micro 8, and accumulation 2x2 equals 1x4, even with unequal tokens per micro-batch.
- Batch order is a pure function of (seed, step) (`posttrain.data.batching.step_indices`), so a
  resumed run replays nothing and skips nothing.
- Gradient sync (reduce-scatter) only on the last micro-batch of an accumulation window.
- Held-out loss at step 0 (= the base model: LoRA B starts at zero) and at the end.

Outputs: adapter/ (peft format), data/{train,eval}.jsonl (exactly what was trained and held out),
metrics.jsonl, checkpoints/ (resume only; not part of the artifact's hashes).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from posttrain.config.loader import section_batch
from posttrain.data.batching import collate, pack_examples
from posttrain.data.chat import IGNORE, template_sha256
from posttrain.data.segments import batch_rows, layout_stats, real_tokens
from posttrain.data.sft_data import prepare, write_splits
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum, rank_batches
from posttrain.models.adapters import trainable_adapter
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.stages.common import StageContext, stage_main, training_base
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import memory_snapshot, read_metrics
from posttrain.train.chunked import forward_nll_sum
from posttrain.train.micro_batches import padding_free, regroup_step
from posttrain.train.session import planned_steps, save_adapter, start_session

log = logging.getLogger("posttrain.sft")


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    examples: list[dict],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    chunk_tokens: int = 0,
    flat: bool = False,
) -> float | None:
    """Token-weighted held-out NLL, or None without held-out rows (eval_fraction 0 and no
    eval_path: there is no figure, and NaN would not be valid JSON in the manifest). Every rank
    runs the same number of forwards (FSDP all-gathers are collective); a rank short of rows
    repeats a batch with zero weight."""
    if not examples:
        return None
    model.eval()
    total, count = 0.0, 0.0
    for idx in rank_batches(len(examples), rank, world, batch_size):
        heartbeat.beat(phase="eval")
        chunk = [examples[i] for i in idx] or examples[:1]
        weight = 1.0 if idx else 0.0
        nll, n = forward_nll_sum(model, _to(collate(chunk, pad_id, flat), device), chunk_tokens)
        total += weight * nll.item()
        count += weight * n.item()
    model.train()
    return all_reduce_sum(total, device) / max(1.0, all_reduce_sum(count, device))


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    d = ctx.dist
    device, rank, world = d.device, d.rank, d.world_size
    seed = ctx.recipe.run.seed
    chunk_tokens = ctx.recipe.infra.logits_chunk_tokens

    model, tok, weights = training_base(ctx)
    data = prepare(cfg.data, tok, seed)
    if ctx.is_main:
        write_splits(ctx.out_dir, data.train_rows, data.eval_rows)
    train = pack_examples(data.train, cfg.data.max_seq_len) if cfg.packing else data.train
    batch = section_batch(ctx.recipe, ctx.name)
    assert batch.dp_size == world, f"recipe dp size {batch.dp_size} != world size {world}"
    total_steps = planned_steps(cfg.max_steps, cfg.epochs, len(train), batch)

    prepare_for_training(model, cfg.activation_checkpointing)
    # From the base: a new adapter shaped by `lora`. From a policy (an SFT round after RL, say):
    # that policy's adapter, trained further (its own shape; `lora` does not apply).
    start = ctx.adapter_dir("policy")
    model = apply_lora(model, cfg.lora) if start is None else trainable_adapter(model, start)
    tr = start_session(
        ctx,
        model,
        cfg.optim,
        batch,
        total_steps,
        weights=weights,
        train_examples=len(train),
        eval_examples=len(data.eval),
        **data.stats,
    )
    model = tr.model
    flat = padding_free(cfg.batch, model)

    eval_bs = batch.micro_batch_size
    if tr.start_step == 0:
        first_eval = heldout_loss(
            model, data.eval, tok.pad_token_id, eval_bs, device, rank, world, chunk_tokens, flat
        )
        tr.metrics.write("eval", step=0, eval_loss=first_eval)
        if first_eval is not None:
            log.info("held-out loss at step 0 (base): %.4f", first_eval)
    else:  # resumed: the step-0 figure is in the kept metrics
        first_eval = next(
            (r["eval_loss"] for r in read_metrics(tr.metrics.path, "eval") if r.get("step") == 0),
            None,
        )

    for step in range(tr.start_step, total_steps):
        t0 = time.perf_counter()
        idx = regroup_step(
            tr.step_rows(len(train), step, batch, seed),
            lambda i: len(train[i]["input_ids"]),
            cfg.batch,
            device,
        )
        host = [collate([train[i] for i in ix], tok.pad_token_id, flat) for ix in idx]
        # Counted on the host: int() of a device tensor would wait for the last step's update.
        local_targets = sum(int((mb["labels"][:, 1:] != IGNORE).sum()) for mb in host)
        local_tokens = sum(real_tokens(mb) for mb in host)
        micro_batches = [_to(mb, device) for mb in host]
        global_targets = all_reduce_sum(local_targets, device)
        t_data = time.perf_counter() - t0

        step_nll = torch.zeros((), device=device)  # summed on the device: one sync per step
        for k, mb in enumerate(micro_batches):
            grad_sync(model, k == len(micro_batches) - 1)
            nll, _ = forward_nll_sum(model, mb, chunk_tokens)
            tr.backward(nll * world / global_targets)
            step_nll += nll.detach().float()
        step_loss = all_reduce_sum(float(step_nll), device) / global_targets
        grad_norm, lr = tr.optimizer_step(cfg.optim.max_grad_norm, loss=step_loss, step=step + 1)
        if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps:
            n_rows = sum(batch_rows(mb) for mb in micro_batches)
            tr.record_step(
                step + 1,
                loss=step_loss,
                grad_norm=grad_norm,
                lr=lr,
                local_tokens=local_tokens,
                seq_len=local_tokens / n_rows,
                t_start=t0,
                t_data=t_data,
                target_tokens=global_targets,
                **layout_stats(host, local_tokens),
            )
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total_steps:
            ev = heldout_loss(
                model, data.eval, tok.pad_token_id, eval_bs, device, rank, world, chunk_tokens, flat
            )
            tr.metrics.write("eval", step=step + 1, eval_loss=ev)
        tr.maybe_checkpoint(step + 1, cfg.checkpoint_every, cfg.keep_checkpoints)

    final_eval = heldout_loss(
        model, data.eval, tok.pad_token_id, eval_bs, device, rank, world, chunk_tokens, flat
    )
    tr.metrics.write("eval", step=total_steps, eval_loss=final_eval)
    if final_eval is not None:
        log.info("held-out loss after SFT: %.4f", final_eval)
    save_adapter(model, ctx)
    tr.metrics.write("end", step=total_steps, **memory_snapshot(device))
    tr.metrics.close()
    last = tr.last
    summary = tr.summary(
        ctx,
        eval_loss_start=first_eval,
        eval_loss_final=final_eval,
        chat_template_sha256=template_sha256(tok),
        **data.stats,
    )
    summary["headline"] = {
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
    return summary


if __name__ == "__main__":
    stage_main(run)
