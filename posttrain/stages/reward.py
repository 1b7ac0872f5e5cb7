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
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from posttrain.config.loader import section_batch
from posttrain.data.pref_prepare import guard_template, prepare
from posttrain.data.segments import batch_rows, layout_stats, pair_tokens
from posttrain.data.sft_data import write_splits
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum, all_reduce_sums, rank_batches
from posttrain.models.loading import base_dtype, load_tokenizer
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.models.reward import pair_batch, pair_scores, score_model_for_training
from posttrain.stages.common import StageContext, stage_main
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import memory_snapshot
from posttrain.train.losses import bradley_terry_loss
from posttrain.train.micro_batches import padding_free, regroup_step
from posttrain.train.session import planned_steps, save_adapter, start_session

log = logging.getLogger("posttrain.reward")


@torch.no_grad()
def heldout_pairs(
    model: torch.nn.Module,
    pairs: list[dict],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    margin: float,
) -> dict[str, float]:
    """Pair accuracy, margin, loss and reward statistics over held-out pairs (all ranks run the
    same number of forwards; a rank short of pairs repeats one with zero weight)."""
    model.eval()
    acc = {k: 0.0 for k in ("n", "correct", "margin", "loss", "c", "c2", "r", "r2")}
    for idx in rank_batches(len(pairs), rank, world, batch_size):
        heartbeat.beat(phase="eval")
        chunk = [pairs[i] for i in idx] or pairs[:1]
        w = 1.0 if idx else 0.0
        batch = {k: v.to(device) for k, v in pair_batch(chunk, pad_id).items()}
        rc, rr = pair_scores(model, batch)
        acc["n"] += w * rc.numel()
        acc["correct"] += w * (rc > rr).sum().item()
        acc["margin"] += w * (rc - rr).sum().item()
        acc["loss"] += w * bradley_terry_loss(rc, rr, margin).sum().item()
        acc["c"] += w * rc.sum().item()
        acc["c2"] += w * (rc**2).sum().item()
        acc["r"] += w * rr.sum().item()
        acc["r2"] += w * (rr**2).sum().item()
    model.train()
    t = {k: all_reduce_sum(v, device) for k, v in acc.items()}
    n = max(1.0, t["n"])

    def std(s: float, s2: float) -> float:
        return math.sqrt(max(0.0, s2 / n - (s / n) ** 2))

    return {
        "accuracy": t["correct"] / n,
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
    d = ctx.dist
    device, rank, world = d.device, d.rank, d.world_size
    seed = ctx.recipe.run.seed
    ingest = ctx.role_manifest("base")["summary"]

    tok = load_tokenizer(ctx.role_dir("base") / "tokenizer")
    # The policy it will judge formats its text with the template it recorded (ingest's when
    # the reward model is trained beside the base).
    policy_sha = ctx.role_manifest("policy")["summary"].get("chat_template_sha256")
    template_sha = guard_template(tok, policy_sha, ctx.name, cfg, ctx.roles["policy"])
    data = prepare(cfg.data, tok, seed)
    if ctx.is_main:
        write_splits(ctx.out_dir, data.train_rows, data.eval_rows)
    batch = section_batch(ctx.recipe, ctx.name)
    total_steps = planned_steps(cfg.max_steps, cfg.epochs, len(data.train), batch)

    model, weights = score_model_for_training(
        ingest["model_dir"],
        tok.pad_token_id,
        base_dtype(ctx.recipe.infra),
        ingest.get("trust_remote_code", False),
        ctx.recipe.infra.attention,
    )
    prepare_for_training(model, cfg.activation_checkpointing)
    model = apply_lora(model, cfg.lora, task_type="SEQ_CLS")
    tr = start_session(
        ctx,
        model,
        cfg.optim,
        batch,
        total_steps,
        weights=weights,
        train_examples=len(data.train),
        eval_examples=len(data.eval),
        **data.stats,
    )
    model = tr.model
    flat = padding_free(cfg.batch, model)
    eval_bs = batch.micro_batch_size
    first = None
    if tr.start_step == 0:
        first = heldout_pairs(
            model, data.eval, tok.pad_token_id, eval_bs, device, rank, world, cfg.margin
        )
        tr.metrics.write("eval", step=0, **{f"eval_{k}": v for k, v in first.items()})
        log.info("held-out accuracy at step 0: %.3f", first["accuracy"])

    for step in range(tr.start_step, total_steps):
        t0 = time.perf_counter()
        idx = regroup_step(
            tr.step_rows(len(data.train), step, batch, seed),
            lambda i: pair_tokens(data.train[i]),
            cfg.batch,
            device,
        )
        micro = [
            {
                k: v.to(device)
                for k, v in pair_batch([data.train[i] for i in ix], tok.pad_token_id, flat).items()
            }
            for ix in idx
        ]
        # Counted on the host: reading a device tensor would wait for the last update.
        local_tokens = sum(pair_tokens(data.train[i]) for ix in idx for i in ix)
        t_data = time.perf_counter() - t0
        sums = {"loss": 0.0, "correct": 0.0, "margin": 0.0, "chosen": 0.0, "rejected": 0.0}
        for k, mb in enumerate(micro):
            grad_sync(model, k == len(micro) - 1)
            rc, rr = pair_scores(model, mb)
            losses = bradley_terry_loss(rc, rr, cfg.margin)  # [micro]
            tr.backward(losses.sum() * world / batch.global_batch_size)
            # Summed on the device and read once per step (`all_reduce_sums`).
            rc, rr = rc.detach(), rr.detach()
            sums["loss"] += losses.detach().sum()
            sums["correct"] += (rc > rr).sum()
            sums["margin"] += (rc - rr).sum()
            sums["chosen"] += rc.sum()
            sums["rejected"] += rr.sum()
        g = {k: v / batch.global_batch_size for k, v in all_reduce_sums(sums, device).items()}
        tr.finish_step(
            step + 1,
            cfg,
            loss=g["loss"],
            local_tokens=local_tokens,
            n_seqs=sum(batch_rows(mb) for mb in micro),
            **layout_stats(micro, local_tokens),
            t_start=t0,
            t_data=t_data,
            accuracy=g["correct"],
            margin=g["margin"],
            reward_chosen=g["chosen"],
            reward_rejected=g["rejected"],
        )

    final = heldout_pairs(
        model, data.eval, tok.pad_token_id, eval_bs, device, rank, world, cfg.margin
    )
    tr.metrics.write("eval", step=total_steps, **{f"eval_{k}": v for k, v in final.items()})
    log.info("held-out pairs: accuracy %.3f, margin %.3f", final["accuracy"], final["margin"])
    save_adapter(model, ctx)
    tr.metrics.write("end", step=total_steps, **memory_snapshot(device))
    tr.metrics.close()

    gate: dict[str, Any] = {"passed": True}
    if cfg.min_accuracy is not None:
        passed = final["accuracy"] >= cfg.min_accuracy
        gate = {
            "passed": passed,
            "accuracy": final["accuracy"],
            "min_accuracy": cfg.min_accuracy,
            "message": (
                f"held-out reward accuracy {final['accuracy']:.3f} "
                f"{'>=' if passed else '<'} reward.min_accuracy {cfg.min_accuracy}"
                + ("" if passed else "; stopping before any RL stage")
            ),
        }
    return tr.summary(
        ctx,
        eval_start=first,
        eval_final=final,
        gate=gate,
        chat_template_sha256=template_sha,
        **data.stats,
        headline=tr.headline(eval_accuracy=final["accuracy"], eval_margin=final["margin"]),
    )


if __name__ == "__main__":
    stage_main(run)
