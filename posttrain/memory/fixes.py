"""The fixes a refused memory pre-flight suggests, each with its own estimated peak.

Each kind of change (activation checkpointing, a smaller micro-batch, the chunked LM head, for
RL smaller generate calls and no keep_gathered, more shards, more sequence-parallel ranks) is a
`Change`: the recipe edit it names and the stage and layout it would give. A change becomes a `Fix` when its estimate is
below the stage's; when no single fix fits, the stage's own changes are tried all together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from posttrain.memory.estimate import (
    DeviceLayout,
    ModelShape,
    StageShape,
    estimate,
    fmt_bytes,
)
from posttrain.sections.infra import InfraConfig

# Unchunked logits at least this share of the estimated peak: suggest the chunked head.
LARGE_LOGITS = 0.1
# infra.logits_chunk_tokens' recipe default, the value the fix suggests.
DEFAULT_CHUNK_TOKENS: int = InfraConfig.model_fields["logits_chunk_tokens"].default


@dataclass(frozen=True)
class Fix:
    change: str
    total: int
    fits: bool


@dataclass(frozen=True)
class Change:
    """A candidate fix: the recipe edit it names (`text`), the stage and the layout it gives
    (None: the stage's own layout), and the stage fields it sets in "all of the above" (the
    most saving value of each: micro-batch 1, one rollout row; none for a layout change)."""

    text: str
    shape: StageShape
    layout: DeviceLayout | None = None
    combined: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Estimator:
    """`estimate` of variants of one stage on one model, with the runtime's bytes fixed."""

    model: ModelShape
    overhead: int | None

    def peak(self, shape: StageShape, layout: DeviceLayout) -> int:
        return estimate(self.model, shape, layout, self.overhead).total

    def logits(self, shape: StageShape, layout: DeviceLayout) -> int:
        return estimate(self.model, shape, layout, self.overhead).component("logits")

    def activations(self, shape: StageShape, layout: DeviceLayout) -> int:
        return estimate(self.model, shape, layout, self.overhead).component("activations")


def suggest_fixes(
    model: ModelShape,
    shape: StageShape,
    layout: DeviceLayout,
    budget: int,
    overhead: int | None,
    stage: str,
    accum: int = 1,
) -> list[Fix]:
    """Changes that lower the estimate, each with its own estimated peak: activation
    checkpointing, a smaller micro-batch (same global batch), the chunked LM head when full
    logits are large, more shards, more sequence-parallel ranks, and for RL smaller generate calls, no keep_gathered and no
    `fast` engine copy; then
    all of them together when none fits alone."""
    est = Estimator(model, overhead)
    now = est.peak(shape, layout)
    changes = [
        *checkpointing_change(shape, stage),
        *micro_batch_change(est, shape, layout, budget, stage, accum),
        *chunked_head_change(est, shape, layout, now),
        *rollout_changes(shape, stage),
        *layout_changes(est, shape, layout, budget),
        *sequence_parallel_change(est, shape, layout, budget, accum),
    ]
    fixes = fixes_of(est, changes, layout, budget, now)
    # Every change to the stage itself at once (layout changes set no stage field).
    best = replace(shape, **{k: v for c in changes for k, v in c.combined.items()})
    if best != shape and not any(f.fits for f in fixes):
        together = Change("all of the above changes to this stage together", best)
        fixes += fixes_of(est, [together], layout, budget, now)
    return fixes


def fixes_of(
    est: Estimator, changes: list[Change], layout: DeviceLayout, budget: int, now: int
) -> list[Fix]:
    """The changes that lower the peak `now`, as fixes: their estimate and whether it fits."""
    fixes = []
    for change in changes:
        total = est.peak(change.shape, layout if change.layout is None else change.layout)
        if total < now:  # a change that does not lower the peak (another phase's row) is no fix
            fixes.append(Fix(change.text, total, total <= budget))
    return fixes


def _edit(text: str, shape: StageShape, fields: dict[str, Any], combined: Any = None) -> Change:
    """A change of stage `fields`; "all of the above" sets `combined` (default: `fields`)."""
    return Change(text, replace(shape, **fields), None, fields if combined is None else combined)


def _fsdp(layout: DeviceLayout, world: int) -> DeviceLayout:
    # The sequence-parallel size stays where it still divides the new world.
    n = layout.sequence_parallel if world % layout.sequence_parallel == 0 else 1
    return DeviceLayout(world, "fsdp", layout.devices_per_node, layout.device, n)


def _sp(layout: DeviceLayout, n: int) -> DeviceLayout:
    return DeviceLayout(layout.world, "fsdp", layout.devices_per_node, layout.device, n)


def checkpointing_change(shape: StageShape, stage: str) -> list[Change]:
    """Activation checkpointing, when it is off."""
    if shape.activation_checkpointing:
        return []
    return [
        _edit(f"{stage}.activation_checkpointing: true", shape, {"activation_checkpointing": True})
    ]


def micro_batch_change(
    est: Estimator,
    shape: StageShape,
    layout: DeviceLayout,
    budget: int,
    stage: str,
    accum: int,
) -> list[Change]:
    """The largest smaller micro-batch that fits (else the smallest), with the accumulation
    that keeps the global batch."""
    # Divisors of micro keep micro x accum, so the global batch (and the RL update size) stays.
    divisors = [m for m in range(shape.micro_batch - 1, 0, -1) if shape.micro_batch % m == 0]
    if not divisors:
        return []
    pick = next(
        (m for m in divisors if est.peak(replace(shape, micro_batch=m), layout) <= budget),
        divisors[-1],
    )
    new_accum = accum * shape.micro_batch // pick
    text = (
        f"{stage}.batch.micro_batch_size: {pick} with grad_accum_steps: {new_accum} "
        "(same global batch)"
    )
    return [_edit(text, shape, {"micro_batch": pick}, {"micro_batch": 1})]


def chunked_head_change(
    est: Estimator, shape: StageShape, layout: DeviceLayout, now: int
) -> list[Change]:
    """The chunked LM head, when the full logits are a large share of the peak `now`."""
    if shape.logits_chunk_tokens:
        return []
    # Full logits ([seqs, positions, vocab] fp32, several copies) on a large vocabulary: the
    # chunked head keeps only [chunk, vocab] buffers (infra.logits_chunk_tokens, recipe default).
    logits_now = est.logits(shape, layout)
    if logits_now < LARGE_LOGITS * now:
        return []
    chunked = _edit("", shape, {"logits_chunk_tokens": DEFAULT_CHUNK_TOKENS})
    logits_then = est.logits(chunked.shape, layout)
    text = (
        f"infra.logits_chunk_tokens: {DEFAULT_CHUNK_TOKENS} (logits {fmt_bytes(logits_now)}"
        f" -> {fmt_bytes(logits_then)})"
    )
    return [replace(chunked, text=text)]


def rollout_changes(shape: StageShape, stage: str) -> list[Change]:
    """RL only: a quarter of the rows per `generate` call, no keep_gathered, and no `fast`
    engine copy."""
    if shape.kind != "rl":
        return []
    changes = []
    if shape.rollout_rows > 1:
        rows = max(1, shape.rollout_rows // 4)
        text = f"{stage}.rollout.generation_batch_size: {rows}"
        changes.append(_edit(text, shape, {"rollout_rows": rows}, {"rollout_rows": 1}))
    if shape.keep_gathered:
        off = {"keep_gathered": False}
        changes.append(_edit(f"{stage}.rollout.keep_gathered: false", shape, off))
    if shape.sampler_copy:
        # The fast engine's copy is whole on every rank: a server holds it elsewhere.
        text = f"{stage}.rollout.engine: server (or hf): no whole copy of the policy on every rank"
        changes.append(_edit(text, shape, {"sampler_copy": False}))
    return changes


def layout_changes(
    est: Estimator, shape: StageShape, layout: DeviceLayout, budget: int
) -> list[Change]:
    """Sharding over all ranks (from hsdp or ddp), and the smallest world size that fits."""
    changes = []
    if layout.layout != "fsdp" and layout.world > 1:
        text = f"infra.layout: fsdp (shard over all {layout.world} ranks)"
        changes.append(Change(text, shape, _fsdp(layout, layout.world)))
    need = smallest_fitting_world(est, shape, layout, budget)
    if need is not None:
        text = f"shard over {need} devices (infra.layout: fsdp, nnodes x devices_per_node = {need})"
        changes.append(Change(text, shape, _fsdp(layout, need)))
    return changes


def smallest_fitting_world(
    est: Estimator, shape: StageShape, layout: DeviceLayout, budget: int
) -> int | None:
    """The smallest power-of-two world above today's shards whose fsdp estimate fits, up to
    1024 devices. Shards only shrink the static parameter/gradient/optimizer rows."""
    worlds = (2**k for k in range(11))
    fits = (w for w in worlds if w > layout.shards and est.peak(shape, _fsdp(layout, w)) <= budget)
    return next(fits, None)


def sequence_parallel_change(
    est: Estimator, shape: StageShape, layout: DeviceLayout, budget: int, accum: int
) -> list[Change]:
    """The smallest `infra.sequence_parallel` above today's that divides the devices and the
    model's heads and fits (else the largest such, when it lowers the peak), with the
    accumulation that keeps the global batch (each step has world / N data-parallel ranks)."""
    now = layout.sequence_parallel
    if layout.layout != "fsdp" or layout.world <= now:
        return []
    sizes = [
        n
        for n in range(now + 1, layout.world + 1)
        if layout.world % n == 0 and est.model.sequence_split_problem(n) is None
    ]
    if not sizes:
        return []
    pick = next((n for n in sizes if est.peak(shape, _sp(layout, n)) <= budget), sizes[-1])
    before = est.activations(shape, layout)
    after = est.activations(shape, _sp(layout, pick))
    notes = [
        f"activations {fmt_bytes(before)} -> {fmt_bytes(after)} per rank",
        f"{(dp := layout.world // pick)} data-parallel rank{'s' if dp > 1 else ''}",
    ]
    # The global batch is micro x accum x world / N: accum grows by N'/N to keep it.
    new_accum, rem = divmod(accum * pick, now)
    if not rem:
        notes.append(f"grad_accum_steps: {new_accum} keeps the global batch")
    text = f"infra.sequence_parallel: {pick} ({'; '.join(notes)})"
    return [Change(text, shape, _sp(layout, pick))]
