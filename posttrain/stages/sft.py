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
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from posttrain.config.loader import sft_batch
from posttrain.data.batching import pack_examples, pad_batch, step_indices
from posttrain.data.sft_data import prepare, write_rows
from posttrain.distributed.fsdp import shard_model
from posttrain.distributed.runtime import all_reduce_sum
from posttrain.models.loading import count_params, load_base
from posttrain.models.lora import apply_lora
from posttrain.stages.common import StageContext, stage_main
from posttrain.telemetry.metrics import (
    MetricsWriter,
    device_peak_flops,
    matmul_params,
    memory_snapshot,
    train_flops_per_token,
)
from posttrain.train.checkpoint import complete_checkpoints, load_checkpoint, save_checkpoint
from posttrain.train.losses import token_nll_sum
from posttrain.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("posttrain.sft")


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _forward_nll(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits  # [B, T, V]
    return token_nll_sum(logits, batch["labels"])


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    examples: list[dict],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
) -> float:
    """Token-weighted held-out NLL. Every rank runs the same number of forwards (FSDP all-gathers
    are collective); a rank short of rows repeats a batch with zero weight."""
    if not examples:
        return float("nan")
    model.eval()
    mine = examples[rank::world]
    n_batches = math.ceil(math.ceil(len(examples) / world) / batch_size)
    total, count = 0.0, 0.0
    for b in range(n_batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        weight = 1.0 if chunk else 0.0
        nll, n = _forward_nll(model, _to(pad_batch(chunk or examples[:1], pad_id), device))
        total += weight * nll.item()
        count += weight * n.item()
    model.train()
    return all_reduce_sum(total, device) / max(1.0, all_reduce_sum(count, device))


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.recipe.sft
    d = ctx.dist
    device, rank, world = d.device, d.rank, d.world_size
    precision = ctx.recipe.infra.precision
    seed = ctx.recipe.run.seed

    model, tok = load_base(ctx.parent_dir("ingest"), ctx.parent_manifest("ingest"))
    data = prepare(cfg.data, tok, seed)
    if ctx.is_main:
        write_rows(ctx.out_dir / "data" / "train.jsonl", data.train_rows)
        write_rows(ctx.out_dir / "data" / "eval.jsonl", data.eval_rows)
    train = pack_examples(data.train, cfg.data.max_seq_len) if cfg.packing else data.train
    batch = sft_batch(ctx.recipe)
    assert batch.dp_size == world, f"recipe dp size {batch.dp_size} != world size {world}"
    total_steps = cfg.max_steps or max(
        1, math.ceil(cfg.epochs * len(train) / batch.global_batch_size)
    )

    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = apply_lora(model, cfg.lora)
    n_total, n_trainable = count_params(model)
    n_matmul = matmul_params(model)
    model = shard_model(model.to(device), d.mesh, precision)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(trainable, cfg.optim)
    sched = build_scheduler(opt, total_steps, cfg.optim)
    scaler = None
    if precision == "fp16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.type)

    start_step = 0
    ckpt_root = ctx.out_dir / "checkpoints"
    if done := complete_checkpoints(ckpt_root):
        meta = load_checkpoint(done[-1], model, opt, sched)
        start_step = meta["step"]
        log.info("resumed from %s at step %d", done[-1].name, start_step)

    peak, peak_src = device_peak_flops(device, precision)
    cfg_model = model.config
    metrics = MetricsWriter(
        ctx.out_dir / "metrics.jsonl", enabled=ctx.is_main, resume_step=start_step
    )
    metrics.write(
        "start",
        total_steps=total_steps,
        start_step=start_step,
        world_size=world,
        params_total=n_total,
        params_trainable=n_trainable,
        trainable_fraction=n_trainable / n_total,
        micro_batch_size=batch.micro_batch_size,
        grad_accum_steps=batch.grad_accum_steps,
        global_batch_size=batch.global_batch_size,
        train_examples=len(train),
        eval_examples=len(data.eval),
        precision=precision,
        peak_flops_per_device=peak,
        peak_flops_source=peak_src,
        **data.stats,
    )
    log.info(
        "trainable params %s / %s (%.3f%%); micro %d x accum %d x dp %d = global %d; %d steps",
        f"{n_trainable:,}",
        f"{n_total:,}",
        100 * n_trainable / n_total,
        batch.micro_batch_size,
        batch.grad_accum_steps,
        world,
        batch.global_batch_size,
        total_steps,
    )

    eval_bs = batch.micro_batch_size
    first_eval = None
    if start_step == 0:
        first_eval = heldout_loss(model, data.eval, tok.pad_token_id, eval_bs, device, rank, world)
        metrics.write("eval", step=0, eval_loss=first_eval)
        log.info("held-out loss at step 0 (base): %.4f", first_eval)

    last: dict[str, float] = {}
    for step in range(start_step, total_steps):
        t0 = time.perf_counter()
        idx = step_indices(
            len(train),
            step,
            micro=batch.micro_batch_size,
            accum=batch.grad_accum_steps,
            dp_size=world,
            rank=rank,
            seed=seed,
        )
        micro_batches = [
            _to(pad_batch([train[i] for i in ix], tok.pad_token_id), device) for ix in idx
        ]
        local_targets = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in micro_batches)
        local_tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
        global_targets = all_reduce_sum(local_targets, device)
        t_data = time.perf_counter() - t0

        step_nll = 0.0
        for k, mb in enumerate(micro_batches):
            model.set_requires_gradient_sync(k == len(micro_batches) - 1)
            nll, _ = _forward_nll(model, mb)
            loss = nll * world / global_targets
            (scaler.scale(loss) if scaler else loss).backward()
            step_nll += nll.item()
        if scaler:
            scaler.unscale_(opt)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            trainable, cfg.optim.max_grad_norm or float("inf")
        )
        grad_norm = float(
            grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        )
        lr = opt.param_groups[0]["lr"]
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0

        step_loss = all_reduce_sum(step_nll, device) / global_targets
        tokens = all_reduce_sum(local_tokens, device)
        seq_len = local_tokens / max(1, sum(mb["input_ids"].size(0) for mb in micro_batches))
        fpt = train_flops_per_token(
            n_matmul, n_trainable, cfg_model.num_hidden_layers, cfg_model.hidden_size, int(seq_len)
        )
        achieved = fpt * tokens / dt
        last = {
            "loss": step_loss,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens / dt,
            "mfu": achieved / (peak * world) if peak else float("nan"),
        }
        if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps:
            metrics.write(
                "train",
                step=step + 1,
                total_steps=total_steps,
                loss=step_loss,
                lr=lr,
                grad_norm=grad_norm,
                tokens=tokens,
                target_tokens=global_targets,
                tokens_per_s=tokens / dt,
                tokens_per_s_per_device=tokens / dt / world,
                tflops=achieved / 1e12,
                tflops_per_device=achieved / world / 1e12,
                mfu=last["mfu"],
                step_time_s=dt,
                data_wait_s=t_data,
                compute_s=dt - t_data,
                **memory_snapshot(device),
            )
            log.info(
                "step %d/%d loss %.4f lr %.2e gnorm %.3f tok/s %.0f mfu %.1f%%",
                step + 1,
                total_steps,
                step_loss,
                lr,
                grad_norm,
                tokens / dt,
                100 * last["mfu"],
            )
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < total_steps:
            ev = heldout_loss(model, data.eval, tok.pad_token_id, eval_bs, device, rank, world)
            metrics.write("eval", step=step + 1, eval_loss=ev)
        if (
            cfg.checkpoint_every
            and (step + 1) % cfg.checkpoint_every == 0
            and step + 1 < total_steps
        ):
            save_checkpoint(ckpt_root, step + 1, model, opt, sched, cfg.keep_checkpoints)

    final_eval = heldout_loss(model, data.eval, tok.pad_token_id, eval_bs, device, rank, world)
    metrics.write("eval", step=total_steps, eval_loss=final_eval)
    log.info("held-out loss after SFT: %.4f", final_eval)
    save_adapter(model, ctx)
    metrics.write("end", step=total_steps, **memory_snapshot(device))
    metrics.close()
    summary = {
        "total_steps": total_steps,
        "params_trainable": n_trainable,
        "params_total": n_total,
        "final_train_loss": last.get("loss"),
        "eval_loss_start": first_eval,
        "eval_loss_final": final_eval,
        "tokens_per_s": last.get("tokens_per_s"),
        "mfu": last.get("mfu"),
        "adapter_dir": str(ctx.out_dir / "adapter"),
        **data.stats,
    }
    summary["headline"] = {
        k: round(v, 4)
        for k, v in (
            ("train_loss", last.get("loss")),
            ("eval_loss", final_eval),
            ("tokens/s", last.get("tokens_per_s")),
            ("mfu", last.get("mfu")),
        )
        if v is not None
    }
    return summary


def save_adapter(model: torch.nn.Module, ctx: StageContext) -> None:
    """Gather the LoRA weights to full tensors (collective), save in peft format on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )
    if ctx.is_main:
        model.save_pretrained(str(ctx.out_dir / "adapter"), state_dict=full)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    stage_main("sft", run, distributed=True)
