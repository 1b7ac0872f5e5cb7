"""Peak memory of one SFT step and one DPO step, LM head chunked vs unchunked, side by side.

Model: the Qwen2 architecture at reduced depth and width (2 layers, hidden 256) with the REAL
Qwen2.5 vocabulary of 151,936 tokens and tied embeddings, LoRA (r 8) on every linear, sharded by
FSDP2 at world size 1 (gloo), fp32 — the stages' code path, so the head runs inside the root
forward exactly as in training. Each step:
  sft  forward_nll_sum over micro 4 x 256 tokens (the first half of every row a prompt, IGNORE),
       backward of the token-mean NLL;
  dpo  2 pairs (4 sequences) x 256 tokens: reference log-probs (no grad, "reference" adapter)
       and policy log-probs (`forward_sequence_logps`), sigmoid DPO loss, backward.
Peak = the largest sum of bytes held by live tensors during the step, from torch's CPU allocator
events under the profiler (the method of bench/memory_estimate.py: what max_memory_allocated is
on a GPU); the model and batch that exist before the step are not counted. Losses of the two
variants are printed too (they must agree), and the pre-flight estimate's logits term.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/chunked_logits.py
    HF_HUB_OFFLINE=1 .venv/bin/python bench/chunked_logits.py --chunks 1024,256 --seq 512

`--head` compares the two ways of computing each chunk (`infra.logits_head`) on the head alone
instead: eager chunked vs compiled chunk (`posttrain.models.compiled_head`), N scored tokens of a
hidden size H through the 151,936-token vocabulary, forward + backward of a DPO/RL-like
objective (arbitrary gradients on log-probs and entropies) with and without the entropy; time
per call (median of `--reps` after a warm-up call that compiles) and peak bytes allocated
during one call (CUDA: max_memory_allocated; CPU: the profiler's allocator events), with the
eager/compiled ratios. bf16 on CUDA, fp32 on CPU (CPU bf16 matmuls are ~100x slower):

    .venv/bin/python bench/chunked_logits.py --head --tokens 4096 --hidden 896 --chunk 2048
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

MIB = 1024**2
VOCAB = 151_936


def allocated_peak(step: Callable[[], Any]) -> tuple[int, Any, float]:
    """(peak bytes of live tensors allocated during `step`, its result, seconds)."""
    t0 = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    seconds = time.perf_counter() - t0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out, seconds


def build(hidden: int, layers: int, mesh: Any) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from posttrain.distributed.fsdp import shard_model
    from posttrain.models.lora import apply_lora
    from posttrain.sections.shared import LoraConfig

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    model = apply_lora(Qwen2ForCausalLM(cfg), LoraConfig(r=8, alpha=16))
    model.add_adapter("reference", model.peft_config["default"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_(".default." in name)
            if "lora_B.default" in name:  # policy != reference, so the DPO loss is not log 2
                p.normal_(0, 0.02)
    return shard_model(model, mesh, "fp32")


def batch(rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    from posttrain.data.chat import IGNORE

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 2] = IGNORE  # prompt half
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(seq).expand(rows, seq).clone(),
    }


def sft_step(model: Any, b: dict[str, torch.Tensor], chunk: int) -> float:
    from posttrain.train.forward_logps import forward_nll_sum

    nll, n = forward_nll_sum(model, b, chunk)
    loss = nll / n
    loss.backward()
    return float(loss.detach())


def dpo_step(model: Any, b: dict[str, torch.Tensor], chunk: int, beta: float = 0.1) -> float:
    from posttrain.models.adapters import REFERENCE, active_adapter
    from posttrain.train.forward_logps import forward_sequence_logps

    with torch.no_grad(), active_adapter(model, REFERENCE):
        ref, _ = forward_sequence_logps(model, b, chunk)  # [2B]
    pol, _ = forward_sequence_logps(model, b, chunk)
    half = pol.size(0) // 2
    margin = (pol[:half] - ref[:half]) - (pol[half:] - ref[half:])
    loss = -F.logsigmoid(beta * margin).mean()
    loss.backward()
    return float(loss.detach())


def estimate_logits(kind: str, micro: int, seq: int, hidden: int, layers: int, chunk: int) -> int:
    from posttrain.memory.estimate import (
        Adapter,
        DeviceLayout,
        ModelShape,
        StageShape,
        estimate,
    )

    shape = ModelShape(hidden, layers, 4, 2, hidden // 4, 2 * hidden, VOCAB, tied=True)
    adapters = (Adapter("policy", 8, "all-linear", True),)
    st = StageShape(kind, micro, seq, adapters, logits_chunk_tokens=chunk)  # type: ignore[arg-type]
    return estimate(shape, st, DeviceLayout(), 0).component("logits")


def head_call(
    h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int, entropy: bool, compiled: bool
) -> float:
    """One forward + backward through the head alone; returns the objective."""
    from posttrain.models.chunked import chunked_target_logps

    lp, ent = chunked_target_logps(h, w, None, t, chunk, entropy, compiled=compiled)
    obj = lp.sum() - (0.01 * ent.sum() if ent is not None else 0.0)
    obj.backward()
    h.grad = w.grad = None
    return float(obj.detach())


def head_peak(step: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """(peak bytes allocated during `step` above what was live before, its result)."""
    if device.type != "cuda":
        peak, out, _ = allocated_peak(step)
        return peak, out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def head_time(step: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median seconds of `step` over `reps` calls."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def head_bench(tokens: int, hidden: int, chunk: int, reps: int, trained_head: bool) -> None:
    """Eager chunked vs compiled chunk on the head alone; prints a table and the ratios."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(VOCAB, hidden, device=device, dtype=dtype) * hidden**-0.5).requires_grad_(
        trained_head
    )
    t = torch.randint(0, VOCAB, (tokens,), device=device)
    print(
        f"head alone on {device.type} ({dtype}): {tokens} tokens x hidden {hidden} -> vocab "
        f"{VOCAB}, chunk {chunk}, head {'trained' if trained_head else 'frozen'}"
    )
    print(f"{'entropy':8} {'variant':9} {'ms':>9} {'peak MiB':>9} {'objective':>14}")
    for entropy in (False, True):
        rows = {}
        for name, compiled in (("eager", False), ("compiled", True)):
            step = functools.partial(head_call, h, w, t, chunk, entropy, compiled)
            step()  # warm-up: compiles the graphs (compiled) or the allocator's cache
            ms = head_time(step, device, reps) * 1e3
            peak, obj = head_peak(step, device)
            rows[name] = (ms, peak)
            print(f"{entropy!s:8} {name:9} {ms:9.1f} {peak / MIB:9.1f} {obj:14.4f}")
        (te, pe), (tc, pc) = rows["eager"], rows["compiled"]
        print(f"{entropy!s:8} eager/compiled: time {te / tc:.2f}x, peak {pe / pc:.2f}x")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--chunks",
        default="2048,128",
        help="comma-separated chunk sizes to compare with unchunked (2048 = the default "
        "infra.logits_chunk_tokens: here one chunk of all the labelled positions)",
    )
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--head", action="store_true", help="eager vs compiled chunk, head alone")
    ap.add_argument("--tokens", type=int, default=4096, help="--head: scored tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="--head: logits_chunk_tokens")
    ap.add_argument("--reps", type=int, default=5, help="--head: timed calls per variant")
    ap.add_argument("--trained-head", action="store_true", help="--head: the head gets grads")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.head:
        head_bench(args.tokens, args.hidden, args.chunk, args.reps, args.trained_head)
        return

    from posttrain.distributed.runtime import init_distributed, shutdown

    d = init_distributed("cpu", 300, args.threads)
    try:
        model = build(args.hidden, args.layers, d.mesh)
        steps = {
            # kind: (step function, rows per forward, micro in the estimate's units)
            "sft": (sft_step, 4, 4),
            "dpo": (dpo_step, 4, 2),  # 2 pairs: chosen rows, then rejected
        }
        print(
            f"Qwen2 {args.layers} layers, hidden {args.hidden}, vocab {VOCAB}, LoRA r 8, FSDP2 "
            f"world 1, fp32; {args.seq} tokens per row, half of them labelled"
        )
        print(
            f"{'step':5} {'variant':10} {'peak MiB':>9} {'time s':>7} {'loss':>10} "
            f"{'est. logits MiB':>15}"
        )
        for kind, (fn, rows, micro) in steps.items():
            b = batch(rows, args.seq, seed=1)
            peaks = {}
            variants = [("unchunked", 0)] + [
                (f"chunk {c}", c) for c in map(int, args.chunks.split(","))
            ]
            for name, chunk in variants:
                peak, loss, secs = allocated_peak(
                    lambda fn=fn, b=b, chunk=chunk: fn(model, b, chunk)
                )
                for p in model.parameters():
                    p.grad = None
                est = estimate_logits(kind, micro, args.seq, args.hidden, args.layers, chunk)
                peaks[name] = peak
                print(
                    f"{kind:5} {name:10} {peak / MIB:9.1f} {secs:7.2f} {loss:10.6f} "
                    f"{est / MIB:15.1f}"
                )
            for name, peak in peaks.items():
                if name != "unchunked":
                    print(f"{kind:5} unchunked / {name} peak: {peaks['unchunked'] / peak:.2f}x")
    finally:
        shutdown()


if __name__ == "__main__":
    main()
