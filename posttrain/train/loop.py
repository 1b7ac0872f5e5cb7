"""The loop skeleton of the offline training stages (sft, reward, dpo, orpo, kto).

They all train the same way around a step of their own: record the rows they train on and hold
out, plan their optimizer steps, open a `TrainSession` (sharding, optimizer, resume, metrics),
take held-out figures at step 0, then step by step draw this rank's rows (a pure function of
seed and step) and lay them out into micro-batches, backpropagate the stage's loss micro-batch by
micro-batch, take the optimizer step under the guard, write the metrics record, evaluate every
`eval_every` steps and checkpoint; last, take the final held-out figures, save the adapter and
close the metrics. This module is that skeleton, as building blocks a stage calls in order:

    batch, total_steps = plan_steps(ctx, data, len(rows))
    loop = open_training(ctx, model, weights, batch, total_steps, data, draw, heldout, ...)
    first = loop.heldout_at_start()
    for step in loop.steps():
        sb = loop.step_batch(step)
        ...  # the stage's step: forward, loss and backward of each micro-batch in sb.micro
        loop.finish_step(step, sb, loss=step_loss, **step_metrics)
    final = loop.heldout_at_end()
    loop.close()
    return loop.tr.summary(ctx, ..., headline=...)

What stays the stage's own: its data, the model it trains (which adapters), what one step
computes (its loss per micro-batch and how it is normalised), its held-out metrics, its summary
and headline. The loop over steps stays in the stage too, so it can be read top to bottom there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from posttrain.config.batch import ResolvedBatch
from posttrain.config.loader import section_batch
from posttrain.data.segments import batch_rows, layout_stats
from posttrain.data.sft_data import write_splits
from posttrain.distributed.runtime import all_reduce_on_device, rank_batches
from posttrain.distributed.sequence_parallel import SequenceParallel
from posttrain.models.sequence_split import shard_tokens, split_batch
from posttrain.models.sharded_load import CheckpointFiles
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import memory_snapshot
from posttrain.train.micro_batches import padding_free, regroup_step
from posttrain.train.session import TrainSession, save_adapter, start_session

log = logging.getLogger("posttrain.train")

Row = dict[str, Any]
Figures = dict[str, Any]  # a stage's held-out metrics, by name (no "eval_" prefix)


class PreparedData(Protocol):
    """A stage's data (`SFTData`, `PreferenceData`): the rows as read, and as encoded."""

    train_rows: list[Row]
    eval_rows: list[Row]
    train: list[Row]
    eval: list[Row]
    stats: dict[str, int]


@dataclass(frozen=True)
class Draw:
    """What the steps draw from: the encoded training rows, the tokens one row costs in a
    forward (what `batch.by_tokens` regroups by and the throughput counts) and how rows become
    one micro-batch: `collate(rows, pad_id, padding_free)` -> a padded or a padding-free batch
    (`posttrain.data.batching.collate`, `posttrain.models.reward.pair_batch`)."""

    rows: list[Row]
    tokens: Callable[[Row], int]
    collate: Callable[[list[Row], int, bool], dict[str, Any]]
    pad_id: int


@dataclass(frozen=True)
class StepBatch:
    """This rank's share of one optimizer step, laid out into micro-batches."""

    t_start: float  # time.perf_counter() when the step began
    rows: list[list[int]]  # indices into `Draw.rows`, one list per micro-batch
    # The micro-batches as collated on the host; with sequence parallelism, this rank's shards
    # of them (`split_batch`: its slice of the tokens, its targets and `target_positions`).
    host: list[dict[str, Any]]
    micro: list[dict[str, Any]]  # the same on the device
    # This rank's tokens in the step (its shards' own with sequence parallelism), counted on the
    # host: reading a device tensor would wait for the last step's update.
    local_tokens: int
    t_data: float  # seconds spent drawing and laying out the rows
    # The step's rows' mean length in tokens (what attention's FLOPs grow with): whole rows,
    # whatever slice of them this rank holds.
    seq_len: float


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A collated batch's tensors (and its `Segments`, padding-free) on `device`; non-blocking:
    the device stream orders each copy before the forward that reads it."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def strided_batches(
    rows: list[Row],
    collate: Callable[..., dict[str, Any]],
    pad_id: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    flat: bool = False,
    phase: str = "eval",
    shard: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Iterator[tuple[list[int], dict[str, Any]]]:
    """(row indices, their batch on `device`) for this rank's share of `rows`, rank-strided.
    Every rank runs the same number of forwards (FSDP's all-gathers are collective): a rank
    short of rows gets no indices and a filler batch of the first row, to weigh 0. `shard`:
    what becomes of each collated batch on the host first (a sequence-parallel split)."""
    for idx in rank_batches(len(rows), rank, world, batch_size):
        heartbeat.beat(phase=phase)
        chunk = [rows[i] for i in idx] or rows[:1]
        batch = collate(chunk, pad_id, flat)
        yield idx, to_device(shard(batch) if shard else batch, device)


def add_sums(
    sums: dict[str, Any], values: dict[str, torch.Tensor], weight: float | None = None
) -> None:
    """Add each value's sum into `sums`: detached, on the device (a step's figures, read on
    logged steps only: `Training.step_means`); or with `weight`, as weight x a Python float
    (held-out figures: 0 for a filler)."""
    for name, v in values.items():
        add = v.detach().sum() if weight is None else weight * v.sum().item()
        sums[name] = sums.get(name, 0.0) + add


def host_floats(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """`values` with its device tensors read as Python floats, all in one copy."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    if not names:
        return dict(values)  # type: ignore[arg-type]
    read = torch.stack([values[k].detach().double().reshape(()) for k in names]).tolist()
    return {**values, **dict(zip(names, read, strict=True))}  # type: ignore[dict-item]


def plan_steps(ctx: Any, data: PreparedData, n_rows: int) -> tuple[ResolvedBatch, int]:
    """Write data/{train,eval}.jsonl (rank 0) and plan the steps: (the resolved batch,
    `max_steps` or the steps of `epochs` passes over `n_rows` rows)."""
    if ctx.is_main:
        write_splits(ctx.stage.out_dir, data.train_rows, data.eval_rows)
    cfg = ctx.section
    batch = section_batch(ctx.recipe, ctx.stage.name)
    return batch, cfg.max_steps or max(1, math.ceil(cfg.epochs * n_rows / batch.global_batch_size))


def open_training(
    ctx: Any,
    model: torch.nn.Module,
    weights: CheckpointFiles | None,
    batch: ResolvedBatch,
    total_steps: int,
    data: PreparedData,
    draw: Draw,
    heldout: Callable[[Training], Figures | None],
    **start_fields: Any,
) -> Training:
    """`start_session` of an offline stage, and whether its micro-batches go padding-free.
    `heldout(loop)`: the stage's held-out figures of the model as it stands (None: no figures,
    no record), taken at the start, every `eval_every` steps of the section and at the end."""
    cfg = ctx.section
    tr = start_session(
        ctx,
        model,
        cfg.optim,
        batch,
        total_steps,
        weights=weights,
        train_examples=len(draw.rows),
        eval_examples=len(data.eval),
        **start_fields,
        **data.stats,
    )
    flat = padding_free(cfg.batch, tr.model)
    return Training(ctx, tr, batch, draw, heldout, flat, cfg.eval_every, sequence_split(tr, flat))


def sequence_split(tr: TrainSession, flat: bool) -> SequenceParallel | None:
    """The group this rank splits each micro-batch's tokens with (None without sequence
    parallelism), logged once. Splitting needs padding-free micro-batches: a model that cannot
    take them is refused here rather than trained unsplit."""
    d = tr.dist
    if d.sp_size == 1:
        return None
    if not flat:
        raise ValueError(
            f"infra.sequence_parallel {d.sp_size} splits padding-free micro-batches, and this "
            "model's batches are padded (see the log line above); set infra.sequence_parallel: 1"
        )
    if d.is_main:
        groups = "group" if d.dp_size == 1 else "groups"
        log.info(
            "sequence parallel: %d ranks per group, %d data-parallel %s",
            d.sp_size,
            d.dp_size,
            groups,
        )
    return SequenceParallel.of(d.sp_group)


@dataclass
class Training:
    """An offline stage's running session and what its steps share (see the module docstring)."""

    ctx: Any
    tr: TrainSession
    batch: ResolvedBatch
    draw: Draw
    heldout: Callable[[Training], Figures | None]
    flat: bool  # padding-free micro-batches
    eval_every: int = 0
    sp: SequenceParallel | None = None  # the ranks this one splits its sequences with

    @property
    def section(self) -> Any:
        return self.ctx.section

    @property
    def model(self) -> torch.nn.Module:
        return self.tr.model

    @property
    def device(self) -> torch.device:
        return self.tr.dist.device

    @property
    def rank(self) -> int:
        return self.tr.dist.rank

    @property
    def world(self) -> int:
        return self.tr.dist.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group: the rows it is dealt (`strided_batches`)."""
        return self.tr.dist.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel groups (world / infra.sequence_parallel)."""
        return self.tr.dist.dp_size

    @property
    def chunk_tokens(self) -> int:
        """Tokens per pass through the LM head (`infra.logits_chunk_tokens`; 0 = full logits)."""
        return self.ctx.recipe.infra.logits_chunk_tokens

    @property
    def eval_batch_size(self) -> int:
        return self.batch.micro_batch_size

    def steps(self) -> range:
        """The optimizer steps this launch runs, 0-based (a resumed run's start after its own)."""
        return range(self.tr.start_step, self.tr.total_steps)

    def step_batch(self, step: int) -> StepBatch:
        """This rank's rows of step `step`, regrouped by tokens when `batch.by_tokens` asks."""
        t_start = time.perf_counter()
        rows = self.draw.rows
        idx = self.tr.step_rows(len(rows), step, self.batch, self.ctx.recipe.run.seed)
        groups = regroup_step(
            idx, lambda i: self.draw.tokens(rows[i]), self.ctx.by_tokens, self.device
        )
        return self.lay_out(t_start, groups)

    def lay_out(self, t_start: float, groups: list[list[int]]) -> StepBatch:
        """The micro-batches of `groups` (row indices per micro-batch), on host and device;
        with sequence parallelism, this rank's shard of each (`split_batch`)."""
        rows, pad_id = self.draw.rows, self.draw.pad_id
        host = [self.draw.collate([rows[i] for i in g], pad_id, self.flat) for g in groups]
        row_tokens = sum(self.draw.tokens(rows[i]) for g in groups for i in g)
        seq_len = row_tokens / max(1, sum(batch_rows(mb) for mb in host))
        local_tokens = row_tokens
        if self.sp is not None:
            local_tokens = sum(shard_tokens(mb["input_ids"].shape[1], self.sp) for mb in host)
            host = [split_batch(mb, self.sp, pad_id) for mb in host]
        micro = [to_device(mb, self.device) for mb in host]
        t_data = time.perf_counter() - t_start
        return StepBatch(t_start, groups, host, micro, local_tokens, t_data, seq_len)

    def finish_step(
        self,
        step: int,
        sb: StepBatch,
        *,
        loss: float | torch.Tensor,
        **metrics: float | torch.Tensor,
    ) -> None:
        """The end of optimizer step `step` (0-based), once its gradients are in: the optimizer
        step, the metrics record, held-out figures and a checkpoint when due. `loss`: the
        step's loss over all ranks (every rank passes the same value), a Python float or a
        0-dim device tensor the optimizer step reads with the gradient norm (one host sync).
        `metrics` may be device tensors too (`step_means`): read on logged steps only."""
        cfg, tr, done = self.section, self.tr, step + 1
        loss, grad_norm, lr = tr.optimizer_step(cfg.optim.max_grad_norm, loss=loss, step=done)
        if done % cfg.log_every == 0 or done == tr.total_steps:
            metrics = host_floats(metrics)
            tr.record_step(
                done,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr,
                local_tokens=sb.local_tokens,
                seq_len=sb.seq_len,
                t_start=sb.t_start,
                t_data=sb.t_data,
                **layout_stats(sb.host, sb.local_tokens),
                **metrics,
            )
        # Before the checkpoint: a resume keeps the records up to its step, this one included.
        if self.eval_every and done % self.eval_every == 0 and done < tr.total_steps:
            self.evaluate(done)
        tr.maybe_checkpoint(done, cfg.checkpoint_every, cfg.keep_checkpoints)

    def heldout_batches(
        self, rows: list[Row], flat: bool = False, split: bool = False
    ) -> Iterator[tuple[float, Any]]:
        """(weight, micro-batch on the device) for this rank's share of held-out `rows`
        (`strided_batches`, `Draw.collate`d; `flat`: padding-free), the model in eval mode.
        `split` (flat only): with sequence parallelism, this rank's shard of each batch, whose
        per-token sums add up over the group (per-row figures would not)."""
        self.model.eval()
        draw, sp = self.draw, self.sp
        shard = None
        if split and flat and sp is not None:
            shard = lambda mb: split_batch(mb, sp, draw.pad_id)  # noqa: E731
        for idx, batch in strided_batches(
            rows,
            draw.collate,
            draw.pad_id,
            self.eval_batch_size,
            self.device,
            self.dp_rank,
            self.dp_size,
            flat,
            shard=shard,
        ):
            yield (1.0 if idx else 0.0), batch
        self.model.train()

    def step_means(self, sums: dict[str, Any]) -> dict[str, torch.Tensor]:
        """`add_sums` totals over all ranks, per row of the global batch: 0-dim float64 tensors
        on the device, summed there in one all-reduce and read by nobody here. `finish_step`
        reads the loss with the gradient norm (the guard's read) and the rest on logged steps
        only (`host_floats`)."""
        t = torch.stack(
            [torch.as_tensor(v, device=self.device).detach().double() for v in sums.values()]
        )
        means = all_reduce_on_device(t) / self.batch.global_batch_size  # [len(sums)]
        return dict(zip(sums, means.unbind(), strict=True))

    def evaluate(self, step: int) -> Figures | None:
        """The stage's held-out figures now, as an `eval` record at `step` (`eval_<name>`)."""
        figures = self.heldout(self)
        if figures is not None:
            self.tr.metrics.write("eval", step=step, **{f"eval_{k}": v for k, v in figures.items()})
        return figures

    def heldout_at_start(self) -> Figures | None:
        """The step-0 figures on a fresh run; None on a resumed one (its metrics keep them)."""
        return self.evaluate(0) if self.tr.start_step == 0 else None

    def heldout_at_end(self) -> Figures | None:
        return self.evaluate(self.tr.total_steps)

    def close(self, selected_adapters: list[str] | None = None) -> None:
        """Save the trained adapter (`selected_adapters`: default all), write the `end` record
        and close metrics.jsonl."""
        save_adapter(self.model, self.ctx, selected_adapters=selected_adapters)
        self.tr.metrics.write("end", step=self.tr.total_steps, **memory_snapshot(self.device))
        self.tr.metrics.close()
