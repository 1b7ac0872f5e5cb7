"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch

from posttrain.config.schema import OptimConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based) of `total`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(
    opt: torch.optim.Optimizer, total: int, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, cfg))
