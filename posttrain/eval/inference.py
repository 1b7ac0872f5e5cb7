"""Decode latency with and without the KV cache, from a hand-written greedy loop.

`generate()` adds logits processors, stopping criteria and bookkeeping whose cost is not the
model's; a bare loop of forward + argmax times only what a serving stack would also pay. The loop
never stops at EOS, so every run decodes exactly `new_tokens` tokens and runs are comparable.

- time to first token (TTFT): the prefill forward over the prompt plus the first argmax;
- time per output token (TPOT): mean of the remaining steps;
- tokens/s: new_tokens / total decode time (prefill included).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from transformers import DynamicCache


def _sync(device: torch.device) -> None:
    # CUDA kernels are asynchronous: without a sync the clock stops before the work is done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_decode(
    model: Any, prompt_ids: torch.Tensor, new_tokens: int, use_cache: bool
) -> tuple[list[int], list[float]]:
    """Greedy-decode `new_tokens` tokens after prompt_ids [1, P] -> (token ids, seconds per
    step). With the cache each step after the prefill feeds the last token [1, 1]; without, every
    step recomputes [1, P + t], the quadratic baseline the cache exists to avoid."""
    device = prompt_ids.device
    seq = prompt_ids  # [1, P + t]
    cache = DynamicCache(config=model.config) if use_cache else None
    step_input = prompt_ids
    tokens: list[int] = []
    times: list[float] = []
    for _ in range(new_tokens):
        _sync(device)
        t0 = time.perf_counter()
        if use_cache:
            # transformers 5.24 names the argument `cache` (`past_key_values` is its deprecated
            # alias until 5.40); the cache is filled in place and also returned.
            out = model(input_ids=step_input, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
        else:
            out = model(input_ids=seq, use_cache=False, logits_to_keep=1)
        next_id = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)  # [1, 1]
        _sync(device)
        times.append(time.perf_counter() - t0)
        tokens.append(int(next_id))
        seq = torch.cat([seq, next_id], dim=1)
        step_input = next_id
    return tokens, times


def measure_inference(
    model: Any, prompt_ids: torch.Tensor, new_tokens: int, use_cache: bool, repeats: int
) -> dict[str, Any]:
    """Median latency figures over `repeats` timed runs after one untimed warm-up run, of
    prompt_ids [1, P] (latency, not throughput under batching). Raises if repeated runs decode
    different tokens: the timings would not be of the same work."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"prompt_ids must be [1, P], got {list(prompt_ids.shape)}")
    if new_tokens < 1 or repeats < 1:
        raise ValueError("new_tokens and repeats must be >= 1")
    device = next(model.parameters()).device
    prompt_ids = prompt_ids.to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            # Warm-up: first-call allocations and kernel selection are not decode cost.
            ref_tokens, _ = greedy_decode(model, prompt_ids, new_tokens, use_cache)
            runs = []
            for _ in range(repeats):
                tokens, times = greedy_decode(model, prompt_ids, new_tokens, use_cache)
                if tokens != ref_tokens:
                    raise RuntimeError("greedy decode is not deterministic across repeats")
                runs.append(times)
    finally:
        model.train(was_training)
    ttft = [t[0] for t in runs]
    tpot = [statistics.fmean(t[1:]) for t in runs] if new_tokens > 1 else None
    tps = [new_tokens / sum(t) for t in runs]
    return {
        "use_cache": use_cache,
        "prompt_tokens": int(prompt_ids.shape[1]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "ttft_s": statistics.median(ttft),
        "tpot_s": statistics.median(tpot) if tpot is not None else None,
        "tokens_per_s": statistics.median(tps),
        "token_ids": ref_tokens,
    }


def compare_cache_modes(
    model: Any, prompt_ids: torch.Tensor, new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Both modes on the same prompt. `tokens_match` is reported, not asserted: in bf16/fp16
    the different matmul shapes round differently and a near-tie argmax may legitimately flip."""
    cached = measure_inference(model, prompt_ids, new_tokens, True, repeats)
    uncached = measure_inference(model, prompt_ids, new_tokens, False, repeats)
    return {
        "cache": cached,
        "no_cache": uncached,
        "tokens_match": cached["token_ids"] == uncached["token_ids"],
        "speedup": cached["tokens_per_s"] / uncached["tokens_per_s"],
    }


def inference_prompt(tok: Any, prompts: list[str], n_tokens: int) -> torch.Tensor:
    """[1, n_tokens] prompt ids cut from real prompts (repeated when short): latency on what the
    model will be asked, not on arbitrary ids."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        for p in prompts:
            ids += tok(p, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:n_tokens]])
