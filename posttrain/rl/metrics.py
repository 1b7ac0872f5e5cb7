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
from posttrain.rl.rewarder import (
    add_counter_sums,
    add_function_sums,
    counter_metrics,
    function_metrics,
    function_values,
)
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


def add_rollout_sums(sums: Counter[str], ro: Rollout, kl: str | None, weight: float = 1.0) -> None:
    """Add a scored rollout's sums (x `weight`: 0 for a filler batch) to `sums`: each reward
    function's (`add_function_sums`), the episodes' (`episode_sums`), n (sequences), score and
    score_sq (the summed reward and its square), with `kl` (the recipe's `kl.estimator`, None:
    no KL) the per-response KL to the reference by that estimator, length (response tokens)
    and stopped (responses that ended with a stop token)."""
    add_function_sums(sums, function_values(ro), weight)
    add_counter_sums(sums, ro, weight)
    for k, v in episode_sums(ro).items():
        sums[k] += weight * v
    scores = ro.scored["scores"]  # [N]
    sums["n"] += weight * ro.n
    sums["score"] += weight * float(scores.sum())
    sums["score_sq"] += weight * float((scores**2).sum())
    if kl is not None:
        # The recipe's estimator, the one its penalty, `max_kl` and `kl.target` are stated in:
        # k1's sum can be negative on a sample, k3's never is.
        sums["kl"] += weight * float(sequence_kl(ro, kl).sum())
    sums["length"] += weight * float(ro.mask.sum())
    sums["stopped"] += weight * float(ro.stopped.sum())


def rollout_totals(
    ro: Rollout, device: torch.device, estimator: str, counted: float = 1.0
) -> dict[str, float]:
    """`add_rollout_sums` of a scored rollout over all ranks (kl by `estimator`, the recipe's
    `kl.estimator`, when the reference scored it); `counted`: this rank's weight (0 on a
    sequence-parallel rank after its group's first: the same rows, counted once)."""
    sums: Counter[str] = Counter()
    kl = estimator if "ref_logps" in ro.scored else None
    add_rollout_sums(sums, ro, kl=kl, weight=counted)
    return {k: all_reduce_sum(v, device) for k, v in sums.items()}


def step_flops(ro: Rollout, tr: Any, n_roles: int, update_epochs: int, critic: bool) -> float:
    """This rank's FLOPs for one step of session `tr`: prefill + one decode step per row and new
    token (rows that ended still step), `n_roles` scoring forwards, forward+backward per update
    epoch (twice with a critic)."""
    gen_flops = 2 * tr.n_matmul * (float(ro.prompt_mask.sum()) + ro.n * ro.width[1])
    score_flops = 2 * tr.n_matmul * ro.tokens() * n_roles
    train_flops = token_train_flops(tr, ro) * ro.tokens() * update_epochs * (2 if critic else 1)
    return gen_flops + score_flops + train_flops


def token_train_flops(tr: Any, ro: Rollout) -> float:
    """Forward+backward FLOPs per token of `tr`'s model at the rollout's mean row length."""
    cfg = tr.model.config
    return train_flops_per_token(
        tr.n_matmul, tr.n_trainable, cfg.num_hidden_layers, cfg.hidden_size, int(ro.tokens() / ro.n)
    )


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
    throughput and memory). `widths`: the generated width (min, max over ranks); `world`: ranks,
    over which the tools' seconds are summed."""
    n = totals["n"]
    return {
        "score_mean": totals["score"] / n,
        **function_metrics(totals),
        **counter_metrics(totals),
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


def sampler_metrics(
    ro: Rollout, lag: torch.Tensor, device: torch.device, counted: float = 1.0
) -> dict[str, float]:
    """Over all ranks: `policy_version` (the oldest that sampled a row), `staleness` (updates a
    row's sampler was behind, on average) and with a server engine the shares of its counts
    (`retokenized_mismatch_frac`: where the server returns text only, the answers whose
    re-tokenised length contradicts its own count, a floor on the true share). `counted`: as
    `rollout_totals`'."""
    t = all_reduce_sums(
        {"rows": counted * ro.n, "lag": counted * lag.double().sum()}
        | {k: counted * ro.stats.get(k, 0.0) for k in SAMPLER_COUNTS},
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
