"""GPU speed: what posttrain's own step and sampler paths get out of one GPU, phase by phase.

One process, one script, sized for at most ~6 minutes on one H100/H200 with model builds and
compilation included; the JSON (`--out`) is rewritten after every measurement, so a run cut
short keeps what it measured.

SFT phases (random-init models of the real Qwen2.5 shapes, bf16 base, LoRA r16 on all linears
with fp32 masters, the stage's own functions: `place_model` (autocast), `compile_blocks`
(`infra.compile`), padding-free packed rows of ~1k tokens (`flat_batch`), the loss through the
chunked head (`forward_nll_sum`), clipping and fused AdamW. One micro-batch of T tokens per
step (`batch.by_tokens: T`). Per configuration: tokens/s, MFU (posttrain's LoRA convention:
4N + 2 x trainable + attention, `train_flops_per_token`), step time, compile seconds apart,
peak allocated memory, kernels per step and the GPU-busy share (kernel time over step time,
from one profiled step), mean and max board power (NVML) over the timed steps. Variants:
eager vs compiled blocks, flash varlen attention on/off (off = the gather-SDPA path), and the
LM head variants. A configuration that runs out of memory is recorded as such and retried
with activation checkpointing.

Sampling phase: GRPO-style sampling of 128 prompts x 256 new tokens on the 0.5B shape with a
non-zero LoRA, in tokens/s, today's path (`generate` on the training model) beside the others.

    python bench/gpu_speed.py --out gpu_speed.json          # on a GPU machine
    python bench/gpu_speed.py --cpu-smoke                   # every phase shrunk, on CPU

On a machine whose stack is older (torch 2.11+cu130, transformers 5.17), install the pinned
transformers 5.24.0 and peft 0.21.2 from wheels beside it first (docs/benchmarks.md shows the
command). Needs no hub access.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROW_TOKENS = 1024  # packed rows of ~1k tokens, as the targets are stated
PROMPT_TOKENS = 64  # of each row, not scored (a chat prompt)


@dataclass(frozen=True)
class Config:
    """One SFT measurement: a shape, tokens per step and the switches."""

    shape: str
    tokens: int
    compiled: bool = False
    varlen: bool = True  # flash varlen attention where usable; False = gather-SDPA
    head: str = "chunked"

    @property
    def name(self) -> str:
        mode = "compiled" if self.compiled else "eager"
        att = "flash-varlen" if self.varlen else "sdpa-gather"
        size = f"{self.tokens // 1024}k" if self.tokens >= 1024 else str(self.tokens)
        return f"{self.shape} {size} tokens {mode} {att} head={self.head}"


@dataclass
class Results:
    """Everything measured so far; written to `path` after every measurement."""

    path: Path | None
    env: dict[str, Any] = field(default_factory=dict)
    sft: list[dict[str, Any]] = field(default_factory=list)
    sampling: list[dict[str, Any]] = field(default_factory=list)

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(asdict(self) | {"path": str(self.path)}, indent=1))


def gpu_plan() -> list[Config]:
    """The GPU run: eager before compiled on each shape (compiling replaces the blocks' forward
    for good), the largest step last (it is the one that may not fit)."""
    plan = [
        Config("qwen2.5-0.5b", 16384, varlen=False),
        *(Config("qwen2.5-0.5b", t) for t in (4096, 16384, 32768)),
        *(Config("qwen2.5-0.5b", t, compiled=True) for t in (4096, 16384, 32768)),
        *(Config("qwen2.5-0.5b", t, compiled=True, head="compiled") for t in (16384, 65536)),
        Config("qwen2.5-1.5b", 16384),
        Config("qwen2.5-1.5b", 16384, compiled=True),
        *(Config("qwen2.5-1.5b", t, compiled=True, head="compiled") for t in (16384, 32768)),
        *(Config("qwen2.5-3b", t, compiled=True, head="compiled") for t in (16384, 32768)),
    ]
    return plan


def smoke_plan() -> list[Config]:
    """Every switch once, shrunk: two step sizes, eager and compiled, both attention paths,
    both heads."""
    return [
        Config("qwen2.5-0.5b", 512, varlen=False),
        Config("qwen2.5-0.5b", 512),
        Config("qwen2.5-0.5b", 256, compiled=True),
        Config("qwen2.5-0.5b", 512, compiled=True),
        Config("qwen2.5-0.5b", 512, compiled=True, head="compiled"),
    ]


# The smoke's shapes: every named shape shrunk to this (the code path, not the arithmetic).
SMOKE_SHAPE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "embedding_rows": 512,
}


class _Tok:
    """What `posttrain.models.tiny.build_model` reads of a tokenizer."""

    pad_token_id, eos_token_id = 0, 1

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def build_base(shape: str, device: torch.device, smoke: bool) -> Any:
    """A random-init causal LM of a named shape (`ingest.from_config.shape`), built on the
    device (a 3B model's init on the host would take longer than its steps), bf16 on CUDA."""
    from posttrain.kinds.ingest import MODEL_SHAPES, FromConfigModel
    from posttrain.models.tiny import build_model

    fields = MODEL_SHAPES[shape] | (SMOKE_SHAPE if smoke else {})
    cfg = FromConfigModel(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        base = build_model(cfg, _Tok(cfg.vocab_size))
    return base.to(torch.bfloat16) if device.type == "cuda" else base


def lora_config() -> Any:
    from posttrain.sections.shared import LoraConfig

    return LoraConfig(r=16, alpha=32)  # the project's default targets: every linear


def sft_model(shape: str, device: torch.device, mesh: Any, smoke: bool) -> Any:
    """The SFT stage's model on one device: base + LoRA, placed as the stage places it."""
    from posttrain.distributed.fsdp import place_model
    from posttrain.models.lora import apply_lora, prepare_for_training

    base = build_base(shape, device, smoke)
    prepare_for_training(base, activation_checkpointing=False)
    model = apply_lora(base, lora_config())
    precision, dtype = precision_of(device)
    return place_model(model, mesh, precision, dtype).train()


def precision_of(device: torch.device) -> tuple[str, torch.dtype]:
    """bf16 compute with a bf16 base on CUDA; fp32 on CPU (bf16 matmul is ~100x slower)."""
    return ("bf16", torch.bfloat16) if device.type == "cuda" else ("fp32", torch.float32)


def packed_batch(tokens: int, vocab: int, seed: int) -> dict[str, Any]:
    """`tokens` tokens of packed rows of ~ROW_TOKENS each (lengths vary by +-25%, so each step
    lays out differently, as packed data does), the first PROMPT_TOKENS of each row unscored."""
    from posttrain.data.chat import IGNORE
    from posttrain.data.segments import flat_batch

    g = torch.Generator().manual_seed(seed)
    rows, left = [], tokens
    while left > 0:
        n = min(left, int(torch.randint(ROW_TOKENS * 3 // 4, ROW_TOKENS * 5 // 4, (), generator=g)))
        n = max(n, 2)
        ids = torch.randint(2, vocab, (n,), generator=g).tolist()
        prompt = min(PROMPT_TOKENS, n // 2)
        rows.append({"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]})
        left -= n
    return flat_batch(rows)


class Stepper:
    """The SFT stage's step on one micro-batch: forward through the chunked head, mean token
    NLL, backward, clip at 1.0, fused AdamW (`build_optimizer`), zero; the loss and the norm
    read once, as the stage's guard reads them."""

    def __init__(self, model: Any, chunk: int) -> None:
        from posttrain.sections.shared import OptimConfig
        from posttrain.train.optim import build_optimizer

        self.model, self.chunk = model, chunk
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.trainable, OptimConfig(lr=1e-5))

    def __call__(self, batch: dict[str, Any]) -> float:
        from posttrain.train.forward_logps import forward_nll_sum

        nll, n = forward_nll_sum(self.model, batch, self.chunk)
        loss = nll / n
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, 1.0)
        loss_f, _ = torch.stack([loss.detach().double(), norm.double()]).tolist()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_f


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def kernels_of_step(fn: Callable[[], Any], device: torch.device) -> tuple[int, float]:
    """(kernels launched, seconds of kernel time) in one profiled step: CUDA kernels on a GPU,
    aten operators (and no kernel time) on CPU."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    events = prof.events()
    if device.type == "cuda":
        cuda = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(cuda), sum(e.device_time for e in cuda) / 1e6
    return sum(1 for e in events if e.name.startswith("aten::")), 0.0


class Power:
    """Board power (W) sampled every 100 ms from NVML while active; nothing on CPU or without
    nvidia-ml-py."""

    def __init__(self, device: torch.device) -> None:
        self.handle, self.nvml = None, None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        except Exception as e:  # noqa: BLE001 - no NVML: the figure is left out, said why
            print(f"  (no NVML power readings: {e})")

    @contextlib.contextmanager
    def sampling(self) -> Iterator[list[float]]:
        watts: list[float] = []
        if self.handle is None:
            yield watts
            return
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(0.1):
                watts.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        try:
            yield watts
        finally:
            stop.set()
            t.join()


@contextlib.contextmanager
def attention_path(varlen: bool) -> Iterator[None]:
    """varlen=False: the gather-SDPA path even where torch's flash varlen kernel is usable (the
    module's probe result, set aside for the duration)."""
    from posttrain.models import flash_varlen

    kept = flash_varlen.VARLEN_ATTN
    if not varlen:
        flash_varlen.VARLEN_ATTN = None
    try:
        yield
    finally:
        flash_varlen.VARLEN_ATTN = kept


def head_variant(compiled: bool) -> Callable[[Any], None]:
    """Switch a placed model's LM head to the chunked head run eagerly or each chunk's work
    compiled (`infra.logits_head: chunked | compiled`)."""

    def switch(model: Any) -> None:
        from posttrain.models.chunked import output_head
        from posttrain.models.compiled_head import use_compiled_head

        use_compiled_head(output_head(model), compiled)

    return switch


# LM head variants: name -> how a placed model is switched to it (`infra.logits_head`).
HEADS: dict[str, Callable[[Any], None]] = {
    "chunked": head_variant(False),
    "compiled": head_variant(True),
}


@dataclass
class Held:
    """The model of the shape being measured, and how far it has been taken."""

    shape: str
    model: Any
    stepper: Any
    flops_per_token: Callable[[int], float]  # of the rows' attention length
    compiled: bool = False
    checkpointing: bool = False


def hold(held: Held | None, cfg: Config, device: torch.device, mesh: Any, smoke: bool) -> Held:
    """The model for `cfg`: the one held if its shape matches (compiled now if `cfg` asks),
    else a new one, the old one freed first."""
    from posttrain.models.compile import compile_blocks
    from posttrain.telemetry.metrics import matmul_params, train_flops_per_token

    if held is None or held.shape != cfg.shape:
        held = None
        free(device)
        model = sft_model(cfg.shape, device, mesh, smoke)
        c = model.config
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_matmul = matmul_params(model)

        def flops(seq: int) -> float:
            return train_flops_per_token(
                n_matmul, trainable, c.num_hidden_layers, c.hidden_size, seq
            )

        held = Held(cfg.shape, model, Stepper(model, 2048), flops)
    if cfg.compiled and not held.compiled:
        compile_blocks(held.model)
        held.compiled = True
    HEADS[cfg.head](held.model)
    return held


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def checkpointing(held: Held) -> None:
    """Activation checkpointing on (non-reentrant, as `prepare_for_training` sets it)."""
    held.model.get_base_model().gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    held.checkpointing = True


def measure(cfg: Config, held: Held, device: torch.device, args: argparse.Namespace) -> dict:
    """Warm-up steps (compilation counted apart), timed steps with power sampled, one profiled
    step; every step a new packed layout."""
    from posttrain.models.compile import CompileStats
    from posttrain.train.loop import to_device

    vocab = held.model.get_output_embeddings().weight.size(0)
    n = args.warmup + args.steps + 1
    batches = [to_device(packed_batch(cfg.tokens, vocab, seed), device) for seed in range(n)]
    out: dict[str, Any] = {"config": cfg.name, **asdict(cfg)}
    with attention_path(cfg.varlen):
        before = CompileStats.now()
        warm = [timed(lambda b=b: held.stepper(b), device) for b in batches[: args.warmup]]
        out |= CompileStats.now().since(before) | {"warmup_s": [round(t, 3) for t in warm]}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with args.power.sampling() as watts:
            times = [
                timed(lambda b=b: held.stepper(b), device)
                for b in batches[args.warmup : args.warmup + args.steps]
            ]
        kernels, busy_s = kernels_of_step(lambda: held.stepper(batches[-1]), device)
    step = statistics.median(times)
    tps = cfg.tokens / step
    # Attention's share per token goes with the rows' length: sum(L^2) / sum(L) over the steps.
    lengths = [n for b in batches for n in b["segments"].lengths]
    seq = round(sum(n * n for n in lengths) / sum(lengths))
    out |= {
        "step_s": round(step, 4),
        "tokens_per_s": round(tps),
        "mfu": round(held.flops_per_token(seq) * tps / args.peak_flops, 4),
        "row_tokens": seq,
        "kernels_per_step": kernels,
        "gpu_busy": round(busy_s / step, 3) if busy_s else None,
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        if device.type == "cuda"
        else None,
        "power_w_mean": round(statistics.mean(watts), 1) if watts else None,
        "power_w_max": round(max(watts), 1) if watts else None,
        "checkpointing": held.checkpointing,
        "graphs_total": CompileStats.now().graphs,
    }
    return out


def run_sft(
    plan: list[Config], device: torch.device, mesh: Any, args: argparse.Namespace, results: Results
) -> None:
    """Each configuration in turn; one that does not fit is retried with checkpointing; past
    the time budget the rest are recorded as skipped."""
    held = None
    for cfg in plan:
        if time.monotonic() > args.deadline:
            results.sft.append({"config": cfg.name, "skipped": "time budget"})
            continue
        held = hold(held, cfg, device, mesh, args.cpu_smoke)
        try:
            row = measure(cfg, held, device, args)
        except torch.OutOfMemoryError:
            held.stepper.opt.zero_grad(set_to_none=True)
            free(device)
            results.sft.append({"config": cfg.name, "oom": True})
            results.save()
            if held.checkpointing:
                continue
            checkpointing(held)
            try:
                row = measure(cfg, held, device, args)
            except torch.OutOfMemoryError:
                free(device)
                row = {"config": cfg.name, "oom": True, "checkpointing": True}
        results.sft.append(row)
        results.save()
        print(sft_line(row), flush=True)
    del held
    free(device)


def sft_line(row: dict[str, Any]) -> str:
    if "tokens_per_s" not in row:
        return f"  {row['config']}: {'out of memory' if row.get('oom') else row.get('skipped')}"
    mem = f", peak {row['peak_gib']} GiB" if row["peak_gib"] is not None else ""
    busy = f", GPU busy {row['gpu_busy']:.0%}" if row["gpu_busy"] is not None else ""
    watts = f", {row['power_w_mean']} W" if row["power_w_mean"] else ""
    ckpt = " (checkpointing)" if row["checkpointing"] else ""
    ops = "aten ops" if row["gpu_busy"] is None else "kernels"
    return (
        f"  {row['config']}{ckpt}: {row['tokens_per_s']:,} tok/s, MFU {row['mfu']:.1%}, step "
        f"{row['step_s'] * 1e3:.0f} ms, {row['kernels_per_step']:,} {ops}/step{busy}{mem}"
        f"{watts}; compile {row['compile_s']} s ({row['graphs_compiled']} graphs)"
    )


def policy_model(shape: str, device: torch.device, mesh: Any, smoke: bool) -> Any:
    """The RL stages' model: the base with a non-zero LoRA as the `policy` adapter, in a
    `RoleModel`, placed as the stage places it, `generate` under its autocast as
    `posttrain.rl.setup` registers it."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from posttrain.distributed.fsdp import forward_method, place_model
    from posttrain.models.adapters import POLICY
    from posttrain.models.roles import RoleModel

    base = build_base(shape, device, smoke)
    peft_cfg = PeftLoraConfig(
        r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False
    )
    lm = get_peft_model(base, peft_cfg, adapter_name=POLICY)
    precision, dtype = precision_of(device)
    model = place_model(RoleModel(lm, None, None), mesh, precision, dtype)
    forward_method(model, "generate")
    return model


def prompts_of(n: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of 32-96 tokens (GRPO groups share prompts; the engine sees rows)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 97, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (k,), generator=g).tolist() for k in lens]


def new_tokens(response: torch.Tensor, stops: list[int]) -> int:
    """Tokens sampled in a right-padded response [N, R]: up to and including each row's stop."""
    hit = torch.isin(response, torch.tensor(stops))
    first = torch.where(hit.any(1), hit.float().argmax(1) + 1, response.size(1))
    return int(first.sum())


def hf_engine(drop_finished: bool) -> Callable[[Any], Any]:
    def make(model: Any) -> Any:
        from posttrain.models.adapters import POLICY
        from posttrain.rl.rollout.engine import HFEngine

        return HFEngine(model, POLICY, 1, drop_finished=drop_finished)

    return make


def fast_engine(compile_decode: bool) -> Callable[[Any], Any]:
    """`rollout.engine: fast`: its own merged copy of the policy (built and probed here, so
    the first timed call is the warm-up's), static KV cache, decode step compiled or not."""

    def make(model: Any) -> Any:
        from posttrain.models.adapters import POLICY
        from posttrain.rl.rollout.engines import build_engine
        from posttrain.sections.shared import RolloutConfig

        cfg = RolloutConfig(engine="fast", compile_decode=compile_decode)
        return build_engine(cfg, model, POLICY, 1, chunk_tokens=2048)

    return make


# Sampling engines: name -> engine of a placed policy model. "hf generate" is today's default.
ENGINES: dict[str, Callable[[Any], Any]] = {
    "hf generate": hf_engine(False),
    "hf drop_finished": hf_engine(True),
    "fast eager": fast_engine(False),
    "fast compiled": fast_engine(True),
}


def run_sampling(
    device: torch.device, mesh: Any, args: argparse.Namespace, results: Results
) -> None:
    """Each engine samples the same prompts, after a small warm-up call timed apart."""
    from posttrain.rl.rollout.sample import sampling_of
    from posttrain.sections.shared import RolloutConfig

    model = policy_model("qwen2.5-0.5b", device, mesh, args.cpu_smoke)
    vocab = model.causal_lm.get_output_embeddings().weight.size(0)
    prompts = prompts_of(args.prompts, vocab, seed=7)
    cfg = RolloutConfig(
        prompts_per_step=args.prompts, samples_per_prompt=1, max_new_tokens=args.new_tokens
    )
    sampling = sampling_of(cfg)
    for name, make in ENGINES.items():
        if time.monotonic() > args.deadline:
            results.sampling.append({"engine": name, "skipped": "time budget"})
            continue
        built = time.perf_counter()
        engine = make(model)
        row = {"engine": name, "build_s": round(time.perf_counter() - built, 3)}
        row |= sample_with(engine, prompts, sampling, device, args)
        del engine
        results.sampling.append(row)
        results.save()
        print(
            f"  {name}: {row['tokens_per_s']:,} tok/s ({row['new_tokens']:,} tokens in "
            f"{row['seconds']} s; first call {row['first_call_s']} s)",
            flush=True,
        )
    del model
    free(device)


def sample_with(
    engine: Any, prompts: list[list[int]], sampling: Any, device: torch.device, args: Any
) -> dict[str, Any]:
    """The call twice (another seed the second time), the second one timed with power sampled:
    the first compiles what a compiled engine compiles for this batch size and cache length,
    and is reported apart."""
    stops = [_Tok.eos_token_id]
    first = timed(lambda: engine.generate(prompts, sampling, stops, 0, 1), device)
    box: list[torch.Tensor] = []
    with args.power.sampling() as watts:
        t = timed(lambda: box.append(engine.generate(prompts, sampling, stops, 0, 2)), device)
    n = new_tokens(box[0], stops)
    return {
        "prompts": len(prompts),
        "max_new_tokens": sampling.max_new_tokens,
        "new_tokens": n,
        "seconds": round(t, 3),
        "tokens_per_s": round(n / t),
        "first_call_s": round(first, 3),
        "power_w_mean": round(statistics.mean(watts), 1) if watts else None,
    }


def environment(device: torch.device) -> dict[str, Any]:
    import peft
    import transformers

    from posttrain.models import flash_varlen

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "flash_varlen": flash_varlen.VARLEN_ATTN is not None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    with contextlib.suppress(ImportError):
        import triton

        env["triton"] = triton.__version__
    return env


def peak_flops(device: torch.device) -> float:
    from posttrain.telemetry.metrics import gpu_peak_flops, measure_cpu_matmul_peak

    if device.type == "cuda":
        peak = gpu_peak_flops(torch.cuda.get_device_name(device), "bf16")
        if peak is None:
            raise SystemExit(f"no bf16 peak known for {torch.cuda.get_device_name(device)}")
        return peak
    return measure_cpu_matmul_peak()


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="JSON written after every measurement")
    ap.add_argument("--cpu-smoke", action="store_true", help="every phase shrunk, on CPU")
    ap.add_argument("--budget-s", type=float, default=330, help="stop starting phases after")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (compile here)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--prompts", type=int, default=128, help="sampling: prompts")
    ap.add_argument("--new-tokens", type=int, default=256, help="sampling: tokens each")
    ap.add_argument("--phases", default="sft,sampling", help="comma list: sft, sampling")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 2)
        args.prompts, args.new_tokens = min(args.prompts, 4), min(args.new_tokens, 8)
    return args


def main(argv: list[str] | None = None) -> Results:
    from posttrain.distributed.runtime import init_distributed, shutdown

    args = parse(argv)
    args.deadline = time.monotonic() + args.budget_s
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke for the shrunk CPU path")
    d = init_distributed("cpu" if args.cpu_smoke else "cuda", 600, 2 if args.cpu_smoke else None)
    results = Results(args.out, env=environment(d.device))
    args.peak_flops, args.power = peak_flops(d.device), Power(d.device)
    results.env["peak_tflops"] = round(args.peak_flops / 1e12, 1)
    results.save()
    print(" ".join(f"{k} {v}" for k, v in results.env.items()), flush=True)
    phases = args.phases.split(",")
    try:
        if "sft" in phases:
            print("LoRA SFT steps (tokens per step, packed ~1k-token rows):", flush=True)
            run_sft(smoke_plan() if args.cpu_smoke else gpu_plan(), d.device, d.mesh, args, results)
        if "sampling" in phases:
            print(f"sampling {args.prompts} prompts x {args.new_tokens} tokens:", flush=True)
            run_sampling(d.device, d.mesh, args, results)
    finally:
        shutdown()
    return results


if __name__ == "__main__":
    main()
