"""The reward of an online-RL rollout: the recipe's reward functions (verifiers) and/or the
learned reward model, summed with their weights into `ro.scored["scores"]` [N], which every
algorithm's advantage reads (`posttrain.rl.algorithms.shaped_scores`).

Rows carry what the functions need: prompt messages, data columns (`answer`, ...) and the data
location a misbehaving function's error names (`posttrain.data.prompts.PromptData`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.models.roles import REWARD
from posttrain.rewards import counters
from posttrain.rewards.combine import RewardFunction, function_means, score_functions
from posttrain.rl.rollout.sample import Rollout, decode_responses


@dataclass(frozen=True)
class Rewarder:
    funcs: list[RewardFunction]
    rm_weight: float | None  # the reward model's weight; None: the stage has no reward model
    tokenizer: Any
    # Whether some environment class of the stage scores its episodes itself: then every
    # rollout, on every rank, has the `environment` values (NaN where an episode's has none).
    env_rewards: bool = False

    @property
    def roles(self) -> tuple[str, ...]:  # the role forwards the reward needs from `score`
        return (REWARD,) if self.rm_weight is not None else ()

    def __call__(self, ro: Rollout, rows: list[dict[str, Any]]) -> None:
        """Set ro.scored["scores"] [N] (and "rm_scores", the reward model's own; and each
        function's values [N], NaN where it returned None, read back by `function_values`) for
        the N responses of `rows` (after `score` ran with `roles`). Kept in `ro.scored`, they
        follow the rollout through `Rollout.select` and `Rollout.cat`."""
        total = torch.zeros(ro.n, dtype=torch.float32)
        if self.rm_weight is not None:
            ro.scored["rm_scores"] = ro.scored["scores"].float()
            total += self.rm_weight * ro.scored["rm_scores"]
        if self.funcs:
            ids = [
                r[: int(m.sum())].tolist()
                for r, m in zip(ro.response, ro.response_attn, strict=True)
            ]
            prompts, completions = self.conversations(ro, rows)
            counters.take(0)  # drop what calls on other batches left
            t = time.perf_counter()
            fsum, per = score_functions(
                self.funcs,
                prompts,
                completions,
                [r.get("columns", {}) for r in rows],
                ids,
                ro.stopped.tolist(),
                [r.get("where", "") for r in rows],
                environments(ro.episodes),
            )
            total += fsum
            ro.scored |= {FUNCTION + label: v for label, v in per.items()}
            # Seconds inside the functions, spread evenly over the rows so that the rows kept
            # by selection carry their share: summed, the step's (and held-out's) `reward_fn_s`.
            spent = (time.perf_counter() - t) / max(1, ro.n)
            counted = counters.take(ro.n)  # the code verifier's runs, timeouts, ...
            counted[REWARD_FN_S] = [spent] * ro.n
            ro.scored |= {COUNT + k: torch.tensor(v) for k, v in counted.items()}
        if ro.episodes is not None and self.env_rewards:
            env = torch.tensor([episode_reward(e) for e in ro.episodes], dtype=torch.float32)
            ro.scored[FUNCTION + ENVIRONMENT] = env
            total += torch.nan_to_num(env, nan=0.0)
        ro.scored["scores"] = total

    def conversations(self, ro: Rollout, rows: list[dict[str, Any]]) -> tuple[list, list]:
        """(prompts, completions) for the reward functions: prompt messages and response
        texts; for episodes, the prompt as the policy saw it (an environment's reset text
        included) and the episode's messages after it (TRL's multi-turn completions)."""
        if ro.episodes is None:
            return [r["messages"] for r in rows], decode_responses(self.tokenizer, ro)
        return (
            [e.messages[: e.n_prompt] for e in ro.episodes],
            [e.messages[e.n_prompt :] for e in ro.episodes],
        )


# The environment's reward, among the functions' in metrics and samples (`reward_fn_environment`).
ENVIRONMENT = "environment"


def environments(episodes: list[Any] | None) -> list[Any] | None:
    """Each episode's environment instance, in order (TRL's `environments`); None without."""
    if not episodes or episodes[0].env is None:
        return None
    return [e.env.instance for e in episodes]


def episode_reward(e: Any) -> float:
    """An episode's environment reward: its get_reward() (tool environments) plus the rewards
    its step() answered with (gym-like ones); NaN (not applicable) when its class has neither,
    as a reward function's None."""
    if e.env is None or not e.env.env.rewards:
        return math.nan
    got = e.env.reward()
    return (0.0 if got is None else got) + e.step_reward


# ro.scored key prefix of a reward function's values.
FUNCTION = "fn:"
# ro.scored key prefix of a reward function's per-row counters (`posttrain.rewards.counters`).
COUNT = "count:"
# The counter of seconds spent inside the reward functions (every rollout that has functions).
REWARD_FN_S = "reward_fn_s"


def add_counter_sums(sums: Counter[str], ro: Rollout, weight: float = 1.0) -> None:
    """Accumulate the reward functions' counters (`code_runs`, ...) of `ro`: totals per step."""
    for k, v in ro.scored.items():
        if k.startswith(COUNT):
            sums[k] += weight * float(v.sum())


def counter_metrics(totals: dict[str, float]) -> dict[str, float]:
    """{code_runs: total, ...} from reduced `add_counter_sums` totals."""
    return {k.removeprefix(COUNT): v for k, v in totals.items() if k.startswith(COUNT)}


def function_values(ro: Rollout) -> dict[str, torch.Tensor]:
    """{label: values [N]} of each reward function on `ro` (NaN: not applicable)."""
    return {k.removeprefix(FUNCTION): v for k, v in ro.scored.items() if k.startswith(FUNCTION)}


def add_function_sums(
    sums: Counter[str], per: dict[str, torch.Tensor], weight: float = 1.0
) -> None:
    """Accumulate each function's (sum, applicable rows), for means over ranks."""
    for label, (total, n) in function_means(per).items():
        sums[f"reward_fn_{label}"] += weight * total
        sums[f"count_fn_{label}"] += weight * n


def function_metrics(totals: dict[str, float]) -> dict[str, float]:
    """{reward_fn_<label>: mean over applicable rows} from reduced `add_function_sums` totals."""
    prefix = "reward_fn_"
    return {
        k: totals[k] / max(1.0, totals["count_fn_" + k.removeprefix(prefix)])
        for k in totals
        if k.startswith(prefix)
    }
