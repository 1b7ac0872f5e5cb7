"""`batch.by_tokens: auto`: the largest token budget per forward that the memory pre-flight says
fits on the device, resolved at stage start.

The estimate (posttrain.memory.estimate) sizes a forward in rows of `seq_len` tokens; a forward
of at most B tokens holds at most ceil(B / row tokens) such rows' worth of activations and
logits (a pair counts both replies, as `regroup_by_tokens` does), so the budget's estimate is
the stage's with that many rows per micro-batch. The largest multiple of `ROUND` whose estimate
stays within the pre-flight's share of the capacity is the budget, never more than all of a
rank's rows of one step (a larger one changes nothing).

On CPU `auto` keeps the rows' own micro-batches (`micro_batch_size` rows per forward) and says
so: the CPU capacity is the host's free RAM shared with everything else on it, a larger forward
buys no speed there (the step is bound by the host, not by kernel launches), and a budget sized
to gigabytes of RAM would make a CPU step many times slower and larger than the user asked.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

from posttrain.memory.estimate import (
    GIB,
    DeviceLayout,
    ModelShape,
    StageShape,
    estimate,
    fmt_bytes,
)

log = logging.getLogger("posttrain.memory")

# Budgets are multiples of this (kernel-friendly sizes; the search steps by it).
ROUND = 256


@dataclass(frozen=True)
class TokenBudget:
    """What a stage's forwards are sized by: `tokens` per forward (None: the rows' own
    micro-batches), what the recipe asked (an int, "auto" or None), the pre-flight's estimate
    at that budget (auto only) and why, for the log and the records."""

    tokens: int | None
    asked: int | str | None
    estimate_bytes: int | None = None
    why: str = ""

    def record(self) -> dict[str, Any]:
        """Fields of the `start` record and of the summary's memory (beside the measured peak)."""
        out: dict[str, Any] = {"by_tokens": self.tokens, "by_tokens_asked": self.asked}
        if self.estimate_bytes is not None:
            out["by_tokens_estimate_gib"] = round(self.estimate_bytes / GIB, 4)
        return out


def row_tokens(shape: StageShape) -> int:
    """Tokens one row of the stage's batch costs at most: a pair's two sequences for the pair
    and score families (as `regroup_by_tokens` counts them), else one sequence."""
    return shape.seq_len * (shape.sequences // max(1, shape.micro_batch))


def shape_at(shape: StageShape, budget: int) -> StageShape:
    """The stage with forwards of at most `budget` tokens: ceil(budget / row tokens) rows."""
    return replace(shape, micro_batch=max(1, math.ceil(budget / row_tokens(shape))))


def largest_budget(
    model: ModelShape,
    shape: StageShape,
    layout: DeviceLayout,
    limit_bytes: int,
    step_rows: int,
    runtime_bytes: int | None = None,
) -> tuple[int, int] | None:
    """(the largest multiple of ROUND whose estimated peak is at most `limit_bytes`, that
    estimate), capped at `step_rows` rows of the stage's batch (all a rank's rows of one step);
    None when not even ROUND tokens fit. The estimate grows with the budget, so a bisection
    finds it."""

    def peak(budget: int) -> int:
        return estimate(model, shape_at(shape, budget), layout, runtime_bytes).total

    top = max(1, math.ceil(step_rows * row_tokens(shape) / ROUND))
    if peak(ROUND) > limit_bytes:
        return None
    lo, hi = 1, top  # peak(lo * ROUND) fits; find the largest k <= top that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if peak(mid * ROUND) <= limit_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo * ROUND, peak(lo * ROUND)


def resolve_token_budget(asked: int | str | None, report: Any, step_rows: int) -> TokenBudget:
    """The budget of a stage whose recipe asks `asked`: an int or None as given; "auto" from
    the pre-flight `report` (a PreflightReport carrying the shapes it estimated, or None when
    the pre-flight is off or skipped), `step_rows` rows of a step on one rank."""
    if asked != "auto":
        return TokenBudget(asked if isinstance(asked, int) else None, asked)
    if report is None:
        why = "no memory pre-flight (infra.memory_preflight: off, or a model it cannot estimate)"
        return TokenBudget(None, asked, why=f"{why}: the rows' own micro-batches")
    if report.layout.device != "cuda":
        why = "on CPU auto keeps the rows' own micro-batches (micro_batch_size rows a forward)"
        return TokenBudget(None, asked, why=why)
    found = largest_budget(
        report.model, report.shape, report.layout, report.budget, step_rows, None
    )
    if found is None:
        why = f"not even {ROUND} tokens a forward fit in {fmt_bytes(report.budget)}"
        return TokenBudget(None, asked, why=f"{why}: the rows' own micro-batches")
    tokens, est = found
    why = (
        f"the largest that fits: estimated peak {fmt_bytes(est)} within "
        f"{report.fraction:.0%} of {fmt_bytes(report.capacity.bytes)}"
    )
    return TokenBudget(tokens, asked, est, why)


def sized_report(report: Any, budget: TokenBudget) -> Any:
    """The pre-flight `report` of a stage whose `auto` budget was found, re-estimated at that
    budget (both checkpointing settings): what its forwards hold, so the verdict, the records
    and the summary's estimate beside the measured peak are the budget's, not micro_batch_size
    rows'. Any other report unchanged."""
    if report is None or budget.asked != "auto" or budget.tokens is None:
        return report
    at = shape_at(report.shape, budget.tokens)
    flipped = replace(at, activation_checkpointing=not at.activation_checkpointing)
    runtime = report.capacity.runtime_bytes
    return replace(
        report,
        estimate=estimate(report.model, at, report.layout, runtime),
        alternative=estimate(report.model, flipped, report.layout, runtime),
        shape=at,
        fixes=[],
    )


def say(budget: TokenBudget) -> None:
    """One log line of what the stage's forwards are sized by."""
    if budget.asked != "auto":
        return
    if budget.tokens is None:
        log.info("batch.by_tokens auto: %s", budget.why)
    else:
        log.info("batch.by_tokens auto = %d tokens a forward: %s", budget.tokens, budget.why)
