"""Batch arithmetic: global_batch = micro_batch x grad_accum x data_parallel_size, checked, never guessed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ResolvedBatch:
    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    dp_size: int


def resolve_batch(
    micro: int | None, accum: int | None, global_: int | None, dp_size: int, where: str = "batch"
) -> ResolvedBatch:
    """Derive the missing one of (micro, accum, global) or check that all three agree.

    Raises ValueError naming `where` and the numbers that disagree.
    """
    if dp_size < 1:
        raise ValueError(f"{where}: data-parallel size must be >= 1, got {dp_size}")
    given = sum(v is not None for v in (micro, accum, global_))
    if given < 2:
        raise ValueError(
            f"{where}: give at least two of micro_batch_size, grad_accum_steps, global_batch_size "
            f"(got micro_batch_size={micro}, grad_accum_steps={accum}, global_batch_size={global_})"
        )
    if global_ is None:
        assert micro is not None and accum is not None
        global_ = micro * accum * dp_size
    elif micro is None:
        assert accum is not None
        micro, rem = divmod(global_, accum * dp_size)
        if rem or micro == 0:
            raise ValueError(
                f"{where}: global_batch_size {global_} is not divisible by grad_accum_steps {accum} "
                f"x data-parallel size {dp_size} = {accum * dp_size}"
            )
    elif accum is None:
        accum, rem = divmod(global_, micro * dp_size)
        if rem or accum == 0:
            raise ValueError(
                f"{where}: global_batch_size {global_} is not divisible by micro_batch_size {micro} "
                f"x data-parallel size {dp_size} = {micro * dp_size}"
            )
    elif micro * accum * dp_size != global_:
        raise ValueError(
            f"{where}: micro_batch_size {micro} x grad_accum_steps {accum} x data-parallel size "
            f"{dp_size} = {micro * accum * dp_size}, but global_batch_size is {global_}"
        )
    return ResolvedBatch(micro, accum, global_, dp_size)


def stage_batch(stage: Any, dp_size: int) -> ResolvedBatch:
    """The batch triple of graph stage `stage` (a GraphStage) at data-parallel size `dp_size`."""
    b = stage.section.batch
    where = f"{stage.where}.batch"
    return resolve_batch(
        b.micro_batch_size, b.grad_accum_steps, b.global_batch_size, dp_size, where
    )
