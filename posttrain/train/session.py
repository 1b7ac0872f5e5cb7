"""The parts every training stage shares around its own loop.

A stage keeps its loop explicit (what a step computes is the stage's business); this module
does the rest the same way everywhere: place the model, build optimizer and schedule, resume,
step (clipping; loss scaling for fp16), record throughput/MFU/memory, save checkpoints.

Numerical guards (`posttrain.train.guard`, recipe section `guard`) live in `optimizer_step`: a
step whose loss or gradient norm is not finite, or whose loss spikes, is not applied, and too
many of them stop the stage. Every optimizer step also beats the rank's heartbeat
(`posttrain.telemetry.heartbeat`), which the supervisor's hang watch reads.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config.batch import ResolvedBatch
from posttrain.data.batching import step_indices
from posttrain.distributed.fsdp import is_sharded, place_model
from posttrain.distributed.runtime import DistInfo, all_reduce_sum
from posttrain.models.compile import CompileStats, compile_blocks, compile_enabled
from posttrain.models.compiled_head import logits_head_compiled, use_compiled_head
from posttrain.models.loading import base_dtype, count_params
from posttrain.models.lora import canonical_adapter_configs
from posttrain.models.sharded_load import CheckpointFiles, fill_from_checkpoint
from posttrain.sections.shared import OptimConfig
from posttrain.telemetry import heartbeat
from posttrain.telemetry.metrics import (
    MetricsWriter,
    device_peak_flops,
    matmul_params,
    memory_snapshot,
    train_flops_per_token,
)
from posttrain.train.checkpoint import data_position, save_checkpoint
from posttrain.train.guard import StepGuard
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.resume import ResumePoint, resume_newest_intact

log = logging.getLogger("posttrain.train")


@dataclass
class TrainSession:
    model: torch.nn.Module
    dist: DistInfo
    trainable: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    metrics: MetricsWriter
    total_steps: int
    start_step: int
    n_matmul: int
    n_trainable: int
    n_total: int
    peak_flops: float
    ckpt_root: Any
    last: dict[str, float] = field(default_factory=dict)
    # meta.json of the checkpoint this session resumed from (a stage's own state lives there)
    resume_meta: dict[str, Any] = field(default_factory=dict)
    # (n_rows, global batch, seed) of the stream `step_rows` walks: the checkpoint's data position
    data_stream: tuple[int, int, int] | None = None
    guard: StepGuard | None = None
    # updates skipped since the last `record_step` / the last `maybe_checkpoint` call
    skipped_since_record: int = 0
    # of those since the last `record_step`, the ones skipped for a non-finite loss or norm
    nonfinite_since_record: int = 0
    skipped_since_boundary: int = 0
    # checkpoints the resume rejected as damaged: "step_N: problem (moved to step_N.damaged)"
    rejected_checkpoints: list[str] = field(default_factory=list)
    # dynamo's totals at the last `record_step` when the blocks are compiled (`infra.compile`)
    compile_mark: CompileStats | None = None

    def step_rows(self, n_rows: int, step: int, batch: ResolvedBatch, seed: int) -> list[list[int]]:
        """This rank's row indices for optimizer step `step` -> [accum][micro] (see
        `posttrain.data.batching.step_indices`: a pure function of seed and step)."""
        stream = (n_rows, batch.global_batch_size, seed)
        if stream != self.data_stream:
            saved = self.resume_meta.get("data")
            if saved and self.data_stream is None:
                was = (saved["n_rows"], saved["global_batch_size"], saved["seed"])
                if was != stream:  # same fingerprint should mean same stream: refuse to diverge
                    raise RuntimeError(
                        f"resumed checkpoint walked (rows, global batch, seed) {was}, this run "
                        f"{stream}: the steps after it would not see the rows they should"
                    )
            self.data_stream = stream
        return step_indices(
            n_rows,
            step,
            micro=batch.micro_batch_size,
            accum=batch.grad_accum_steps,
            dp_size=self.dist.dp_size,
            rank=self.dist.dp_rank,
            seed=seed,
        )

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def optimizer_step(
        self, max_grad_norm: float | None, *, loss: float | torch.Tensor, step: int, **record: Any
    ) -> tuple[float, float, float]:
        """Clip, check, step, schedule, zero. Returns (loss, grad norm before clipping, lr).

        `loss`: the step's loss over all ranks (every rank passes the same value, and the clipped
        norm is global, so every rank takes the same decision without another collective); a
        0-dim device tensor is read here together with the norm. `step`: 1-based; `record`:
        extra fields for a guard record. A bad step (`posttrain.train.guard`) is skipped:
        gradients zeroed, neither optimizer nor schedule stepped, so parameters and optimizer
        state stay bit-identical.

        This is the step's one host sync: loss and norm come over in one copy, before the
        update, because the guard's verdict decides on the host whether the optimizer and the
        LR schedule step at all (a skipped step leaves both bit-identical), feeds the loss-spike
        history and stops the stage at the step that broke it; a verdict read later would
        have to undo updates and schedule steps already taken."""
        assert self.guard is not None, "start_session sets the guard"
        if self.scaler:
            self.scaler.unscale_(self.opt)
        norm_t = torch.nn.utils.clip_grad_norm_(self.trainable, max_grad_norm or float("inf"))
        loss, norm = _read_pair(loss, norm_t)
        lr = self.opt.param_groups[0]["lr"]
        # With a loss scaler, inf/nan gradients are its overflow signal: scaler.step skips them
        # and update() lowers the scale. The guard then judges the loss only.
        reason = self.guard.judge(loss, norm, check_norm=self.scaler is None)
        if reason is None:
            if self.scaler:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
            self.sched.step()
        else:
            if self.scaler:
                # Clears unscale_'s record (the next unscale_ would refuse) and lowers the scale
                # if the gradients overflowed; it applies nothing.
                self.scaler.update()
            self.skipped_since_record += 1
            self.skipped_since_boundary += 1
            # Apart from loss spikes: NaN/inf means broken numerics, not noisy data.
            if reason.startswith("non-finite"):
                self.nonfinite_since_record += 1
            self.metrics.write(
                "guard", step=step, reason=reason, loss=loss, grad_norm=norm, lr=lr, **record
            )
            log.warning("step %d: update skipped: %s", step, reason)
        self.opt.zero_grad(set_to_none=True)
        heartbeat.beat(step=step, phase="train")
        self.guard.commit(step, loss, reason)
        return loss, norm, lr

    def record_step(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        local_tokens: int,
        seq_len: float,
        t_start: float,
        t_data: float,
        flops: float | None = None,
        **extra: float,
    ) -> None:
        """Throughput, FLOP/s, MFU and memory of one optimizer step -> metrics.jsonl.

        `local_tokens`: this rank's non-pad tokens, `seq_len` their mean length; `flops`: this
        rank's FLOPs when the step is not one training pass over them (RL also generates and
        scores). A non-finite loss is written but does not replace the headline's last good one.
        """
        dt, tokens, achieved, mfu = self._throughput(local_tokens, seq_len, t_start, flops)
        world, rate = self.dist.world_size, tokens / dt
        if self.skipped_since_record:
            extra = {**extra, "skipped_updates": self.skipped_since_record}
            self.skipped_since_record = 0
        if self.nonfinite_since_record:
            extra = {**extra, "nonfinite_updates": self.nonfinite_since_record}
            self.nonfinite_since_record = 0
        if self.compile_mark is not None:
            # Compile time apart: compile_s = seconds dynamo spent compiling since the previous
            # record (in this step, or in a held-out evaluation before it, which step_time_s
            # leaves out), graphs_compiled = the graphs it made meanwhile.
            now = CompileStats.now()
            extra = {**extra, **now.since(self.compile_mark)}
            self.compile_mark = now
        if math.isfinite(loss):
            self.last = dict(loss=loss, grad_norm=grad_norm, tokens_per_s=rate, mfu=mfu, **extra)
        self.metrics.write(
            "train",
            step=step,
            total_steps=self.total_steps,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=tokens,
            tokens_per_s=rate,
            tokens_per_s_per_device=rate / world,
            tflops=achieved / 1e12,
            tflops_per_device=achieved / world / 1e12,
            mfu=mfu,
            step_time_s=dt,
            data_wait_s=t_data,
            compute_s=dt - t_data,
            **extra,
            **memory_snapshot(self.dist.device),
        )
        log.info(
            "step %d/%d loss %.4f lr %.2e gnorm %.3f tok/s %.0f mfu %.1f%%%s",
            step,
            self.total_steps,
            loss,
            lr,
            grad_norm,
            rate,
            100 * mfu,
            "".join(f" {k} {v:.4g}" for k, v in extra.items()),
        )

    def _throughput(
        self, local_tokens: int, seq_len: float, t_start: float, flops: float | None
    ) -> tuple[float, float, float, float]:
        """(seconds since `t_start`, tokens and FLOP/s over all ranks, MFU) of the step ending
        now. No device synchronize: the guard's read in `optimizer_step` already waited for the
        step's forwards and backwards; its optimizer kernels, still in flight, are waited for by
        the next step's read and count there."""
        device = self.dist.device
        dt = time.perf_counter() - t_start
        tokens = all_reduce_sum(local_tokens, device)
        cfg = self.model.config
        fpt = train_flops_per_token(
            self.n_matmul, self.n_trainable, cfg.num_hidden_layers, cfg.hidden_size, int(seq_len)
        )
        achieved = (all_reduce_sum(flops, device) if flops is not None else fpt * tokens) / dt
        mfu = achieved / (self.peak_flops * self.dist.world_size) if self.peak_flops else math.nan
        return dt, tokens, achieved, mfu

    def summary(self, ctx: Any, **fields: Any) -> dict[str, Any]:
        """The manifest summary fields every training stage reports, plus the stage's own."""
        return {
            "total_steps": self.total_steps,
            "params_trainable": self.n_trainable,
            "params_total": self.n_total,
            "adapter_dir": str(ctx.stage.out_dir / "adapter"),
            "final_train_loss": self.last.get("loss"),
            "tokens_per_s": self.last.get("tokens_per_s"),
            "mfu": self.last.get("mfu"),
            "skipped_steps": self.skipped_steps,
            # > 0: this launch resumed from that checkpoint (stage_main reports it as recovery)
            "resumed_from_step": self.start_step,
            "rejected_checkpoints": self.rejected_checkpoints,
            **fields,
        }

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the guard skipped in this stage (a resumed run's included)."""
        return self.guard.skipped if self.guard else 0

    def headline(self, **fields: float | str) -> dict[str, float | str]:
        """A stage's key metrics plus its last train loss and MFU, numbers rounded for reports
        (a word, such as what a figure measures, kept as is), and `skipped_steps` when the guard
        skipped any (absent otherwise: nothing to report)."""
        out = {**fields, "train_loss": self.last.get("loss"), "mfu": self.last.get("mfu")}
        if self.skipped_steps:
            out["skipped_steps"] = self.skipped_steps
        return {
            k: v if isinstance(v, str) else round(v, 4) for k, v in out.items() if v is not None
        }

    def maybe_checkpoint(
        self, step: int, every: int, keep: int, extra: dict[str, Any] | None = None
    ) -> None:
        """Checkpoint every `every` steps (not after the last: the stage's output follows), with
        `extra` (JSON-able stage state, back as `resume_meta`), the data position and the
        guard's window in meta.json. No checkpoint follows a skipped update: the newest is always
        a state reached by good updates, and a resume replays the skipped step (same rows, same
        parameters: the same verdict)."""
        skipped, self.skipped_since_boundary = self.skipped_since_boundary, 0
        if every and step % every == 0 and step < self.total_steps:
            if skipped:
                log.warning("step %d: no checkpoint after a skipped update", step)
                return
            extra = {**(extra or {})}
            if self.data_stream is not None:
                extra = {"data": data_position(step, *self.data_stream), **extra}
            if self.guard is not None:
                extra["guard"] = self.guard.state_dict()
            heartbeat.beat(phase="checkpoint")
            self.metrics.sync()
            save_checkpoint(self.ckpt_root, step, self.model, self.opt, self.sched, keep, extra)


def _read_pair(loss: float | torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
    """(loss, norm) as Python floats, in one device-to-host copy. float64 on the device: the
    fp32 values convert exactly, and a float64 loss stays as computed."""
    if hasattr(norm, "full_tensor"):  # FSDP2: the global norm of a DTensor
        norm = norm.full_tensor()
    if not isinstance(loss, torch.Tensor):
        return float(loss), float(norm)
    pair = torch.stack([loss.detach().reshape(()).double(), norm.double()])
    loss_f, norm_f = pair.tolist()
    return loss_f, norm_f


def start_session(
    ctx: Any,
    model: torch.nn.Module,
    optim: OptimConfig,
    batch: ResolvedBatch,
    total_steps: int,
    schedule_steps: int | None = None,
    weights: CheckpointFiles | None = None,
    **start_fields: Any,
) -> TrainSession:
    """Place `model` (trainable parts already marked), build optimizer + schedule, resume from
    the newest intact checkpoint and write the `start` record. `schedule_steps`: steps the LR
    schedule spans when a logged step holds several (default total_steps). `weights`: the
    checkpoint of a base built on the meta device, each rank reading only its shards of it
    after sharding; without it, `model` is real and whole on this process."""
    d: DistInfo = ctx.dist
    assert batch.dp_size == d.dp_size, f"recipe dp {batch.dp_size} != mesh dp {d.dp_size}"
    heartbeat.beat(phase="setup")  # model loaded and data prepared; sharding and resume next
    counts = count_params(model)  # (total, trainable), before sharding splits the tensors
    n_matmul = matmul_params(model)
    dtype = base_dtype(ctx.recipe.infra)
    model = _place(ctx, model, dtype, weights)
    compiled = _compile(ctx, model)
    head = _choose_head(ctx, model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(trainable, optim)
    sched = build_scheduler(opt, schedule_steps or total_steps, optim)
    scaler = _loss_scaler(ctx.recipe.infra.precision, model, d.device)
    guard = StepGuard(ctx.recipe.guard, where=f"stage {ctx.stage.name}")
    ckpt_root = ctx.stage.out_dir / "checkpoints"
    point = _resume(ctx, ckpt_root, model, opt, sched, guard)
    start_step, meta = (point.meta["step"], point.meta) if point.path is not None else (0, {})
    peak = _peak_flops(d.device, ctx.recipe.infra.precision)
    start_fields = {"compiled_blocks": compiled, "logits_head": head, **start_fields}
    start = _start_record(ctx, batch, total_steps, start_step, counts, dtype, peak, start_fields)
    metrics = _open_metrics(ctx, start_step, start, point)
    _log_plan(counts, batch, d.dp_size, total_steps)
    heartbeat.beat(step=start_step, phase="train")
    return TrainSession(
        model,
        d,
        trainable,
        opt,
        sched,
        scaler,
        metrics,
        total_steps,
        start_step,
        n_matmul,
        counts[1],
        counts[0],
        peak[0],
        ckpt_root,
        resume_meta=meta,
        guard=guard,
        rejected_checkpoints=[_rejected_line(r) for r in point.rejected],
        compile_mark=CompileStats.now() if compiled or head == "compiled" else None,
    )


def _place(
    ctx: Any, model: torch.nn.Module, dtype: torch.dtype, weights: CheckpointFiles | None
) -> torch.nn.Module:
    """`model` on this rank's device, in training mode: sharded on more than one device,
    unwrapped on one (`place_model`, decision 45). A base built on the meta device (`weights`
    given) is filled after sharding, each rank reading only its shards."""
    d: DistInfo = ctx.dist
    infra = ctx.recipe.infra
    single = infra.shard_single_device
    if weights is None:
        model = place_model(model.to(d.device), d.mesh, infra.precision, dtype, single)
    else:
        model = place_model(model, d.mesh, infra.precision, dtype, single)
        fill_from_checkpoint(model, weights, d.device)
    model.train()
    return model


def _compile(ctx: Any, model: torch.nn.Module) -> int:
    """Compile the placed model's decoder blocks when `infra.compile` says so (after LoRA,
    sharding and activation checkpointing, as torchtitan orders them); returns how many."""
    if not compile_enabled(ctx.recipe.infra.compile, ctx.dist.device):
        return 0
    n = compile_blocks(model)
    log.info("compiling %d decoder blocks (torch.compile, one graph per kind of batch)", n)
    return n


def _choose_head(ctx: Any, model: torch.nn.Module) -> str | None:
    """Mark the model's LM head for `infra.logits_head` (read by every chunked scoring call:
    `posttrain.models.chunked.head_scores`); returns the variant: compiled, chunked,
    unchunked (`logits_chunk_tokens` 0: full logits), None for a model without a plain linear
    LM head."""
    infra = ctx.recipe.infra
    lm = getattr(model, "causal_lm", model)  # a `RoleModel` (RL) holds the causal LM
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if type(head) is not torch.nn.Linear:
        return None
    if not infra.logits_chunk_tokens:
        return "unchunked"
    on = logits_head_compiled(infra.logits_head, infra.compile, ctx.dist.device)
    use_compiled_head(head, on)
    if on:
        log.info("LM head: each chunk of %d tokens compiled", infra.logits_chunk_tokens)
    return "compiled" if on else "chunked"


def _loss_scaler(precision: str, model: torch.nn.Module, device: torch.device) -> Any:
    """The fp16 loss scaler (FSDP's sharded one for a sharded model); None in fp32 and bf16."""
    if precision != "fp16":
        return None
    if is_sharded(model):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def _resume(
    ctx: Any,
    ckpt_root: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    guard: StepGuard,
) -> ResumePoint:
    """Load the newest intact checkpoint (`resume_newest_intact`), and its guard window."""
    point = resume_newest_intact(
        ckpt_root,
        model,
        opt,
        sched,
        on_none=ctx.recipe.infra.no_intact_checkpoint,
        where=f"stage {ctx.stage.name}",
    )
    if point.path is not None:
        log.info("resumed from %s at step %d", point.path.name, point.meta["step"])
        if pos := point.meta.get("data"):
            log.info("data position: epoch %d, offset %d", pos["epoch"], pos["offset"])
        guard.load_state_dict(point.meta.get("guard", {}))
    return point


def _peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from), for MFU. The CPU peak is
    measured with torch.randn (once per process): it runs off the global RNG, or a resumed run's
    stream (restored by the resume) would drift from the uninterrupted run's."""
    with torch.random.fork_rng(devices=[]):
        return device_peak_flops(device, precision)


def _start_record(
    ctx: Any,
    batch: ResolvedBatch,
    total_steps: int,
    start_step: int,
    counts: tuple[int, int],
    dtype: torch.dtype,
    peak: tuple[float, str],
    stage_fields: dict[str, Any],
) -> dict[str, Any]:
    """The fields of the `start` metrics record, then the stage's own."""
    n_total, n_trainable = counts
    return {
        "total_steps": total_steps,
        "start_step": start_step,
        "world_size": ctx.dist.world_size,
        "params_total": n_total,
        "params_trainable": n_trainable,
        "trainable_fraction": n_trainable / n_total,
        "micro_batch_size": batch.micro_batch_size,
        "grad_accum_steps": batch.grad_accum_steps,
        "global_batch_size": batch.global_batch_size,
        "precision": ctx.recipe.infra.precision,
        "base_dtype": str(dtype).removeprefix("torch."),
        "peak_flops_per_device": peak[0],
        "peak_flops_source": peak[1],
        # Tokens per forward (`batch.by_tokens`; auto: the pre-flight's budget and estimate).
        **(ctx.token_budget.record() if getattr(ctx, "token_budget", None) else {}),
        **stage_fields,
    }


def _open_metrics(
    ctx: Any, start_step: int, start: dict[str, Any], point: ResumePoint
) -> MetricsWriter:
    """metrics.jsonl for this launch (a resumed run keeps the records up to its step): the
    `start` record, a `resume` record when the resume has something to say, the pre-flight's."""
    metrics = MetricsWriter(
        ctx.stage.out_dir / "metrics.jsonl", enabled=ctx.is_main, resume_step=start_step
    )
    metrics.write("start", **start)
    if record := point.record():
        metrics.write("resume", **record)
    if getattr(ctx, "preflight", None):
        metrics.write("preflight", **ctx.preflight)
    return metrics


def _log_plan(counts: tuple[int, int], batch: ResolvedBatch, dp: int, total_steps: int) -> None:
    n_total, n_trainable = counts
    log.info(
        "trainable params %s / %s (%.3f%%); micro %d x accum %d x dp %d = global %d; %d steps",
        f"{n_trainable:,}",
        f"{n_total:,}",
        100 * n_trainable / n_total,
        batch.micro_batch_size,
        batch.grad_accum_steps,
        dp,
        batch.global_batch_size,
        total_steps,
    )


def _rejected_line(rejected: dict[str, Any]) -> str:
    problems = rejected.get("problems") or ["damaged"]
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    moved = f"; moved to {rejected['moved_to']}" if rejected.get("moved_to") else ""
    return f"{rejected.get('checkpoint')}: {problems[0]}{more}{moved}"


def save_adapter(
    model: torch.nn.Module,
    ctx: Any,
    name: str = "adapter",
    selected_adapters: list[str] | None = None,
) -> None:
    """Gather the trainable weights to full tensors (collective on every rank) and save them in
    peft format on rank 0 under `<out_dir>/<name>`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    heartbeat.beat(phase="save")
    full = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True),
    )
    if ctx.is_main:
        kw = {"selected_adapters": selected_adapters} if selected_adapters else {}
        model.save_pretrained(str(ctx.stage.out_dir / name), state_dict=full, **kw)
        canonical_adapter_configs(ctx.stage.out_dir / name)
    if dist.is_initialized():
        dist.barrier()
