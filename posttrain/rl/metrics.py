"""The `train` record of an online-RL step (`posttrain.rl.loop`): the rollout's
statistics over all ranks, the update's, the step's phases in seconds and its FLOPs."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.distributed.runtime import all_reduce_sum, all_reduce_sums, min_max
from posttrain.rl.algorithms.advantages import sequence_kl
from posttrain.rl.rewarder import add_function_sums, function_metrics, function_values
from posttrain.rl.rollout.collect import RolloutBatch
from posttrain.rl.rollout.multiturn import episode_metrics, episode_sums
from posttrain.rl.rollout.sample import Rollout
from posttrain.telemetry.metrics import train_flops_per_token


@dataclass(frozen=True)
class UpdateStats:
    """What the update of one rollout measured, over all ranks."""

    # token-weighted means over every pass: policy_loss, entropy, clip_frac, approx_kl, kl_loss,
    # and with a critic value_loss, value_clip_frac
    means: dict[str, float]
    grad_norm: float  # mean over the optimizer steps, before clipping
    lr: float  # of the last optimizer step
    updates: int  # optimizer steps taken (a step the guard skipped counts)


def rollout_totals(ro: Rollout, device: torch.device) -> dict[str, float]:
    """Sums over all ranks of a scored rollout: each reward function's (reward_fn_<label>,
    count_fn_<label>: `add_function_sums`), then n (sequences), score and score_sq (the summed
    reward and its square), kl (per-response KL k1 to the reference, when it was scored),
    length (response tokens) and stopped (responses that ended with a stop token); for
    episodes, `episode_sums`."""
    scores = ro.scored["scores"]  # [N]
    fn_sums: Counter[str] = Counter()
    add_function_sums(fn_sums, function_values(ro))
    fn_sums.update(episode_sums(ro))
    kl = [("kl", float(sequence_kl(ro, "k1").sum()))] if "ref_logps" in ro.scored else []
    return {
        k: all_reduce_sum(v, device)
        for k, v in (
            *fn_sums.items(),
            ("n", ro.n),
            ("score", float(scores.sum())),
            ("score_sq", float((scores**2).sum())),
            *kl,
            ("length", float(ro.mask.sum())),
            ("stopped", float(ro.stopped.sum())),
        )
    }


def step_flops(
    ro: Rollout,
    n_matmul: int,
    n_trainable: int,
    model_config: Any,
    n_roles: int,
    update_epochs: int,
    critic: bool,
) -> float:
    """This rank's FLOPs for one step: prefill + one decode step per row and new token (rows
    that ended still step), a forward of each of `n_roles` scoring roles over the rollout, and
    forward+backward per update epoch (twice with a critic: the policy's pass and the
    critic's)."""
    seq_len = ro.tokens() / ro.n
    gen_flops = 2 * n_matmul * (float(ro.prompt_mask.sum()) + ro.n * ro.width[1])
    score_flops = 2 * n_matmul * ro.tokens() * n_roles
    per_tok = train_flops_per_token(
        n_matmul,
        n_trainable,
        model_config.num_hidden_layers,
        model_config.hidden_size,
        int(seq_len),
    )
    train_flops = per_tok * ro.tokens() * update_epochs * (2 if critic else 1)
    return gen_flops + score_flops + train_flops


def train_metrics(
    totals: dict[str, float],
    kl_coef: float,
    widths: tuple[float, float],
    rb: RolloutBatch,
    training_s: float,
    step_s: float,
    stats: UpdateStats,
    world: int = 1,
) -> dict[str, float]:
    """The step's own fields of its `train` record (`TrainSession.record_step` adds loss,
    throughput and memory): means of the rollout `totals` (`rollout_totals`), the KL
    coefficient it was trained with, the generated width per rank (min, max over ranks: ranks
    stop at different lengths), the seconds of each phase and the generation's share of the
    step's `step_s` (`world`: ranks, the tools' seconds are summed over them), the sampling
    statistics and the update's means and count; for episodes, `episode_metrics` and the
    tools' share of the step."""
    n = totals["n"]
    return {
        "score_mean": totals["score"] / n,
        **function_metrics(totals),
        "score_std": math.sqrt(max(0.0, totals["score_sq"] / n - (totals["score"] / n) ** 2)),
        **({"kl": totals["kl"] / n} if "kl" in totals else {}),
        "kl_coef": kl_coef,
        "response_len": totals["length"] / n,
        "stop_rate": totals["stopped"] / n,
        "gen_width_min": widths[0],
        "gen_width_max": widths[1],
        "generation_s": rb.generation_s,
        "scoring_s": rb.scoring_s,
        "training_s": training_s,
        # Episodes wait for tools inside generation: the tools' share is told apart.
        "generation_share": (rb.generation_s - totals.get("tool_s", 0.0) / world) / step_s,
        **episode_metrics(totals),
        **({"tool_share": totals["tool_s"] / world / step_s} if "tool_s" in totals else {}),
        "update_share": training_s / step_s,
        **rb.sampling,
        **stats.means,
        "updates": stats.updates,
    }


# What a server engine counts per rollout
# (`posttrain.rl.rollout.server_engine.ServerEngine.take_counts`).
SAMPLER_COUNTS = ("responses", "exact", "retokenized_mismatch", "prompt_mismatch")


def sampler_metrics(ro: Rollout, lag: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Over all ranks: `policy_version`, the oldest version that sampled a row (updates before
    it), `staleness`, the updates the sampler of a row was behind on average, and with a server
    engine the share of `exact` answers (the ids it sampled), of answers whose text does not
    re-tokenise to the ids sampled (`retokenized_mismatch_frac`: measured where the server
    returns ids and text; where it returns text only, the answers whose re-tokenised length
    contradicts the server's own count, a floor on the true share) and of prompts the server
    read as another length than sent (`prompt_mismatch_frac`)."""
    t = all_reduce_sums(
        {"rows": float(ro.n), "lag": lag.double().sum()}
        | {k: ro.stats.get(k, 0.0) for k in SAMPLER_COUNTS},
        device,
    )
    oldest = min_max(float(ro.versions.min()) if ro.versions is not None else -1.0, device)[0]
    out = {"policy_version": oldest, "staleness": t["lag"] / max(1.0, t["rows"])}
    if t["responses"]:
        out |= {
            k: t[c] / t["responses"]
            for k, c in (
                ("exact_frac", "exact"),
                ("retokenized_mismatch_frac", "retokenized_mismatch"),
                ("prompt_mismatch_frac", "prompt_mismatch"),
            )
        }
    return out
