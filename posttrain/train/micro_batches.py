"""How a training stage lays out one step's rows: which rows share a forward, and whether a
forward's rows are padded or laid end to end (`posttrain.data.segments`).

Both are execution choices: the rows of a step (`TrainSession.step_rows`) and the stages'
token- or pair-normalised losses do not depend on them, so they are left out of fingerprints
and a run may resume with other settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from posttrain.data.batching import regroup_by_tokens
from posttrain.models.varlen_attention import padding_free_unsupported
from posttrain.sections.shared import BatchConfig, RolloutBatchConfig

log = logging.getLogger("posttrain.train")


def padding_free(cfg: BatchConfig | RolloutBatchConfig, model: torch.nn.Module) -> bool:
    """Whether this stage's micro-batches go padding-free: asked for, and the model can."""
    if not cfg.padding_free:
        return False
    reason = padding_free_unsupported(model)
    if reason:
        log.info("padding-free batches off: %s; rows are padded", reason)
        return False
    return True


def regroup_step(
    idx: list[list[int]], length: Callable[[int], int], budget: int | None, device: torch.device
) -> list[list[int]]:
    """This rank's micro-batches of one step, from its rows `idx` ([accum][micro], as
    `TrainSession.step_rows` gives them): unchanged, or with a token `budget` (the stage's
    `batch.by_tokens`, `StageContext.by_tokens`) regrouped into as many forwards as it needs
    (`regroup_by_tokens`); every rank then runs the largest count among ranks. `length(i)`: the
    tokens row i costs."""
    if not budget:
        return idx
    rows = [i for ix in idx for i in ix]
    groups = regroup_by_tokens(rows, length, budget)
    if dist.is_initialized() and dist.get_world_size() > 1:
        n = torch.tensor([len(groups)], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        groups = regroup_by_tokens(rows, length, budget, at_least=int(n.item()))
    return groups
