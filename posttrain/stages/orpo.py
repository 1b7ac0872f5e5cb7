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
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.config.loader import section_batch
from posttrain.data.pref_prepare import guard_template, prepare
from posttrain.data.segments import batch_rows, layout_stats, pair_tokens
from posttrain.data.sft_data import write_splits
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum, all_reduce_sums, rank_batches
from posttrain.kinds.orpo import ORPOConfig
from posttrain.models.adapters import trainable_adapter
from posttrain.models.lora import apply_lora, prepare_for_training
from posttrain.models.reward import pair_batch
from posttrain.stages.common import StageContext, stage_main, training_base
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import memory_snapshot
from posttrain.train.chunked import pair_logps
from posttrain.train.micro_batches import padding_free, regroup_step
from posttrain.train.preference_losses import orpo_loss
from posttrain.train.session import planned_steps, save_adapter, start_session

log = logging.getLogger("posttrain.orpo")


def start_adapter(ctx: StageContext) -> Path | None:
    """The adapter ORPO continues: its `from` policy's. None = it starts from the base, with a
    fresh LoRA (`lora`). The one place that decides where the policy comes from."""
    return ctx.adapter_dir("policy")


def _section(ctx: StageContext) -> ORPOConfig:
    cfg = ctx.section
    assert isinstance(cfg, ORPOConfig), f"stage {ctx.name}: not an ORPO section"
    return cfg


@torch.no_grad()
def heldout_orpo(
    model: torch.nn.Module,
    pairs: list[dict],
    beta: float,
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    chunk_tokens: int = 0,
) -> dict[str, float]:
    """Accuracy, reward margin, ORPO loss, chosen NLL and log-odds ratio on held-out pairs,
    rank-strided with the same number of forwards on every rank (a rank without rows runs a
    dummy batch with weight 0), then summed across ranks."""
    model.eval()
    keys = ("correct", "margin", "loss", "nll", "log_odds_ratio")
    s = dict.fromkeys(("n", *keys), 0.0)
    for idx in rank_batches(len(pairs), rank, world, batch_size):
        heartbeat.beat(phase="eval")
        chunk = [pairs[i] for i in idx] or pairs[:1]
        w = 1.0 if idx else 0.0
        batch = {k: v.to(device) for k, v in pair_batch(chunk, pad_id).items()}
        losses, m = orpo_loss(*pair_logps(model, batch, chunk_tokens), beta=beta)
        s["n"] += w * len(losses)
        s["loss"] += w * losses.sum().item()
        for k in ("correct", "margin", "nll", "log_odds_ratio"):
            s[k] += w * m[k].sum().item()
    model.train()
    t = {k: all_reduce_sum(v, device) for k, v in s.items()}
    n = max(1.0, t.pop("n"))
    out = {k: v / n for k, v in t.items()}
    out["accuracy"] = out.pop("correct")
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = _section(ctx)
    d = ctx.dist
    device, rank, world = d.device, d.rank, d.world_size
    seed = ctx.recipe.run.seed
    chunk_tokens = ctx.recipe.infra.logits_chunk_tokens

    base, tok, weights = training_base(ctx)
    adapter = start_adapter(ctx)
    # The policy it starts from recorded the template it learnt (from the base: ingest's).
    recorded = ctx.role_manifest("policy")["summary"].get("chat_template_sha256")
    template_sha = guard_template(tok, recorded, ctx.name, cfg, ctx.roles["policy"])
    data = prepare(cfg.data, tok, seed)
    if ctx.is_main:
        write_splits(ctx.out_dir, data.train_rows, data.eval_rows)
    batch = section_batch(ctx.recipe, ctx.name)
    total_steps = planned_steps(cfg.max_steps, cfg.epochs, len(data.train), batch)

    prepare_for_training(base, cfg.activation_checkpointing)
    model = trainable_adapter(base, adapter) if adapter else apply_lora(base, cfg.lora)
    tr = start_session(
        ctx,
        model,
        cfg.optim,
        batch,
        total_steps,
        weights=weights,
        train_examples=len(data.train),
        eval_examples=len(data.eval),
        start=f"{ctx.roles['policy']} adapter" if adapter else "fresh lora",
        **data.stats,
    )
    model = tr.model
    flat = padding_free(cfg.batch, model)
    pad, eval_bs = tok.pad_token_id, batch.micro_batch_size

    first = None
    if tr.start_step == 0:
        first = heldout_orpo(
            model, data.eval, cfg.beta, pad, eval_bs, device, rank, world, chunk_tokens
        )
        tr.metrics.write("eval", step=0, **{f"eval_{k}": v for k, v in first.items()})
        log.info("held-out pair accuracy at step 0: %.3f", first["accuracy"])

    for step in range(tr.start_step, total_steps):
        t0 = time.perf_counter()
        micro = [
            (
                ix,
                {
                    k: v.to(device)
                    for k, v in pair_batch([data.train[i] for i in ix], pad, flat).items()
                },
            )
            for ix in regroup_step(
                tr.step_rows(len(data.train), step, batch, seed),
                lambda i: pair_tokens(data.train[i]),
                cfg.batch,
                device,
            )
        ]
        # Counted on the host: reading a device tensor would wait for the last update.
        local_tokens = sum(pair_tokens(data.train[i]) for ix, _ in micro for i in ix)
        t_data = time.perf_counter() - t0
        sums: dict[str, torch.Tensor] = {}  # summed on the device, read once per step
        for k, (_, mb) in enumerate(micro):
            grad_sync(model, k == len(micro) - 1)
            pc, pr, lc, lr_ = pair_logps(model, mb, chunk_tokens)  # [micro] each
            losses, m = orpo_loss(pc, pr, lc, lr_, beta=cfg.beta)
            tr.backward(losses.sum() * world / batch.global_batch_size)
            m |= {"loss": losses, "policy_chosen_logps": pc, "policy_rejected_logps": pr}
            for name, v in m.items():
                sums[name] = sums.get(name, 0.0) + v.detach().sum()
        g = {
            k: v / batch.global_batch_size for k, v in sorted(all_reduce_sums(sums, device).items())
        }
        loss = g.pop("loss")
        tr.finish_step(
            step + 1,
            cfg,
            loss=loss,
            local_tokens=local_tokens,
            n_seqs=sum(batch_rows(mb) for _, mb in micro),
            **layout_stats([mb for _, mb in micro], local_tokens),
            t_start=t0,
            t_data=t_data,
            accuracy=g.pop("correct"),
            **g,
        )

    final = heldout_orpo(
        model, data.eval, cfg.beta, pad, eval_bs, device, rank, world, chunk_tokens
    )
    tr.metrics.write("eval", step=total_steps, **{f"eval_{k}": v for k, v in final.items()})
    log.info("held-out pair accuracy %.3f, margin %.4f", final["accuracy"], final["margin"])
    save_adapter(model, ctx)
    tr.metrics.write("end", step=total_steps, **memory_snapshot(device))
    tr.metrics.close()
    return tr.summary(
        ctx,
        beta=cfg.beta,
        start=f"{ctx.roles['policy']} adapter" if adapter else "fresh lora",
        eval_start=first,
        eval_final=final,
        chat_template_sha256=template_sha,
        **data.stats,
        headline=tr.headline(
            eval_pref_accuracy=final["accuracy"],
            eval_margin=final["margin"],
            eval_nll=final["nll"],
        ),
    )


if __name__ == "__main__":
    stage_main(run)
