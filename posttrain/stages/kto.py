"""kto: tuning of the SFT policy from unpaired desirable / undesirable completions (KTO).

Algorithm choices:
- Policy and reference as in dpo, by role: base + the `from` policy's adapter (trainable
  "default") and the `reference` one (frozen, by default the same policy) on one base, sharded
  together by FSDP2.
- Per row: summed log-probs of the completion tokens (final assistant turn + its end-of-turn)
  under policy and reference; loss `kto_loss` (Ethayarajh et al., 2024). Rows weigh equally:
  each micro-batch backprops sum(row losses) * world / global_rows.
- The reference point z0 is estimated per optimizer step from MISMATCHED rows: the prompt of
  the row at stream position q of the global batch with the completion of the row at q + 1
  (wrapping), i.e. the batch shifted by one as in the paper and TRL. It is taken over the whole
  global batch (all micro-batches, all ranks: two no-grad forwards per micro-batch, policy and
  reference) before the loss, so every rank uses the same z0 whatever the batch split.
- Held-out rows at step 0 and at the end: loss, mean implicit reward of desirable and
  undesirable rows, their margin, z0 (over the held-out rows shifted by one), and, for rows that
  came from pairs, pair accuracy of the implicit reward (a tie counts half: 0.5 at step 0).
- Sequence parallelism (`infra.sequence_parallel` N > 1): the N ranks of a group take the same
  rows, each a slice of every micro-batch's tokens: the training rows (`Training.lay_out`),
  their mismatched partners and the held-out batches (`splitting`); each row's summed
  log-probs are all-reduced over the group (`forward_sequence_logps`), so every rank computes
  the same z0 and row losses, and figures summed over the world (z0's sum and count, the step
  metrics, the held-out table) are taken from the group's first rank only.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.data.batching import collate, step_indices
from posttrain.data.pref_prepare import guard_template, prepare_unpaired
from posttrain.distributed.fsdp import grad_sync
from posttrain.distributed.runtime import all_reduce_on_device, all_reduce_tensor
from posttrain.errors import RecipeVerdict
from posttrain.models.adapters import policy_with_reference, reference_pass
from posttrain.models.lora import prepare_for_training
from posttrain.models.sequence_split import splitting
from posttrain.runtime.context import StageContext, training_base
from posttrain.stages.common import stage_main
from posttrain.train.forward_logps import forward_sequence_logps
from posttrain.train.loop import (
    Draw,
    StepBatch,
    Training,
    add_sums,
    open_training,
    plan_steps,
    strided_batches,
    to_device,
)
from posttrain.train.micro_batches import regroup_step
from posttrain.train.preference_losses import (
    kto_kl_estimate,
    kto_loss,
    kto_summary,
    kto_weight_balance,
)

log = logging.getLogger("posttrain.kto")
# The paper's recommended range of desirable_weight * n_D / (undesirable_weight * n_U).
BALANCE_RANGE = (1.0, 4 / 3)


def completion_batch(
    rows: list[dict[str, Any]], pad_id: int, padding_free: bool = False
) -> dict[str, Any]:
    """Encoded completions -> one batch: padded [B, T], or padding-free [1, N]."""
    seqs = [{"input_ids": r["ids"], "labels": r["labels"]} for r in rows]
    return collate(seqs, pad_id, padding_free)


def mismatched(row: dict[str, Any], other: dict[str, Any], max_len: int) -> dict[str, Any]:
    """`row`'s prompt tokens then `other`'s completion tokens, cut to max_len: a sequence for
    z0. Spliced at the token level: the generation prompt ends at a token boundary
    (`encode_pair`'s check holds templates to it)."""
    p, q = row["prompt_len"], other["prompt_len"]
    ids = (row["ids"][:p] + other["ids"][q:])[:max_len]
    labels = (row["labels"][:p] + other["labels"][q:])[:max_len]
    return {"ids": ids, "labels": labels}


def partner_rows(
    n_rows: int, step: int, micro: int, accum: int, rank: int, world: int, seed: int
) -> list[list[int]]:
    """For each of this rank's rows at step `step` ([accum][micro], as `step_indices`), the row
    whose completion its mismatched sequence takes: the next row of the global batch's stream
    (wrapping), so the pairing does not depend on how the batch is split over ranks."""
    g = micro * accum * world
    stream = step_indices(n_rows, step, micro=g, accum=1, dp_size=1, rank=0, seed=seed)[0]
    return [
        [stream[((k * world + rank) * micro + j + 1) % g] for j in range(micro)]
        for k in range(accum)
    ]


def _logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    return forward_sequence_logps(model, batch, chunk)[0]  # [B] summed completion log-probs


@torch.no_grad()
def both_logps(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy [B], reference [B]) summed completion log-probs."""
    policy = _logps(model, batch, chunk)
    with reference_pass(model):
        ref = _logps(model, batch, chunk)
    return policy, ref


@torch.no_grad()
def heldout_kto(
    loop: Training, rows: list[dict[str, Any]], hp: dict[str, float], max_len: int
) -> dict[str, float] | None:
    """Held-out KTO figures (see the module docstring); None without held-out rows. Log-probs
    of every row and of its mismatched sequence (row i's prompt, row i+1's completion) are
    gathered rank-strided into [N, 4] (policy, reference, policy KL, reference KL), summed over
    ranks, then scored whole. With sequence parallelism each rank scores its shard of each
    (padding-free) batch and the group's first rank alone writes the rows' log-probs."""
    if not rows:
        return None
    model, device, chunk, pad_id = loop.model, loop.device, loop.chunk_tokens, loop.draw.pad_id
    model.eval()
    table = torch.zeros(len(rows), 4, dtype=torch.float64)
    n = len(rows)
    flat, writes = loop.sp is not None, loop.tr.dist.sp_rank == 0
    collate_rows = splitting(completion_batch, loop.sp)
    batches = strided_batches(
        rows, collate_rows, pad_id, loop.eval_batch_size, device, loop.dp_rank, loop.dp_size, flat
    )
    for idx, batch in batches:
        kl_rows = [mismatched(rows[i], rows[(i + 1) % n], max_len) for i in idx or [0]]
        cols = [*both_logps(model, batch, chunk)]
        cols += both_logps(model, to_device(collate_rows(kl_rows, pad_id, flat), device), chunk)
        if idx and writes:
            table[idx] = torch.stack(cols, dim=1).double().cpu()
    model.train()
    table = all_reduce_tensor(table, device)
    desirable = torch.tensor([r["desirable"] for r in rows])
    z0 = kto_kl_estimate(table[:, 2], table[:, 3])
    losses, m = kto_loss(table[:, 0], table[:, 1], desirable, z0, **hp)
    out = kto_summary({k: float(v) for k, v in m.items()}) | {"loss": float(losses.mean())}
    accuracy, n_pairs = pair_accuracy(rows, table[:, 0] - table[:, 1])
    if n_pairs:
        out |= {"pair_accuracy": accuracy, "pairs": n_pairs}
    return out


def pair_accuracy(rows: list[dict[str, Any]], logratios: torch.Tensor) -> tuple[float, int]:
    """(share of pairs whose desirable row has the higher implicit reward, a tie counting half;
    number of complete pairs) over rows sharing a `pair` id. logratios: [N] pi - ref."""
    sides: dict[str, dict[bool, float]] = {}
    for r, x in zip(rows, logratios.tolist(), strict=True):
        if r["pair"] is not None:
            sides.setdefault(r["pair"], {})[r["desirable"]] = x
    full = [s for s in sides.values() if len(s) == 2]
    if not full:
        return 0.0, 0
    score = sum(1.0 if s[True] > s[False] else 0.5 if s[True] == s[False] else 0.0 for s in full)
    return score / len(full), len(full)


def warn_balance(stats: dict[str, int], desirable_weight: float, undesirable_weight: float) -> None:
    """Log a warning when lambda_D * n_D / (lambda_U * n_U) leaves the paper's [1, 4/3]."""
    ratio = kto_weight_balance(
        stats["train_desirable"], stats["train_undesirable"], desirable_weight, undesirable_weight
    )
    lo, hi = BALANCE_RANGE
    if ratio is None or not lo <= ratio <= hi:
        log.warning(
            "kto.desirable_weight x desirable rows / (kto.undesirable_weight x undesirable rows) "
            "= %s x %d / (%s x %d) = %s, outside the paper's recommended [1, 4/3]; adjust "
            "kto.desirable_weight or kto.undesirable_weight",
            desirable_weight,
            stats["train_desirable"],
            undesirable_weight,
            stats["train_undesirable"],
            "undefined" if ratio is None else f"{ratio:.3f}",
        )


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.section
    policy_dir, reference_dir = ctx.adapter_dir("policy"), ctx.adapter_dir("reference")
    assert policy_dir is not None and reference_dir is not None  # the graph checks both
    recorded = ctx.role_manifest("policy")["summary"].get("chat_template_sha256")
    base, tok, weights = training_base(ctx)
    template_sha = guard_template(tok, recorded, ctx.stage.name, cfg, ctx.stage.roles["policy"])
    data = prepare_unpaired(cfg.data, tok, ctx.recipe.run.seed)
    batch, total_steps = plan_steps(ctx, data, len(data.train))
    if batch.global_batch_size < 2:
        raise RecipeVerdict(
            "batch.global_batch_size",
            f"{batch.global_batch_size} (micro {batch.micro_batch_size} x accum "
            f"{batch.grad_accum_steps} x {batch.dp_size} ranks): the KL reference point needs "
            "mismatched rows within a step; set a global batch of at least 2",
            ctx.where,
        )
    warn_balance(data.stats, cfg.desirable_weight, cfg.undesirable_weight)
    hp = {
        "beta": cfg.beta,
        "desirable_weight": cfg.desirable_weight,
        "undesirable_weight": cfg.undesirable_weight,
    }

    prepare_for_training(base, cfg.activation_checkpointing)
    model = policy_with_reference(base, policy_dir, reference_dir)

    def heldout(loop: Training) -> dict[str, float] | None:
        return heldout_kto(loop, data.eval, hp, cfg.data.max_seq_len)

    draw = Draw(data.train, completion_tokens, completion_batch, tok.pad_token_id)
    loop = open_training(ctx, model, weights, batch, total_steps, data, draw, heldout)
    if (first := loop.heldout_at_start()) is not None:
        log.info("held-out at step 0 (policy = reference): %s", first)
    for step in loop.steps():
        sb, kl_micro = kto_step_batch(loop, step, cfg.data.max_seq_len)
        loss, metrics = kto_step(loop, sb, kl_micro, hp)
        loop.finish_step(step, sb, loss=loss, **metrics)
    if (final := loop.heldout_at_end()) is not None:
        log.info("held-out at the end: %s", final)
    loop.close(selected_adapters=["default"])
    write_reference_record(ctx, reference_dir)
    return loop.tr.summary(
        ctx,
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        eval_start=first,
        eval_final=final,
        chat_template_sha256=template_sha,
        **data.stats,
        headline=loop.tr.headline(**kto_headline(final)),
    )


def completion_tokens(row: dict[str, Any]) -> int:
    return len(row["ids"])


def kto_step_batch(
    loop: Training, step: int, max_len: int
) -> tuple[StepBatch, list[dict[str, Any]]]:
    """This rank's rows of step `step` in micro-batches, and beside each the mismatched
    sequences of its rows (`partner_rows`) for z0. With batch.by_tokens the rows regroup and
    keep their partners: the regrouping runs over positions in this rank's (row, partner) list.
    With sequence parallelism the mismatched batches are this rank's shards, as the rows' are."""
    t_start = time.perf_counter()
    rows, batch, seed = loop.draw.rows, loop.batch, loop.ctx.recipe.run.seed
    own = loop.tr.step_rows(len(rows), step, batch, seed)
    partners = partner_rows(
        len(rows),
        step,
        batch.micro_batch_size,
        batch.grad_accum_steps,
        loop.dp_rank,
        loop.dp_size,
        seed,
    )
    slots = [
        (i, j) for ix, js in zip(own, partners, strict=True) for i, j in zip(ix, js, strict=True)
    ]
    width = len(own[0])
    groups = regroup_step(
        [list(range(k * width, (k + 1) * width)) for k in range(len(own))],
        lambda p: completion_tokens(rows[slots[p][0]]),
        loop.ctx.by_tokens,
        loop.device,
    )
    collate_kl = splitting(completion_batch, loop.sp)
    kl_micro = [
        to_device(
            collate_kl(
                [mismatched(rows[slots[p][0]], rows[slots[p][1]], max_len) for p in g],
                loop.draw.pad_id,
                loop.flat,
            ),
            loop.device,
        )
        for g in groups
    ]
    return loop.lay_out(t_start, [[slots[p][0] for p in g] for g in groups]), kl_micro


def kto_step(
    loop: Training, sb: StepBatch, kl_micro: list[dict[str, Any]], hp: dict[str, float]
) -> tuple[float, dict[str, float]]:
    """One step's forwards and backwards: first z0 over the whole global batch (no-grad
    forwards of every mismatched micro-batch, summed over ranks), so every rank uses the same
    z0; then per micro-batch the reference and policy log-probs and sum(row losses) * world /
    global_rows backpropagated. Returns the step's mean loss over all ranks and its figures,
    as device tensors (read by `finish_step`: the loss with the grad norm, the figures on logged
    steps only). Under sequence parallelism the ranks of a group hold the same rows' sums:
    the group's first rank alone counts them (in z0 and the figures)."""
    model, device, chunk = loop.model, loop.device, loop.chunk_tokens
    n_rows = loop.batch.global_batch_size
    counted = loop.tr.dist.counted
    t_kl = time.perf_counter()
    kl_logps = [both_logps(model, kb, chunk) for kb in kl_micro]
    z0 = kto_kl_estimate(
        torch.cat([p for p, _ in kl_logps]),
        torch.cat([r for _, r in kl_logps]),
        # Summed over ranks where it lies (no read to the host), each group's rows once.
        lambda totals: all_reduce_on_device(totals * counted),
    )
    t_kl = time.perf_counter() - t_kl

    keys = ("reward_desirable", "reward_undesirable", "n_desirable", "n_undesirable")
    sums: dict[str, Any] = dict.fromkeys(("loss", *keys), 0.0)
    t_ref = 0.0
    for k, (ix, mb) in enumerate(zip(sb.rows, sb.micro, strict=True)):
        grad_sync(model, k == len(sb.micro) - 1)
        t_r = time.perf_counter()
        with torch.no_grad(), reference_pass(model):
            ref = _logps(model, mb, chunk)
        t_ref += time.perf_counter() - t_r
        policy = _logps(model, mb, chunk)
        desirable = torch.tensor([loop.draw.rows[i]["desirable"] for i in ix])
        losses, m = kto_loss(policy, ref, desirable.to(device, non_blocking=True), z0, **hp)
        loop.tr.backward(losses.sum() * loop.world / n_rows)  # losses [micro]
        figures = {"loss": losses} | {k: m[k] for k in keys}
        add_sums(sums, {k: v * counted for k, v in figures.items()})
    # Sums over all ranks as 0-dim device tensors, read by nobody here: `finish_step` reads the
    # loss with the gradient norm (the guard's read) and the figures on logged steps only.
    totals = torch.stack([torch.as_tensor(v, device=device).double() for v in sums.values()])
    g = dict(zip(sums, all_reduce_on_device(totals).unbind(), strict=True))
    return g["loss"] / n_rows, {
        "reference_s": t_ref,
        "kl_s": t_kl,
        **kto_summary({**g, "kl": z0}),
    }


def kto_headline(final: dict[str, float] | None) -> dict[str, float]:
    """Held-out margin, z0 and (rows from pairs) pair accuracy; none without held-out rows."""
    if final is None:
        return {}
    head = {"eval_margin": final["margin"], "eval_kl": final["kl"]}
    if "pair_accuracy" in final:
        head["eval_pair_accuracy"] = final["pair_accuracy"]
    return head


def write_reference_record(ctx: StageContext, reference: Path) -> None:
    """reference.json (rank 0): the frozen reference adapter and its fingerprint."""
    if ctx.is_main:
        fingerprint = ctx.role_ref("reference").fingerprint
        (ctx.stage.out_dir / "reference.json").write_text(
            json.dumps({"reference": str(reference), "fingerprint": fingerprint}, indent=2)
        )


if __name__ == "__main__":
    stage_main(run)
