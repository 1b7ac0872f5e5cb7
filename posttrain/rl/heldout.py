"""Step 5 of online RL (`posttrain.rl.loop`), at the end and every `eval_every`
rollouts: the held-out prompts answered by the policy and by the starting policy (the
reference), and the quality gate on the final figures.

Per policy: the mean reward of one sample per held-out prompt (functions and/or reward model;
each function's own mean as `reward_fn_<label>`), its spread, length and stop rate and, for the
policy being trained, KL(policy || reference) per response by the recipe's `kl.estimator` (the
one `max_kl` gates), and the totals of the reward functions' counters (`code_runs`,
`code_errors`, ...: `eval_code_runs`). Prompt batch b is sampled with seed + b's first row, so
both policies see the same prompts under the same seeds.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from posttrain.data.sft_data import write_rows
from posttrain.distributed.runtime import all_reduce_sum, rank_batches
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.rl.metrics import add_rollout_sums
from posttrain.rl.rewarder import counter_metrics, function_metrics, function_values
from posttrain.rl.rollout.collect import RolloutSetup, generate, score_rollout
from posttrain.rl.rollout.multiturn import episode_metrics, episode_record
from posttrain.rl.rollout.sample import Rollout, decode_responses
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import MetricsWriter

log = logging.getLogger("posttrain.rl")


# Called with each held-out batch of the policy's answers (scored and rewarded) and its weight
# (0 for a filler batch), e.g. to score them by another model without sampling them again.
EachBatch = Callable[[Rollout, float], None]


def evaluate(
    s: RolloutSetup,
    rows: list[dict[str, Any]],
    step: int,
    sft: dict[str, float] | None,
    metrics: MetricsWriter,
    samples_path: Path | None,
    each: EachBatch | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """-> (the policy's figures with its reward_gain, the starting policy's). The starting
    policy (the reference) is evaluated on the first call only (`sft` None); later calls pass
    its figures back. `each`: given every batch of the policy's answers."""
    if sft is None:
        sft, _ = heldout(s, rows, REFERENCE)
        metrics.write("eval", step=step, **{f"sft_{k}": v for k, v in sft.items()})
    pol, examples = heldout(s, rows, POLICY, each)
    pol["reward_gain"] = pol["reward"] - sft["reward"]
    metrics.write("eval", step=step, **{f"eval_{k}": v for k, v in pol.items()})
    log.info(
        "held-out reward %.4f (starting policy %.4f, gain %+.4f), KL (%s) to the reference %.3f",
        pol["reward"],
        sft["reward"],
        pol["reward_gain"],
        s.cfg.kl.estimator,
        pol["kl"],
    )
    if samples_path is not None:
        write_rows(samples_path, examples)
    return pol, sft


def heldout_batches(
    s: RolloutSetup, rows: list[dict[str, Any]]
) -> Iterator[tuple[list[dict[str, Any]], float, int]]:
    """This rank's held-out batches of `rows`: (prompt rows, weight, sampling seed). Every rank
    gets as many: a rank out of prompts gets a filler batch of weight 0 (each forward of a
    sharded model is a collective)."""
    for idx in rank_batches(len(rows), s.rank, s.world, s.batch_size):
        heartbeat.beat(phase="eval")
        yield [rows[i] for i in idx] or rows[:1], 1.0 if idx else 0.0, s.seed + (idx or [0])[0]


@torch.no_grad()
def heldout(
    s: RolloutSetup, rows: list[dict[str, Any]], role: str, each: EachBatch | None = None
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """One sample per held-out prompt from `role` -> (means over all ranks, this rank's
    examples); the policy's KL to the reference by the recipe's `kl.estimator`."""
    roles = ((POLICY, REFERENCE) if role == POLICY else ()) + s.rewarder.roles
    kl = s.cfg.kl.estimator if role == POLICY else None
    sums: Counter[str] = Counter()
    examples = []
    for chunk, w, seed in heldout_batches(s, rows):
        ro = generate(s, chunk, seed, role)
        score_rollout(s, ro, chunk, roles)
        if each is not None:
            each(ro, w)
        # A sequence-parallel group's ranks sample the same: its first counts them.
        add_rollout_sums(sums, ro, kl=kl, weight=w * s.counted)
        if w and s.counted:
            examples += heldout_examples(s.tokenizer, chunk, ro)
    return heldout_means(sums, s.device, kl=kl is not None), examples


def heldout_means(sums: Counter[str], device: torch.device, kl: bool) -> dict[str, float]:
    """Means over all ranks of `add_rollout_sums`' sums."""
    t = {k: all_reduce_sum(v, device) for k, v in sums.items()}
    n = max(1.0, t.pop("n"))
    out = {
        "reward": t["score"] / n,
        "reward_std": math.sqrt(max(0.0, t["score_sq"] / n - (t["score"] / n) ** 2)),
        "response_len": t["length"] / n,
        "stop_rate": t["stopped"] / n,
        "prompts": n,
    }
    if kl:
        out["kl"] = t["kl"] / n
    out |= function_metrics(t)
    out |= counter_metrics(t)  # code_runs, reward_fn_s, ...: totals over the held-out prompts
    out |= episode_metrics(t)
    return out


def heldout_examples(tokenizer: Any, rows: list[dict[str, Any]], ro: Rollout) -> list[dict]:
    """One eval_samples.jsonl row per response (a function's value None: not applicable)."""
    per = function_values(ro)
    if ro.episodes is not None:  # an episode's record holds its prompt and answer
        answers = [episode_record(e) for e in ro.episodes]
    else:
        answers = [{"response": t} for t in decode_responses(tokenizer, ro)]
    return [
        {
            "prompt": r["messages"],
            **a,
            "reward": float(v),
            **{f"reward_{k}": None if torch.isnan(p[i]) else float(p[i]) for k, p in per.items()},
            **r.get("columns", {}),
        }
        for i, (r, a, v) in enumerate(zip(rows, answers, ro.scored["scores"].tolist(), strict=True))
    ]


def quality_gate(cfg: Any, final: dict[str, float], sft: dict[str, float]) -> dict[str, Any]:
    """{"passed": bool, "message" when not}: `max_kl` (on the held-out KL by the recipe's
    `kl.estimator`) and `min_reward_gain` (off when null)."""
    problems = []
    gain = final["reward"] - sft["reward"]
    if cfg.max_kl is not None and final["kl"] > cfg.max_kl:
        problems.append(
            f"held-out KL ({cfg.kl.estimator}) {final['kl']:.3f} exceeds max_kl {cfg.max_kl}"
        )
    if cfg.min_reward_gain is not None and gain < cfg.min_reward_gain:
        problems.append(
            f"held-out reward gain {gain:.4f} over the starting policy is below min_reward_gain "
            f"{cfg.min_reward_gain}"
        )
    return {"passed": not problems, **({"message": "; ".join(problems)} if problems else {})}
