"""`build_engine`: the in-process rollout engine a recipe's `rollout.engine` names (`hf`:
`posttrain.rl.rollout.engine.HFEngine`; `fast`: `posttrain.rl.rollout.fast_engine.FastEngine`,
which builds on the former, hence a module of its own)."""

from __future__ import annotations

import torch

from posttrain.rl.rollout.engine import HFEngine, RolloutEngine
from posttrain.rl.rollout.fast_engine import FastEngine
from posttrain.sections.shared import RolloutConfig


def build_engine(
    cfg: RolloutConfig, model: torch.nn.Module, role: str, world: int, chunk_tokens: int = 0
) -> RolloutEngine:
    """The in-process engine a recipe's `rollout.engine` names, set up from its rollout
    section (a server's engine comes with its server: `posttrain.rl.setup.rollout_engines`).
    `chunk_tokens`: the trainer's chunked head (`infra.logits_chunk_tokens`), which the `fast`
    engine's probe scores through as the trainer does."""
    if cfg.engine == "server":
        raise ValueError(
            "rollout.engine: server engines are built around the stage's rollout server "
            "(posttrain.rl.setup.rollout_engines)"
        )
    if cfg.engine == "fast":
        return FastEngine(
            model,
            role,
            batch_size=cfg.generation_batch_size,
            keep_turns=cfg.episode_cache,
            compile=cfg.compile_decode,
            tolerance=cfg.sampler_probe_tolerance,
            chunk_tokens=chunk_tokens,
        )
    if cfg.engine != "hf":
        raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}; known: ['fast', 'hf']")
    return HFEngine(
        model,
        role,
        world,
        batch_size=cfg.generation_batch_size,
        keep_gathered=cfg.keep_gathered,
        drop_finished=cfg.drop_finished,
        keep_turns=cfg.episode_cache,
    )
