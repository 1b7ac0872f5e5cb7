"""The online-RL step functions' tests on a tiny real model (fixtures_tiny): the role model,
prompt rows, a validated recipe section, reward functions and the `RolloutSetup` they run
with, on one process (world size 1, no process group: the collectives are identities)."""

from __future__ import annotations

from typing import Any

import torch
from fixtures_tiny import TinyAssets, load_base

from posttrain.data.prompts import encode_prompt, quickstart_prompts
from posttrain.kinds.grpo import GRPOConfig
from posttrain.kinds.ppo import PPOConfig
from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.roles import RoleModel, build_roles
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rewards.combine import RewardFunction
from posttrain.rl.rewarder import Rewarder
from posttrain.rl.rollout.collect import RolloutSetup
from posttrain.rl.rollout.engines import build_engine

MAX_PROMPT_LEN = 40


def role_model(tiny: TinyAssets, critic: bool) -> RoleModel:
    """Policy and reference both the trained tiny adapter (so they start equal), no reward
    model; with `critic`, a critic from the policy's adapter with a zero value head."""
    return build_roles(load_base(tiny), tiny.adapter_trained, None, critic=critic)


def prompt_rows(tokenizer: Any, n: int, informative: list[bool] | None = None) -> list[dict]:
    """n prompt rows as `posttrain.data.prompts.prepare_prompts` makes them; the column
    `informative` (default all True) steers `alternating`."""
    flags = informative if informative is not None else [True] * n
    return [
        {
            "messages": r["messages"],
            "ids": encode_prompt(tokenizer, r["messages"], MAX_PROMPT_LEN),
            "columns": {**r["columns"], "informative": flag},
            "where": f"test row {i}",
        }
        for i, (r, flag) in enumerate(zip(quickstart_prompts(n, seed=7), flags, strict=True))
    ]


def section(kind: str, **fields: Any) -> Any:
    """A validated ppo or grpo recipe section (presets applied) with the tiny test's data."""
    data = {"synthetic": {"n_examples": 16}, "max_prompt_len": MAX_PROMPT_LEN}
    config = PPOConfig if kind == "ppo" else GRPOConfig
    return config.model_validate({"data": data, **fields})


def _alternating(completions: list, informative: list[bool], **kwargs: Any) -> list[float]:
    # Rows come in groups of consecutive samples of one prompt: 0, 1, 0, 1... within an
    # informative prompt's group (its samples score differently), 0 for every other sample.
    return [float(i % 2) if flag else 0.0 for i, flag in enumerate(informative)]


def _length(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def reward(name: str) -> RewardFunction:
    """`alternating` (see `_alternating`) or `length`: the response's token count, stop token
    included (the same count as the response mask)."""
    fn = {"alternating": _alternating, "length": _length}[name]
    return RewardFunction(name, f"tests.rl_tiny:_{name}", 1.0, fn, "0" * 64)


def rollout_setup(
    model: RoleModel, tokenizer: Any, cfg: Any, fn: str, batch_size: int = 4
) -> RolloutSetup:
    """The stage's setup with in-process engines for the policy and the reference."""
    engines = {r: build_engine(cfg.rollout, model, r, 1) for r in (POLICY, REFERENCE)}
    return RolloutSetup(
        model,
        tokenizer,
        cfg,
        Rewarder([reward(fn)], None, tokenizer),
        model.value_head is not None,
        model_stop_token_ids(model, tokenizer),
        batch_size,
        0,
        3,
        0,
        1,
        torch.device("cpu"),
        engines=engines,
    )
