"""dpo: preference tuning of the SFT policy with the DPO loss family.

Algorithm choices:
- Policy = base + the SFT adapter, trained further. Reference = a frozen second copy of the SFT
  adapter on the SAME base ("reference" adapter): the reference is the SFT policy, never silently
  the raw base, and the base weights are held once. Both are sharded together by FSDP2.
- Per pair: summed log-probs of the response tokens (final assistant turn + its end-of-turn) under
  policy and reference; the loss comes from the registry (`dpo.loss`: sigmoid, ipo, robust,
  hinge, simpo), plus `sft_weight` x per-token NLL of the chosen response. Pairs weigh equally:
  each micro-batch backprops sum(pair losses) * world / global_pairs.
- `precompute_reference`: reference log-probs of every training pair are computed once and
  stored under `<workspace>/artifacts/ref_logps/<key>/`, key = hash(SFT adapter fingerprint,
  encoded pairs, template, lengths, and the numerics the pass ran under: device, threads,
  precision, attention, chunking, batch layout); later runs with the same key (another beta,
  loss, lr...) reuse them instead of running the reference forward every step, and get the
  bits they would have computed.
- The reference runs in eval mode (`reference_pass`): no dropout, whatever the SFT adapter was
  trained with, so its log-probs are a function of its weights alone.
- Held-out pairs at step 0 and at the end: implicit-reward accuracy and margin.
- Sequence parallelism (`infra.sequence_parallel` N > 1): the N ranks of a group take the same
  pairs, each a slice of every micro-batch's tokens (`splitting`); the rows' summed log-probs
  are all-reduced over the group (`shard_row_sums`), so every rank computes the same pair
  losses, and figures summed over the world (step metrics, held-out, the reference table) are
  taken from the group's first rank only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import torch

from posttrain.data.pref_prepare import guard_template, prepare
from posttrain.data.segments import pair_tokens
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_sum
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import policy_with_reference, reference_pass
from posttrain.models.lora import prepare_for_training
from posttrain.models.reward import pair_batch
from posttrain.models.sequence_split import group_of, splitting
from posttrain.runtime.context import StageContext, training_base
from posttrain.stages.common import stage_main
from posttrain.store.artifacts import canonical_json, fingerprint, stage_dir
from posttrain.store.cache import cached
from posttrain.train.forward_logps import pair_logps
from posttrain.train.loop import (
    Draw,
    StepBatch,
    Training,
    add_sums,
    open_training,
    plan_steps,
    strided_batches,
)
from posttrain.train.losses import pair_outcome, pair_tie
from posttrain.train.preference_losses import (
    REFERENCE_FREE,
    implicit_rewards,
    loss_hyperparameters,
    nll_term,
    preference_loss,
)

log = logging.getLogger("posttrain.dpo")
REF_CACHE_VERSION = "2"
REF_FILE = "ref_logps.safetensors"


@torch.no_grad()
def reference_logps(
    model: torch.nn.Module,
    pairs: list[dict],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    chunk_tokens: int = 0,
    flat: bool = False,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """[N, 2] (chosen, rejected) reference log-probs of every pair, computed strided over the
    data-parallel groups (`rank`/`world`: `strided_batches`), then summed across all ranks;
    `flat`: padding-free batches; `sp`: this rank's sequence-parallel group, whose ranks share
    each batch's tokens and hold the same log-probs (its first rank alone writes them)."""
    out = torch.zeros(len(pairs), 2, dtype=torch.float64, device=device)
    collate = splitting(pair_batch, sp)
    writes = sp is None or sp.rank == 0
    for idx, batch in strided_batches(
        pairs, collate, pad_id, batch_size, device, rank, world, flat, phase="reference"
    ):
        with reference_pass(model):
            c, r, _, _ = pair_logps(model, batch, chunk_tokens)
        if idx and writes:
            out[idx, 0], out[idx, 1] = c.double(), r.double()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(out)
    return out


def ref_cache_key(
    sft_fp: str,
    pairs: list[dict],
    template_sha: str,
    max_len: int,
    max_prompt_len: int,
    numerics: dict[str, Any],
) -> str:
    """The table's key: the reference, the encoded pairs, and the `numerics` of the pass that
    computes it (`StageContext.numerics` plus its batch layout): a table is reused only where
    computing it again would give the same bits (posttrain.numerics, issue 39)."""
    content = hashlib.sha256(
        canonical_json(
            [
                [p["chosen_ids"], p["chosen_labels"], p["rejected_ids"], p["rejected_labels"]]
                for p in pairs
            ]
        ).encode()
    ).hexdigest()
    return fingerprint(
        "ref_logps",
        REF_CACHE_VERSION,
        {
            "template": template_sha,
            "max_len": max_len,
            "max_prompt_len": max_prompt_len,
            "pairs": content,
            "numerics": numerics,
        },
        [sft_fp],
    )


def cached_reference(
    ctx: StageContext, loop: Training, key: str, numerics: dict[str, Any]
) -> tuple[torch.Tensor, str]:
    """([N, 2] reference log-probs of the training pairs, "hit" | "miss") from the workspace
    cache, computed and stored on a miss."""
    from safetensors.torch import load_file, save_file

    pairs = loop.draw.rows
    table, hit = cached(
        stage_dir(ctx.recipe.run.workspace, "ref_logps", key),
        lambda: reference_logps(
            loop.model,
            pairs,
            loop.draw.pad_id,
            loop.eval_batch_size,
            loop.device,
            loop.dp_rank,
            loop.dp_size,
            loop.chunk_tokens,
            loop.flat,
            group_of(loop.tr.dist),
        ),
        save=lambda logps, d: save_file({"logps": logps.cpu()}, d / REF_FILE),
        load=lambda d: load_file(d / REF_FILE)["logps"].to(loop.device),
        parents=[ctx.role_ref("reference").fingerprint],
        inputs={"pairs": len(pairs), "numerics": numerics},
        writer=ctx.is_main,
        barrier=torch.distributed.barrier,
    )
    return table, "hit" if hit else "miss"


@torch.no_grad()
def heldout_preferences(
    model: torch.nn.Module,
    pairs: list[dict],
    loss_fn: Any,
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    chunk_tokens: int = 0,
    *,
    loss: str,
    beta: float,
    sp: SequenceParallel | None = None,
) -> dict[str, float]:
    """Implicit-reward accuracy and margin (`implicit_rewards`, as evaluate computes them) and
    the mean loss on held-out pairs; the reference runs online (not at all when reference-free).
    `rank`/`world`: the data-parallel group's; `sp`: its sequence-parallel group (padding-free
    shards; the group's ranks hold the same figures, counted once: from its first rank)."""
    model.eval()
    needs_ref = loss not in REFERENCE_FREE
    s = {"n": 0.0, "correct": 0.0, "ties": 0.0, "margin": 0.0, "loss": 0.0}
    counts = sp is None or sp.rank == 0
    batches = strided_batches(
        pairs, splitting(pair_batch, sp), pad_id, batch_size, device, rank, world, sp is not None
    )
    for idx, batch in batches:
        w = 1.0 if idx and counts else 0.0
        pc, pr, lc, lr_ = pair_logps(model, batch, chunk_tokens)
        rc = rr = None
        if needs_ref:
            with reference_pass(model):
                rc, rr, _, _ = pair_logps(model, batch, chunk_tokens)
        losses = loss_fn(pc, pr, rc, rr, lc, lr_)[0]
        cr = implicit_rewards(pc, rc, lc, beta=beta, loss=loss)
        rj = implicit_rewards(pr, rr, lr_, beta=beta, loss=loss)
        s["n"] += w * len(losses)
        figures = {"correct": pair_outcome(cr, rj), "ties": pair_tie(cr, rj)}
        add_sums(s, figures | {"margin": cr - rj, "loss": losses}, w)
    model.train()
    t = {k: all_reduce_sum(v, device) for k, v in s.items()}
    n = max(1.0, t["n"])
    figures = {"accuracy": t["correct"] / n, "ties": t["ties"] / n, "margin": t["margin"] / n}
    return figures | {"loss": t["loss"] / n}


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    base, tok, weights = training_base(ctx)
    parent_sha = ctx.role_manifest("policy")["summary"].get("chat_template_sha256")
    template_sha = guard_template(tok, parent_sha, ctx.stage.name, cfg, ctx.stage.roles["policy"])
    data = prepare(cfg.data, tok, ctx.recipe.run.seed)
    batch, total_steps = plan_steps(ctx, data, len(data.train))
    hp = {"beta": cfg.beta, "label_smoothing": cfg.label_smoothing, "gamma": cfg.simpo_gamma}
    loss_fn = preference_loss(cfg.loss, **{k: hp[k] for k in loss_hyperparameters(cfg.loss)})

    prepare_for_training(base, cfg.activation_checkpointing)
    policy_dir, reference_dir = ctx.adapter_dir("policy"), ctx.adapter_dir("reference")
    assert policy_dir is not None and reference_dir is not None  # the graph checks both
    model = policy_with_reference(base, policy_dir, reference_dir)

    def heldout(loop: Training) -> dict[str, float]:
        return heldout_preferences(
            loop.model,
            data.eval,
            loss_fn,
            tok.pad_token_id,
            loop.eval_batch_size,
            loop.device,
            loop.dp_rank,
            loop.dp_size,
            loop.chunk_tokens,
            loss=cfg.loss,
            beta=cfg.beta,
            sp=group_of(loop.tr.dist),
        )

    # Under sequence parallelism a training micro-batch is this rank's shard of the pairs'
    # tokens: `Training.lay_out` splits it (the reference and held-out passes split their own).
    draw = Draw(data.train, pair_tokens, pair_batch, tok.pad_token_id)
    loop = open_training(
        ctx, model, weights, batch, total_steps, data, draw, heldout, loss_type=cfg.loss
    )
    ref_table, ref_cache = training_reference(ctx, loop, template_sha)
    if (first := loop.heldout_at_start()) is not None:
        log.info(
            "held-out preference accuracy at step 0 (policy = reference): %.3f", first["accuracy"]
        )
    for step in loop.steps():
        sb = loop.step_batch(step)
        loss, metrics = dpo_step(loop, sb, loss_fn, ref_table)
        loop.finish_step(step, sb, loss=loss, **metrics)
    final = loop.heldout_at_end()
    log.info("held-out preference accuracy %.3f, margin %.3f", final["accuracy"], final["margin"])
    loop.close(selected_adapters=["default"])
    write_reference_record(ctx, ref_cache)
    return loop.tr.summary(
        ctx,
        loss_type=cfg.loss,
        beta=cfg.beta,
        eval_start=first,
        eval_final=final,
        reference_cache=ref_cache,
        chat_template_sha256=template_sha,
        **data.stats,
        headline=loop.tr.headline(
            eval_pref_accuracy=final["accuracy"], eval_margin=final["margin"]
        ),
    )


def training_reference(
    ctx: StageContext, loop: Training, template_sha: str
) -> tuple[torch.Tensor | None, str]:
    """([N, 2] reference log-probs of every training pair, "hit" | "miss") when
    `precompute_reference` says they are computed once; (None, "off") when the reference runs
    online each step, or not at all (a reference-free loss)."""
    cfg = ctx.section
    precompute = cfg.precompute_reference
    if precompute is None:  # auto: when each pair's reference would be computed again
        precompute = loop.tr.total_steps * loop.batch.global_batch_size > len(loop.draw.rows)
    if cfg.loss in REFERENCE_FREE or not precompute:
        return None, "off"
    numerics = ctx.numerics() | {"batch_size": loop.eval_batch_size, "padding_free": loop.flat}
    if (n := loop.tr.dist.sp_size) > 1:  # the rows' sums add up in another order
        numerics["sequence_parallel"] = n
    key = ref_cache_key(
        ctx.role_ref("reference").fingerprint,
        loop.draw.rows,
        template_sha,
        cfg.data.max_seq_len,
        cfg.data.max_prompt_len,
        numerics,
    )
    table, cache = cached_reference(ctx, loop, key, numerics)
    log.info("reference log-probs: cache %s (%s)", cache, key)
    return table, cache


def dpo_step(
    loop: Training, sb: StepBatch, loss_fn: Any, ref_table: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """One step's forwards and backwards. Per micro-batch of pairs: the reference log-probs
    (zeros for a reference-free loss, from `ref_table` when precomputed, else a no-grad forward
    under the reference adapter), the policy forward, and sum(pair losses) * world /
    global_pairs (+ `sft_weight` x the chosen NLL, weighted the same) backpropagated. Returns
    the step's mean preference loss over all ranks and its mean metrics, as device tensors
    (`Training.step_means`: read by `finish_step`). Under sequence parallelism every rank of a
    group computes the same pair losses from the group's summed log-probs; each backpropagates
    them through its own tokens, and the group's first rank alone counts them in the metrics."""
    cfg, model, device = loop.section, loop.model, loop.device
    n_pairs, world = loop.batch.global_batch_size, loop.world
    shared = loop.tr.dist.sp_size > 1
    counted = loop.tr.dist.counted
    sums: dict[str, torch.Tensor] = {}  # in the order the metrics record lists them
    t_ref = 0.0
    for k, (ix, mb) in enumerate(zip(sb.rows, sb.micro, strict=True)):
        grad_sync(model, k == len(sb.micro) - 1)
        if cfg.loss in REFERENCE_FREE:
            rc = rr = torch.zeros(len(ix), device=device)
        elif ref_table is not None:
            rc, rr = ref_table[ix, 0].float(), ref_table[ix, 1].float()
        else:
            t_r = time.perf_counter()
            with torch.no_grad(), reference_pass(model):
                rc, rr, _, _ = pair_logps(model, mb, loop.chunk_tokens)
            t_ref += time.perf_counter() - t_r
        pc, pr, lc, lr_ = pair_logps(model, mb, loop.chunk_tokens)
        losses, cr, rj = loss_fn(pc, pr, rc, rr, lc, lr_)  # [micro] each
        loss = losses.sum() * world / n_pairs
        if cfg.sft_weight:
            loss = loss + cfg.sft_weight * nll_term(pc, lc) * len(ix) * world / n_pairs
        loop.tr.backward(loss)
        figures = {
            "loss": losses,
            "correct": pair_outcome(cr, rj),
            "margin": cr - rj,
            "chosen_reward": cr,
            "rejected_reward": rj,
            "policy_chosen_logps": pc,
            "policy_rejected_logps": pr,
            "ref_chosen_logps": rc,
            "ref_rejected_logps": rr,
        }
        add_sums(sums, {n: v * counted for n, v in figures.items()} if shared else figures)
    g = loop.step_means(sums)
    # The preference loss judges the step; a non-finite SFT term shows in the gradient norm.
    loss = g.pop("loss")
    return loss, {"accuracy": g.pop("correct"), "reference_s": t_ref, **g}


def write_reference_record(ctx: StageContext, ref_cache: str) -> None:
    """reference.json (rank 0): which adapter was the reference, its fingerprint, and whether
    its log-probs were precomputed ("hit" | "miss" of the cache, or "off")."""
    if not ctx.is_main:
        return
    reference = f"{ctx.stage.roles['reference']} adapter"
    fp = ctx.role_ref("reference").fingerprint
    record = {"reference": reference, "reference_fingerprint": fp, "precomputed": ref_cache}
    (ctx.stage.out_dir / "reference.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    stage_main(run)
