"""The online-RL loop PPO and GRPO share (`posttrain.stages.ppo`, `posttrain.stages.grpo`).

One logged step = one rollout:
1. generate: each rank samples responses for its share of `rollout.prompts_per_step` prompts
   (x samples_per_prompt) from the sharded policy, KV cache on, stopping at EOS;
2. score: policy and reference log-probs, critic values (PPO) and reward-model scores, no grad;
3. advantages: from the algorithm registry (`posttrain.train.rl_algos`): GAE over the critic for
   PPO, group-normalised scores for GRPO; KL against the reference in the reward or the loss;
4. update: `update_epochs` passes over the rollout in shuffled minibatches of `batch` (micro x
   accum x ranks sequences), clipped policy loss - entropy bonus (+ KL) and, with a critic, the
   clipped value loss; means over the whole minibatch on all ranks, per token or per response
   (`loss_aggregation`).

All four roles live on one base (`posttrain.models.roles`), sharded together by FSDP2.
Checkpoints at rollout boundaries hold the trainable adapters and heads, optimizer, schedule and
the KL coefficient; rollouts are seeded by (seed, step, rank), so a resumed run samples what an
uninterrupted one would. Held-out prompts at the end (and every `eval_every`): mean reward of the
policy's samples vs the SFT policy's, and KL(policy || SFT) per response; `max_kl` and
`min_reward_gain` are quality gates.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from functools import partial
from typing import Any

import torch

from posttrain.config.loader import section_batch
from posttrain.data.batching import step_indices
from posttrain.data.pref_prepare import guard_template
from posttrain.data.prompts import PromptData, prepare_prompts
from posttrain.data.sft_data import write_rows
from posttrain.distributed.fsdp import forward_method, grad_sync
from posttrain.distributed.runtime import (
    DistInfo,
    all_reduce_sum,
    all_reduce_tensor,
    min_max,
    rank_batches,
)
from posttrain.eval.stop_tokens import model_stop_token_ids
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.lora import prepare_for_training
from posttrain.models.roles import VALUE, build_roles
from posttrain.rewards.combine import load_rewards
from posttrain.stages.common import StageContext, training_base
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import memory_snapshot, train_flops_per_token
from posttrain.train.checkpoint import data_position
from posttrain.train.rl_algos import ALGORITHMS, Algorithm, sequence_kl
from posttrain.train.rl_losses import (
    KLController,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    informative_groups,
    kl_penalty,
    loss_weights,
)
from posttrain.train.rl_rewards import (
    Rewarder,
    add_function_sums,
    function_metrics,
    function_values,
)
from posttrain.train.rollout import Rollout, decode_responses, response_logps, sample, score
from posttrain.train.session import TrainSession, save_adapter, start_session

log = logging.getLogger("posttrain.rl")


def rollout_seed(seed: int, step: int, rank: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + rank * 104_729) % (2**31)


def check_shapes(name: str, cfg: Any, batch: Any, world: int) -> tuple[int, int]:
    """(sequences per rank per rollout, optimizer updates per rollout), or a ValueError naming
    the fields that do not fit together."""
    r = cfg.rollout
    if r.prompts_per_step % world:
        raise ValueError(
            f"{name}.rollout.prompts_per_step {r.prompts_per_step} must be a multiple of the "
            f"{world} ranks (each rank rolls out the same number of prompts)"
        )
    local = r.prompts_per_step // world * r.samples_per_prompt
    per_update = batch.micro_batch_size * batch.grad_accum_steps
    if local % per_update:
        raise ValueError(
            f"{name}.batch: one update takes micro {batch.micro_batch_size} x accum "
            f"{batch.grad_accum_steps} = {per_update} sequences per rank, but a rollout gives "
            f"{local} per rank (prompts_per_step / ranks x samples_per_prompt); make it a "
            f"multiple"
        )
    return local, cfg.update_epochs * local // per_update


def _to(inp: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in inp.items()}


def update(
    tr: TrainSession,
    ro: Rollout,
    adv: torch.Tensor,
    returns: torch.Tensor | None,
    cfg: Any,
    batch: Any,
    kl_in_loss: float,
    seed: int,
    step: int,
    chunk_tokens: int = 0,
) -> dict[str, float]:
    """`update_epochs` passes of clipped updates over one rollout; each minibatch's objective is
    aggregated as `cfg.loss_aggregation` says (`rl_losses.loss_weights`), the policy ratio
    clipped to [1 - clip_range, 1 + clip_range_high]. Returns token-weighted means
    over all ranks (policy_loss, value_loss, entropy, clip_frac, value_clip_frac, approx_kl,
    kl_loss) and the mean grad norm; `updates` counts optimizer steps. `step`: the rollout's
    logged step (1-based), for the guard's records. `chunk_tokens`: tokens per pass through the
    LM head (`infra.logits_chunk_tokens`; 0 = full logits)."""
    model, d = tr.model, tr.dist
    device, world = d.device, d.world_size
    micro, per_update = batch.micro_batch_size, batch.micro_batch_size * batch.grad_accum_steps
    critic = returns is not None
    sums: Counter[str] = Counter()
    norms: list[float] = []
    old, ref = ro.scored["logps"], ro.scored["ref_logps"]
    # None only on ppo (token_mean); a grpo section holds its algorithm's (GRPOConfig presets).
    aggregation = cfg.loss_aggregation or "token_mean"
    clip_high = cfg.clip_range_high  # None = clip_range on both sides
    for epoch in range(cfg.update_epochs):
        g = torch.Generator().manual_seed(seed + epoch)
        perm = torch.randperm(ro.n, generator=g)
        for u in range(ro.n // per_update):
            rows = perm[u * per_update : (u + 1) * per_update]
            # The mean over the whole minibatch on every rank: per-token weights [rows, R] that
            # depend on their row only (the mask, or the mask over the row's tokens or over
            # max_new_tokens) and a count summed over ranks (tokens or sequences). Each rank
            # scales its weighted sum by world / global count, and FSDP's gradient averaging
            # divides the world back: exactly the global mean at any number of ranks.
            weights, count = loss_weights(ro.mask[rows], aggregation, cfg.rollout.max_new_tokens)
            scale = world / max(1.0, all_reduce_sum(count, device))
            micros = rows.split(micro)
            # This rank's share of the update's objective: summed over ranks, the global mean.
            share = 0.0
            for k, mi in enumerate(micros):
                last = k == len(micros) - 1
                inp = _to(ro.inputs(mi), device)
                m = ro.mask[mi].to(device)
                w = weights[k * micro : k * micro + len(mi)].to(device)  # [n, R]
                grad_sync(model, last and not critic)
                logp, ent = response_logps(
                    model,
                    POLICY,
                    inp,
                    ro.response[mi].to(device),
                    m,
                    chunk_tokens,
                    entropy=True,
                    temperature=cfg.rollout.temperature,
                )  # [n, R] each, under the sampling temperature
                assert ent is not None
                pg, clipped = clipped_policy_loss(
                    logp, old[mi].to(device), adv[mi].to(device), cfg.clip_range, clip_high
                )
                per_token = pg - cfg.entropy_coef * ent
                kl_t = kl_penalty(logp, ref[mi].to(device), cfg.kl.estimator)
                if kl_in_loss:
                    per_token = per_token + kl_in_loss * kl_t
                objective = (per_token * w).sum() * scale
                tr.backward(objective)
                share += float(objective.detach()) / world
                ratio_log = logp.detach() - old[mi].to(device)
                for name, v in (
                    ("policy_loss", pg),
                    ("entropy", ent),
                    ("clip_frac", clipped.float()),
                    ("approx_kl", 0.5 * ratio_log**2),
                    ("kl_loss", kl_t),
                    ("tokens", torch.ones_like(pg)),
                ):
                    sums[name] += float((v.detach() * m).sum())
                if critic:
                    grad_sync(model, last)
                    values = model(VALUE, **inp)  # [n, R]
                    vf, vclipped = clipped_value_loss(
                        values,
                        ro.scored["values"][mi].to(device),
                        returns[mi].to(device),
                        cfg.value_clip,
                    )
                    value_objective = cfg.vf_coef * (vf * w).sum() * scale
                    tr.backward(value_objective)
                    share += float(value_objective.detach()) / world
                    sums["value_loss"] += float((vf.detach() * m).sum())
                    sums["value_clip_frac"] += float((vclipped.float() * m).sum())
            norm, lr = tr.optimizer_step(
                cfg.optim.max_grad_norm,
                loss=all_reduce_sum(share, device),
                step=step,
                epoch=epoch,
                update=u,
            )
            norms.append(norm)
    tot = {k: all_reduce_sum(v, device) for k, v in sums.items()}
    n_tok = max(1.0, tot.pop("tokens"))
    out = {k: v / n_tok for k, v in tot.items()}
    out |= {"grad_norm": sum(norms) / len(norms), "lr": lr, "updates": len(norms)}
    return out


@torch.no_grad()
def heldout(
    model: torch.nn.Module,
    tok: Any,
    rows: list[dict[str, Any]],
    cfg: Any,
    seed: int,
    d: DistInfo,
    role: str,
    batch_size: int,
    rewarder: Rewarder,
    chunk_tokens: int = 0,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Mean reward (`rewarder`: functions and/or reward model; each function's own mean as
    `reward_fn_<label>`) and KL(policy || reference) per response, for the policy, of one
    sample per held-out prompt from `role`. Prompt batch b is sampled with seed + b's first row,
    so the policy and the reference see the same prompts under the same seeds. Returns (means
    over all ranks, this rank's examples)."""
    # The tokenizer's EOS, the model's generation_config eos ids, the template's end of turn.
    pad, stops = tok.pad_token_id, model_stop_token_ids(model, tok)
    roles = ((POLICY, REFERENCE) if role == POLICY else ()) + rewarder.roles
    sums: Counter[str] = Counter()
    examples = []
    for idx in rank_batches(len(rows), d.rank, d.world_size, batch_size):
        heartbeat.beat(phase="eval")
        chunk = [rows[i] for i in idx] or rows[:1]
        w = 1.0 if idx else 0.0
        ro = sample(
            model,
            [r["ids"] for r in chunk],
            [r["messages"] for r in chunk],
            cfg.rollout,
            pad,
            stops,
            seed + (idx[0] if idx else 0),
            d.world_size,
            role=role,
        )
        score(
            model,
            ro,
            tok,
            batch_size,
            cfg.data.max_prompt_len,
            roles,
            chunk_tokens,
            cfg.rollout.temperature,
        )
        rewarder(ro, chunk)
        per = function_values(ro)
        add_function_sums(sums, per, w)
        s = ro.scored["scores"]
        sums["n"] += w * ro.n
        sums["reward"] += w * float(s.sum())
        sums["reward_sq"] += w * float((s**2).sum())
        sums["length"] += w * float(ro.mask.sum())
        sums["stopped"] += w * float(ro.stopped.sum())
        if role == POLICY:
            sums["kl"] += w * float(sequence_kl(ro, "k1").sum())
        if w:
            examples += [
                {
                    "prompt": r["messages"],
                    "response": t,
                    "reward": float(v),
                    **{f"reward_{k}": _finite(p[i]) for k, p in per.items()},
                    **r.get("columns", {}),
                }
                for i, (r, t, v) in enumerate(
                    zip(chunk, decode_responses(tok, ro), s.tolist(), strict=True)
                )
            ]
    t = {k: all_reduce_sum(v, d.device) for k, v in sums.items()}
    n = max(1.0, t.pop("n"))
    out = {
        "reward": t["reward"] / n,
        "reward_std": math.sqrt(max(0.0, t["reward_sq"] / n - (t["reward"] / n) ** 2)),
        "response_len": t["length"] / n,
        "stop_rate": t["stopped"] / n,
        "prompts": n,
    }
    if role == POLICY:
        out["kl"] = t["kl"] / n
    out |= function_metrics(t)
    return out, examples


def _finite(x: torch.Tensor) -> float | None:
    return None if torch.isnan(x) else float(x)


def _gate(cfg: Any, final: dict[str, float], sft: dict[str, float]) -> dict[str, Any]:
    problems = []
    gain = final["reward"] - sft["reward"]
    if cfg.max_kl is not None and final["kl"] > cfg.max_kl:
        problems.append(f"held-out KL {final['kl']:.3f} exceeds max_kl {cfg.max_kl}")
    if cfg.min_reward_gain is not None and gain < cfg.min_reward_gain:
        problems.append(
            f"held-out reward gain {gain:.4f} over the starting policy is below min_reward_gain "
            f"{cfg.min_reward_gain}"
        )
    return {"passed": not problems, **({"message": "; ".join(problems)} if problems else {})}


def run_online_rl(ctx: StageContext, algorithm: str) -> dict[str, Any]:
    algo: Algorithm = ALGORITHMS[algorithm]
    cfg, name = ctx.section, ctx.name
    d = ctx.dist
    device, rank, world = d.device, d.rank, d.world_size
    seed = ctx.recipe.run.seed
    chunk_tokens = ctx.recipe.infra.logits_chunk_tokens

    base, tok, weights = training_base(ctx)
    template_sha = guard_template(
        tok,
        ctx.role_manifest("policy")["summary"].get("chat_template_sha256"),
        name,
        cfg,
        ctx.roles["policy"],
    )
    has_rm = ctx.has_role("reward_model")
    if has_rm:
        guard_template(
            tok,
            ctx.role_manifest("reward_model")["summary"].get("chat_template_sha256"),
            name,
            cfg,
            ctx.roles["reward_model"],
        )
    # Imported from the files the resolved recipe points at (the flow checked where from).
    rewarder = Rewarder(load_rewards(cfg.rewards), cfg.reward_model_weight if has_rm else None, tok)
    data: PromptData = prepare_prompts(cfg.data, tok, seed)
    if ctx.is_main:
        (ctx.out_dir / "data").mkdir(parents=True, exist_ok=True)
        for split, rows in (("train", data.train), ("eval", data.eval)):
            write_rows(
                ctx.out_dir / "data" / f"{split}.jsonl",
                [{"prompt": r["messages"], **r["columns"]} for r in rows],
            )
    if not data.eval:
        raise ValueError(f"{name}.data: no held-out prompts; set eval_fraction > 0 or eval_path")
    batch = section_batch(ctx.recipe, name)
    local_seqs, updates_per_rollout = check_shapes(name, cfg, batch, world)
    n_rollouts = cfg.max_steps or max(
        1, math.ceil(cfg.epochs * len(data.train) / cfg.rollout.prompts_per_step)
    )
    placement = algo.kl_placement if cfg.kl.placement == "auto" else cfg.kl.placement

    prepare_for_training(base, cfg.activation_checkpointing)
    policy_dir, reference_dir = ctx.adapter_dir("policy"), ctx.adapter_dir("reference")
    assert policy_dir is not None and reference_dir is not None  # the graph checks both
    model = build_roles(
        base,
        policy_dir,
        ctx.role_dir("reward_model") / "adapter" if has_rm else None,
        critic=algo.critic,
        reference_adapter=reference_dir,
    )
    tr = start_session(
        ctx,
        model,
        cfg.optim,
        batch,
        n_rollouts,
        schedule_steps=n_rollouts * updates_per_rollout,
        weights=weights,
        algorithm=name,
        roles="policy,reference"
        + (",reward" if has_rm else "")
        + (",value" if algo.critic else ""),
        reward_functions=",".join(f.label for f in rewarder.funcs),
        kl_placement=placement,
        updates_per_rollout=updates_per_rollout,
        sequences_per_rollout=local_seqs * world,
        **data.stats,
    )
    model = tr.model
    forward_method(model, "generate")
    ctl = KLController(cfg.kl.coef, cfg.kl.adaptive, cfg.kl.target, cfg.kl.horizon)
    ctl.coef = tr.resume_meta.get("kl_coef", ctl.coef)
    reduce = partial(all_reduce_tensor, device=device)
    eval_rows = data.eval[: cfg.eval_prompts]
    eval_bs = batch.micro_batch_size
    sft_eval: dict[str, float] | None = None

    def evaluate(step: int) -> dict[str, float]:
        nonlocal sft_eval
        if sft_eval is None:
            sft_eval, _ = heldout(
                model, tok, eval_rows, cfg, seed, d, REFERENCE, eval_bs, rewarder, chunk_tokens
            )
            tr.metrics.write("eval", step=step, **{f"sft_{k}": v for k, v in sft_eval.items()})
        pol, examples = heldout(
            model, tok, eval_rows, cfg, seed, d, POLICY, eval_bs, rewarder, chunk_tokens
        )
        pol["reward_gain"] = pol["reward"] - sft_eval["reward"]
        tr.metrics.write("eval", step=step, **{f"eval_{k}": v for k, v in pol.items()})
        log.info(
            "held-out reward %.4f (starting policy %.4f, gain %+.4f), KL to the reference %.3f",
            pol["reward"],
            sft_eval["reward"],
            pol["reward_gain"],
            pol["kl"],
        )
        if ctx.is_main:
            write_rows(ctx.out_dir / "eval_samples.jsonl", examples)
        return pol

    roles = (POLICY, REFERENCE) + rewarder.roles + ((VALUE,) if algo.critic else ())
    # Responses end at any stop id (EOS, generation_config eos ids, the template's end of turn):
    # the response mask, the reward's input and `missing_eos_penalty` all follow it.
    stop_ids = model_stop_token_ids(model, tok)
    log.info("rollouts stop at token ids %s", stop_ids)
    n_mat, cfg_m = tr.n_matmul, model.config
    group = cfg.rollout.samples_per_prompt
    per_rank = cfg.rollout.prompts_per_step // world

    def one_round(step: int, r: int) -> tuple[Rollout, float, float]:
        """Round r of step `step`: this rank's prompts (round 0: the step's own; later rounds of
        dynamic sampling: another seeded draw) x samples, generated, scored and rewarded; with
        the generation and scoring seconds."""
        t = time.perf_counter()
        idx = step_indices(
            len(data.train),
            step,
            micro=per_rank,
            accum=1,
            dp_size=world,
            rank=rank,
            seed=seed + r * 1_000_003,
        )[0]
        rows = [data.train[i] for i in idx for _ in range(group)]
        ro = sample(
            model,
            [x["ids"] for x in rows],
            [x["messages"] for x in rows],
            cfg.rollout,
            tok.pad_token_id,
            stop_ids,
            rollout_seed(seed + r, step, rank),
            world,
        )
        t_gen = time.perf_counter() - t
        score(
            model,
            ro,
            tok,
            batch.micro_batch_size,
            cfg.data.max_prompt_len,
            roles,
            chunk_tokens,
            cfg.rollout.temperature,
        )
        rewarder(ro, rows)
        return ro, t_gen, time.perf_counter() - t - t_gen

    def groups(ro: Rollout, which: list[int]) -> Rollout:
        """The sequences of prompt groups `which` (consecutive runs of `group` samples)."""
        return ro.select([g * group + j for g in which for j in range(group)])

    def rollout_step(step: int) -> tuple[Rollout, float, float, dict[str, float]]:
        """The step's rollout, generation and scoring seconds, and sampling stats. With dynamic
        sampling (DAPO), groups whose samples all score the same are dropped and more prompts
        sampled, up to max_sampling_rounds rounds; every rank runs the same number of rounds
        (generation is synced), and a batch still short after the last round is topped up with
        dropped groups (zero advantage) so shapes hold."""
        ro, t_gen, t_score = one_round(step, 0)
        stats: dict[str, float] = {}
        if group < 2:
            return ro, t_gen, t_score, stats
        informative = informative_groups(ro.scored["scores"], group)
        stats["informative_frac"] = (
            all_reduce_sum(float(informative.float().mean()), device) / world
        )
        if not cfg.dynamic_sampling:
            return ro, t_gen, t_score, stats
        kept: list[Rollout] = []
        spare: list[Rollout] = []
        have, rounds = 0, 1
        while True:
            take = informative.nonzero().flatten()[: per_rank - have].tolist()
            kept.append(groups(ro, take))
            spare.append(groups(ro, (~informative).nonzero().flatten().tolist()))
            have += len(take)
            if rounds == cfg.max_sampling_rounds or not all_reduce_sum(
                float(have < per_rank), device
            ):
                break
            ro, gen_s, score_s = one_round(step, rounds)
            t_gen, t_score, rounds = t_gen + gen_s, t_score + score_s, rounds + 1
            informative = informative_groups(ro.scored["scores"], group)
        topped = 0
        for extra in spare:  # top up with zero-advantage groups
            n = min(extra.n // group, per_rank - have)
            if n:
                kept.append(groups(extra, list(range(n))))
                have, topped = have + n, topped + n
        ro = Rollout.cat([k for k in kept if k.n], tok.pad_token_id)
        stats |= {
            "sampling_rounds": rounds,
            "topped_up_groups": all_reduce_sum(float(topped), device),
        }
        return ro, t_gen, t_score, stats

    for step in range(tr.start_step, n_rollouts):
        t0 = time.perf_counter()
        heartbeat.beat(phase="rollout")
        ro, t_gen, t_score, sampling = rollout_step(step)
        kl_coef = ctl.coef
        adv, returns = algo.advantages(ro, cfg, kl_coef if placement == "reward" else 0.0, reduce)
        stats = update(
            tr,
            ro,
            adv,
            returns,
            cfg,
            batch,
            kl_coef if placement == "loss" else 0.0,
            rollout_seed(seed, step, rank) + 1,
            step + 1,
            chunk_tokens,
        )
        t_train = time.perf_counter() - t0 - t_gen - t_score

        scores = ro.scored["scores"]
        seq_kl = sequence_kl(ro, "k1")
        fn_sums: Counter[str] = Counter()
        add_function_sums(fn_sums, function_values(ro))
        g = {
            k: all_reduce_sum(v, device)
            for k, v in (
                *fn_sums.items(),
                ("n", ro.n),
                ("score", float(scores.sum())),
                ("score_sq", float((scores**2).sum())),
                ("kl", float(seq_kl.sum())),
                ("length", float(ro.mask.sum())),
                ("stopped", float(ro.stopped.sum())),
            )
        }
        n = g["n"]
        kl_mean = g["kl"] / n
        ctl.update(kl_mean, int(n))
        # This rank's FLOPs: prefill + one decode step per row and new token (rows that ended
        # still step), role forwards over the rollout, forward+backward per update epoch.
        r_w = ro.width[1]
        w_min, w_max = min_max(r_w, device)
        seq_len = ro.tokens() / ro.n
        gen_flops = 2 * n_mat * (float(ro.prompt_mask.sum()) + ro.n * r_w)
        score_flops = 2 * n_mat * ro.tokens() * len(roles)
        per_tok = train_flops_per_token(
            n_mat, tr.n_trainable, cfg_m.num_hidden_layers, cfg_m.hidden_size, int(seq_len)
        )
        train_flops = per_tok * ro.tokens() * cfg.update_epochs * (2 if algo.critic else 1)
        extra = {
            "score_mean": g["score"] / n,
            **function_metrics(g),
            "score_std": math.sqrt(max(0.0, g["score_sq"] / n - (g["score"] / n) ** 2)),
            "kl": kl_mean,
            "kl_coef": kl_coef,
            "response_len": g["length"] / n,
            "stop_rate": g["stopped"] / n,
            # Generated columns per rank: ranks stop at different lengths (synced generation).
            "gen_width_min": w_min,
            "gen_width_max": w_max,
            "generation_s": t_gen,
            "scoring_s": t_score,
            "training_s": t_train,
            "generation_share": t_gen / (time.perf_counter() - t0),
            **sampling,
            **{k: v for k, v in stats.items() if k not in ("grad_norm", "lr")},
        }
        if returns is not None:
            extra["explained_var"] = explained_variance(
                ro.scored["values"], returns, ro.mask, reduce
            )
        total_loss = stats["policy_loss"] + (
            cfg.vf_coef * stats["value_loss"] if algo.critic else 0.0
        )
        if (step + 1) % cfg.log_every == 0 or step + 1 == n_rollouts:
            tr.record_step(
                step + 1,
                loss=total_loss,
                grad_norm=stats["grad_norm"],
                lr=stats["lr"],
                local_tokens=ro.tokens(),
                seq_len=seq_len,
                t_start=t0,
                t_data=0.0,
                flops=gen_flops + score_flops + train_flops,
                **extra,
            )
        tr.maybe_checkpoint(
            step + 1,
            cfg.checkpoint_every,
            cfg.keep_checkpoints,
            extra={
                "kl_coef": ctl.coef,
                "data": data_position(
                    step + 1, len(data.train), cfg.rollout.prompts_per_step, seed
                ),
            },
        )
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < n_rollouts:
            evaluate(step + 1)

    final = evaluate(n_rollouts)
    assert sft_eval is not None
    save_adapter(model, ctx, selected_adapters=[POLICY])
    if algo.critic:
        save_adapter(model, ctx, name="critic", selected_adapters=[VALUE])
    tr.metrics.write("end", step=n_rollouts, **memory_snapshot(device))
    tr.metrics.close()
    gate = _gate(cfg, final, sft_eval)
    if not gate["passed"]:
        log.error("quality gate: %s", gate["message"])
    if ctx.is_main:
        (ctx.out_dir / "reference.json").write_text(
            json.dumps(
                {
                    "reference": f"{ctx.roles['reference']} adapter",
                    "reference_fingerprint": ctx.role_ref("reference").fingerprint,
                    **(
                        {
                            "reward_model": ctx.roles["reward_model"],
                            "reward_fingerprint": ctx.role_ref("reward_model").fingerprint,
                            "reward_model_weight": cfg.reward_model_weight,
                        }
                        if has_rm
                        else {}
                    ),
                    "reward_functions": [
                        {"label": f.label, "fn": f.fn_ref, "weight": f.weight, "sha256": f.sha256}
                        for f in rewarder.funcs
                    ],
                },
                indent=2,
            )
        )
    return tr.summary(
        ctx,
        algorithm=name,
        kl_placement=placement,
        kl_coef_final=ctl.coef,
        eval_final=final,
        eval_sft=sft_eval,
        gate=gate,
        chat_template_sha256=template_sha,
        **data.stats,
        headline=tr.headline(
            eval_reward=final["reward"],
            sft_reward=sft_eval["reward"],
            reward_gain=final["reward_gain"],
            eval_kl=final["kl"],
        ),
    )
