"""Spawned gloo rank for tests/test_sp_group_rollout.py: 2 ranks of one sequence-parallel group
sample the same prompts with DIFFERENT seeds (rank r: seed 100 + r, as nondeterministic kernels
could make them draw differently), through the in-process engine of the tiny role model, with
and without the group (`sample(..., sp)`); then reward the group's rollout with a function that
counts its calls (`collect.reward`); and sample through the `fast` engine, whose draws it
counts. Writes what the test compares to <out>/rank<r>.json."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fixtures_tiny import TinyAssets
from rl_tiny import prompt_rows, role_model, rollout_setup, section

from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.adapters import POLICY
from posttrain.rewards.combine import RewardFunction
from posttrain.rl.rewarder import Rewarder
from posttrain.rl.rollout.collect import generate, score_rollout
from posttrain.rl.rollout.fast_engine import FastEngine

CALLS: list[int] = []  # rows per call of `counted_length` on this rank


def counted_length(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    CALLS.append(len(completion_ids))
    return [float(len(ids)) for ids in completion_ids]


def worker(rank: int, world: int, init: str, tiny: TinyAssets, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sp = SequenceParallel.of()
    model = role_model(tiny, critic=False)
    cfg = section("ppo", rollout={"prompts_per_step": 4, "max_new_tokens": 12})
    s = rollout_setup(model, tiny.tokenizer, cfg, "length")
    fn = RewardFunction("counted", "tests.sp_group_worker:counted_length", 1.0, counted_length, "")
    s = replace(s, rewarder=Rewarder([fn], None, tiny.tokenizer))
    rows = prompt_rows(tiny.tokenizer, 4)
    alone = generate(s, rows, 100 + rank)  # each rank its own draw
    grouped = replace(s, sp=sp, counted=float(rank == 0))
    ro = generate(grouped, rows, 100 + rank)
    score_rollout(grouped, ro, rows, ())
    # The `fast` engine's merged copy samples without a collective: the first rank alone draws.
    fast = FastEngine(model, POLICY)  # its refresh and probe: collectives, on both ranks
    draws: list[int] = []
    own_generate = fast.generate

    def counted_generate(*args: Any, **kwargs: Any) -> torch.Tensor:
        draws.append(1)
        return own_generate(*args, **kwargs)

    fast.generate = counted_generate  # type: ignore[method-assign]
    by_fast = generate(replace(grouped, engines={POLICY: fast}), rows, 100 + rank)
    record = {
        "fast": by_fast.response.tolist(),
        "fast_draws": len(draws),
        "alone": alone.response.tolist(),
        "grouped": ro.response.tolist(),
        "stopped": ro.stopped.tolist(),
        "scores": ro.scored["scores"].tolist(),
        "lengths": ro.mask.sum(1).tolist(),
        "keys": sorted(ro.scored),
        "calls": CALLS,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
