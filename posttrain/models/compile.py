"""Regional compilation: each decoder block's forward through `torch.compile` (`infra.compile`).

As torchtitan does, blocks are compiled one by one (`fullgraph=True`), not the whole model: all
blocks of a model share one code object, so the graph is traced and compiled once and reused by
every layer (compile time of one block, not of N), and what lies around the blocks (embedding,
chunked LM head, losses, FSDP2's per-block hooks, activation checkpointing's wrapper) stays eager.
The block's `forward` is replaced, not its `__call__`: hooks registered on the block (FSDP2's
all-gather/reshard, checkpointing's recompute) run around the compiled body, as in eager.

Packed micro-batches differ in length at every step ([1, N] with N varying, and the row layout
[S, L] of `posttrain.data.segments`): every size of the blocks' input tensors is marked dynamic,
so sizes are symbolic from the first trace (the weights' sizes stay static). Only what changes a graph's structure recompiles: one row or
several (`S == 1` is a specialised size), a sliding window shorter than the longest row or
not, a padded batch (held-out loss) instead of a packed one. Forwards that carry a KV cache
(generation) run the eager forward: a cache object mutates across calls and would recompile.

Applied after LoRA wrapping, sharding and activation checkpointing (`posttrain.train.session`).
`CompileStats` reads dynamo's counters, so compile time is reported apart from step time.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.distributed.fsdp import decoder_blocks


def compile_enabled(setting: str | bool, device: torch.device) -> bool:
    """`infra.compile`: `auto` = on for CUDA only (inductor's CPU kernels are correct but a CPU
    run gains less than the minute of compiling costs a short run), true/false as set."""
    if setting == "auto":
        return device.type == "cuda"
    return bool(setting)


def compile_blocks(model: nn.Module) -> int:
    """Replace each decoder block's forward with its compiled version; returns how many.

    Sets inductor's `fallback_random` (process-wide): random ops in the graph (LoRA dropout)
    then draw from torch's generator as eager does, so a compiled run takes the same dropout
    masks as an eager one and `infra.compile` changes no result beyond float rounding. Inductor's
    own RNG would draw other masks. Without dropout there is no random op: it costs nothing."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    blocks = decoder_blocks(model)
    for block in blocks:
        block.forward = _regional(block)  # type: ignore[method-assign]
    return len(blocks)


def _regional(block: nn.Module) -> Any:
    """The block's forward: its body compiled, activation checkpointing kept around it eagerly.

    transformers wraps a layer class's forward in `forward_with_checkpointing` (once per
    subclass: FSDP2's `FSDP<Layer>` adds one). Compiling through it would trace
    `torch.utils.checkpoint` as a higher-order op, which refuses the attention's side effect
    (`varlen_attention` marks that it saw the segments); checkpointing the compiled body instead
    is the same recompute, and the recompute replays the compiled graph."""
    body = _unwrapped_forward(type(block))
    compiled = torch.compile(functools.partial(body, block), fullgraph=True)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is not None:
            return body(block, *args, **kwargs)  # generation: the cache changes at every call
        _sizes_dynamic((*args, *kwargs.values()))
        if (
            getattr(block, "gradient_checkpointing", False)
            and block.training
            and torch.is_grad_enabled()
        ):
            return block._gradient_checkpointing_func(functools.partial(compiled, **kwargs), *args)
        return compiled(*args, **kwargs)

    return forward


def _sizes_dynamic(values: Any) -> None:
    """Every size of every input tensor symbolic from the first trace (`dynamic=True` would
    also make the weights' sizes symbolic: FSDP2's unsharded parameters are block inputs, and
    symbolic head counts break SDPA's arguments). Sizes of 1 stay specialised; tensors inside
    tuples and dataclasses (rotary cos/sin, `Segments`) count."""
    if isinstance(values, torch.Tensor):
        for dim in range(values.dim()):
            torch._dynamo.maybe_mark_dynamic(values, dim)
    elif isinstance(values, tuple | list):
        for v in values:
            _sizes_dynamic(v)
    elif dataclasses.is_dataclass(values) and not isinstance(values, type):
        for f in dataclasses.fields(values):
            _sizes_dynamic(getattr(values, f.name))


def _unwrapped_forward(cls: type) -> Any:
    """`cls.forward` without transformers' checkpointing wrappers (found by their code's name:
    `functools.wraps` copies the wrapped function's name onto the wrapper, not its code)."""
    fn = cls.forward
    while fn.__code__.co_name == "forward_with_checkpointing":
        fn = fn.__wrapped__
    return fn


@dataclass(frozen=True)
class CompileStats:
    """Dynamo's process-wide totals at one moment: seconds spent compiling, graphs compiled."""

    seconds: float
    graphs: int

    @classmethod
    def now(cls) -> CompileStats:
        from torch._dynamo.utils import compilation_time_metrics, counters

        # Every frame compile (trace, AOT autograd, inductor) is timed under this key.
        seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
        return cls(seconds, int(counters["stats"]["unique_graphs"]))

    def since(self, before: CompileStats) -> dict[str, float]:
        """The step-record fields: compile seconds and graphs compiled since `before`."""
        return {
            "compile_s": round(self.seconds - before.seconds, 3),
            "graphs_compiled": self.graphs - before.graphs,
        }
