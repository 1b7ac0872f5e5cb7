"""`FastEngine` (`rollout.engine: fast`): in-process sampling from a plain copy of the policy with
its LoRA merged (`posttrain.rl.rollout.merged`), decoded by transformers' `generate`: on CUDA
with a static KV cache whose one-token decode step `generate` compiles (torch.compile
mode="reduce-overhead": CUDA graphs), so a decode step costs one graph launch instead of
hundreds of kernel launches from Python, the adapter's extra matmuls and (under FSDP2) an
all-gather of every block. Where nothing is compiled (CPU) the dynamic cache: a static one's
fixed length costs more attention than it saves there; the merged weights alone are the gain
(no adapter matmuls, no peft per layer).

The copy is refreshed from the trainer's weights at `sync_weights` and then probed
(`posttrain.rl.rollout.probe`): the stage fails by name when the copy scores tokens otherwise
than the trainer does. The copy is not sharded: every rank holds all of it (the model's
parameters in the sampling dtype: bf16 on CUDA, fp32 on CPU), and a forward of it is no
collective, so ranks need not keep their forwards in step (`collective = False`; the refresh
and the probe are collectives, run by every rank at `sync_weights`).

The static cache (CUDA) holds `max_cache_len` positions for every row: the call's prompt width plus
`max_new_tokens`, rounded up to a multiple of `CACHE_BUCKET` and never shrunk, so calls of
other prompt widths reuse one compiled graph instead of recompiling. Rows that ended keep
stepping until the longest ends (static shapes; a CUDA-graphed step costs the same for a full
batch): `drop_finished` does not apply. Episode turns (`turns=True`) keep their per-row KV
caches with the `hf` engine's decode loop (DynamicCache), run on the merged copy.
"""

from __future__ import annotations

import logging
import math

import torch

from posttrain.models.decoding import generate_kwargs
from posttrain.models.roles import RoleModel
from posttrain.rl.rollout.engine import HFEngine
from posttrain.rl.rollout.merged import plain_copy, refresh
from posttrain.rl.rollout.probe import TOLERANCE, compare, probe_ids, sampler_logps, trainer_logps
from posttrain.sections.shared import SamplingConfig

log = logging.getLogger("posttrain.rollout")
CACHE_BUCKET = 256


def sampling_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what serving engines sample in), fp32 elsewhere (CPU has no fast bf16)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class FastEngine(HFEngine):
    """Samples `role` of `model` (a `RoleModel`, sharded or not) from a merged plain copy; see
    the module docstring. `compile`: let `generate` compile the decode step on CUDA.
    `tolerance`: the probe's (None: by the copy's dtype); `chunk_tokens`: the trainer's
    chunked head, as its scoring uses it."""

    collective = False  # the copy's forwards are local; refresh and probe are collectives

    def __init__(
        self,
        model: torch.nn.Module,
        role: str,
        batch_size: int | None = None,
        keep_turns: bool = True,
        compile: bool = True,
        tolerance: float | None = None,
        chunk_tokens: int = 0,
        static_cache: bool | None = None,
    ) -> None:
        device = next(model.parameters()).device
        dtype = sampling_dtype(device)
        self.plain = plain_copy(model.causal_lm, dtype, device)
        # world 1: the inherited decode loop then runs no all-reduce (no collective here).
        super().__init__(
            RoleModel(self.plain, None, None),
            role,
            1,
            batch_size=batch_size,
            keep_gathered=False,
            keep_turns=keep_turns,
        )
        self.compile = compile
        self.static_cache = static_cache
        self.tolerance = TOLERANCE.get(dtype, 0.05) if tolerance is None else tolerance
        self.chunk_tokens = chunk_tokens
        self.probe = probe_ids(self.plain.config.get_text_config().vocab_size)
        self.max_cache_len = 0
        self.figures = self._refresh(model)  # the start's check: a copy that never matched
        log.info(
            "rollout engine fast: %s copy of %s, probe %.3g mean |dlogp| (max %.3g)",
            dtype,
            role,
            self.figures["sampler_probe_mean"],
            self.figures["sampler_probe_max"],
        )

    def _refresh(self, model: torch.nn.Module) -> dict[str, float]:
        refresh(self.plain, model.causal_lm, self.role)
        ids, attn = self.probe
        want = trainer_logps(model, self.role, ids, attn, self.chunk_tokens)
        return compare(
            sampler_logps(self.plain, ids, attn),
            want,
            attn[:, 1:].bool(),
            self.tolerance,
            "fast",
            self.version,
        )

    def sync_weights(self, model: torch.nn.Module) -> dict[str, float]:
        """The trainer's weights into the copy, then the probe (both collectives)."""
        self.prefix.clear()  # keys and values of the old weights
        self.version += 1
        self.figures = self._refresh(model)
        return self.figures

    def _generate(
        self,
        ids: torch.Tensor,
        attn: torch.Tensor,
        sampling: SamplingConfig,
        stop_ids: list[int],
        pad_id: int,
    ) -> torch.Tensor:
        """`generate` on the merged copy: ids/attn [b, P] -> new tokens [b, R]."""
        # A static cache only where `generate` compiles the decode step (CUDA; `static_cache` None): uncompiled (CPU),
        # its fixed length costs more attention and mask work than the dynamic cache's growth,
        # measured 1.37 s against 1.08 s a GRPO rollout (bench/vs_trl.py --grpo-set
        # rollout.engine=fast, 11M Llama, 64 answers of <= 32 tokens).
        cache = {}
        static = self.static_cache
        if static if static is not None else ids.is_cuda and self.compile:
            need = ids.size(1) + sampling.max_new_tokens
            bucket = math.ceil(need / CACHE_BUCKET) * CACHE_BUCKET
            self.max_cache_len = max(self.max_cache_len, bucket)
            cache = {"cache_implementation": "static", "max_cache_len": self.max_cache_len}
        out = self.plain.generate(
            input_ids=ids,
            attention_mask=attn,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            disable_compile=not self.compile,
            **cache,
            **generate_kwargs(sampling),
        )  # [b, P + R]
        return out[:, ids.size(1) :]
