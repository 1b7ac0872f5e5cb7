"""One torchrun rank of bench/sequence_parallel.py: SFT's step at every length of the plan on this
rank's shard, its memory and time written to <out>/rank<r>.json (see that module's docstring
for what is measured and how)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from bench.sequence_parallel import Plan


def build_model(plan: Plan, info: Any) -> torch.nn.Module:
    """The random-init Llama of the plan's shape + LoRA r16 on every linear, placed as the stage
    places it (FSDP2 over the N ranks; unwrapped on one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.sequence_parallel import LORA_R, SHAPES
    from posttrain.distributed.fsdp import place_model
    from posttrain.models.lora import apply_lora, prepare_for_training
    from posttrain.sections.shared import LoraConfig

    s = SHAPES[plan.shape]
    config = LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=max(plan.row_tokens, 2048),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(info.device):
        base = LlamaForCausalLM(config)
    cuda = info.device.type == "cuda"
    if cuda:
        base = base.to(torch.bfloat16)
    prepare_for_training(base, activation_checkpointing=plan.checkpointing)
    model = apply_lora(base, LoraConfig(r=LORA_R, alpha=2 * LORA_R))
    precision, dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
    return place_model(model, info.mesh, precision, dtype).train()


def packed_batch(tokens: int, row_tokens: int, vocab: int) -> dict[str, Any]:
    """`tokens` tokens of packed rows of `row_tokens` (the last shorter), the first
    PROMPT_TOKENS of each unscored; the same on every rank (a fixed seed)."""
    from bench.sequence_parallel import PROMPT_TOKENS
    from posttrain.data.chat import IGNORE
    from posttrain.data.segments import flat_batch

    g = torch.Generator().manual_seed(tokens)
    rows, left = [], tokens
    while left > 0:
        n = min(left, row_tokens)
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        prompt = min(PROMPT_TOKENS, n // 2)
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
        left -= n
    return flat_batch(rows)


class Memory:
    """This rank's memory around one step: RSS on CPU (the kernel's peak reset before the step),
    torch's allocator on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> int:
        """Start a step's window; returns the bytes held now (`base`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return torch.cuda.memory_allocated(self.device)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return _status_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kib("VmHWM") * 1024


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


class Step:
    """SFT's step on one micro-batch (or this rank's shard of it): the loss through the chunked
    head, scaled as the stage scales it (summed NLL x world / the batch's target tokens),
    backward, clip at 1.0, fused AdamW, zero."""

    def __init__(self, model: torch.nn.Module, chunk: int) -> None:
        from posttrain.sections.shared import OptimConfig
        from posttrain.train.optim import build_optimizer

        self.model, self.chunk = model, chunk
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.trainable, OptimConfig(lr=1e-5))

    def __call__(self, batch: dict[str, Any], targets: int) -> float:
        from posttrain.train.forward_logps import forward_nll_sum

        nll, _ = forward_nll_sum(self.model, batch, self.chunk)
        loss = nll * dist.get_world_size() / targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        # The micro-batch's mean token NLL: the ranks' shares summed (the loss the stage logs).
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        return float(whole) / dist.get_world_size()


def measure_length(step: Step, plan: Plan, info: Any, tokens: int) -> dict[str, Any]:
    """One warm-up step, then `plan.steps` timed ones at `tokens`: base, the largest peak, the
    median seconds (ranks start each step together)."""
    from bench.sequence_parallel import SHAPES
    from posttrain.data.chat import IGNORE
    from posttrain.models.sequence_split import group_of, split_batch
    from posttrain.train.loop import to_device

    batch = packed_batch(tokens, plan.row_tokens, SHAPES[plan.shape]["vocab"])
    targets = int((batch["labels"][:, 1:] != IGNORE).sum())
    sp = group_of(info)
    mine = to_device(split_batch(batch, sp) if sp else batch, info.device)
    memory = Memory(info.device)
    loss = step(mine, targets)  # warm-up
    peaks, bases, seconds = [], [], []
    for _ in range(plan.steps):
        dist.barrier()
        bases.append(memory.reset())
        t = time.perf_counter()
        loss = step(mine, targets)
        peaks.append(memory.peak())
        seconds.append(time.perf_counter() - t)
    return {
        "tokens": tokens,
        "shard_tokens": int(mine["input_ids"].shape[1]),
        "base": max(bases),
        "peak": max(peaks),
        "step_s": statistics.median(seconds),
        "loss": loss,
    }


def run_rank(plan: Plan, out: Path) -> None:
    from posttrain.distributed.runtime import init_distributed, shutdown

    world = int(os.environ["WORLD_SIZE"])
    cores = len(os.sched_getaffinity(0))
    # The machine's cores shared out: N = 1 gets them all, N ranks 1/N each.
    info = init_distributed(
        plan.device, 600, threads=max(1, cores // world), sequence_parallel=world
    )
    model = build_model(plan, info)
    step = Step(model, plan.chunk)
    lengths = [measure_length(step, plan, info, t) for t in plan.lengths]
    record = {"rank": info.rank, "sp_size": info.sp_size, "lengths": lengths}
    (out / f"rank{info.rank}.json").write_text(json.dumps(record))
    shutdown()
