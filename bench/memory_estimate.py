"""Memory pre-flight estimate vs the measured peak of one real training step, on CPU.

For each configuration, a fresh child process builds the model the way the stage does: the base
on the meta device (`build_on_meta`, as `base_for_training` / `score_model_for_training`),
activation checkpointing and the stage's adapters on it (`apply_lora` / `policy_with_reference`
/ `build_roles`), `shard_model` at world size one, then `fill_from_checkpoint` reads the saved
safetensors into the shards (what `start_session(weights=...)` does); AdamW; and one training
step at full length (micro x seq tokens, no padding, every token labelled) through the stage's
loss: `forward_nll_sum` (sft), `forward_sequence_logps` under the reference then the policy
(dpo), `pair_scores` (reward), backward, clipping, the optimizer step. The ppo configuration
first samples a rollout with the real `sample` (KV cache, keep_gathered) and then takes one
PPO-shaped update (`response_logps` with entropy: the RoleModel's chunked targets, then the
critic's pass). `--chunk` is `infra.logits_chunk_tokens` (default the recipe's 2048; 0 = full
logits), for the step and the estimate alike.

Each measure is its own child (the parent never imports torch: Linux carries ru_maxrss across
fork+exec, so a big parent would hide the children's peaks); `--measures allocated` alone runs
every configuration in one child, since that measure is of each step's own tensors:
  allocated       RSS after the imports (the runtime) + the peak bytes of live tensors from
                  loading to the end of the step, from torch's CPU allocator events (the
                  profiler's memory records): what max_memory_allocated is on a GPU, and what
                  the estimate models.
  rss             peak RSS (ru_maxrss) with glibc's defaults.
  rss-fixed-mmap  peak RSS with MALLOC_MMAP_THRESHOLD_=65536: tensors above 64 KiB are mmapped
                  and go back to the OS when freed, instead of staying in glibc's heap.
Beside each: the estimate (`posttrain.memory.estimate.estimate`, its framework row = the child's
runtime RSS, as the pre-flight reads it on CPU), the ratio estimate / measured, and the same
ratio for what the model and the step add above the runtime.

    .venv/bin/python bench/memory_estimate.py                # the seven small configurations
    .venv/bin/python bench/memory_estimate.py sft dpo --measures allocated --chunk 0
    .venv/bin/python bench/memory_estimate.py --json out.json --components
    .venv/bin/python bench/memory_estimate.py qwen-sft qwen-dpo --measures allocated --work DIR

Measured 2026-12-01 (2 shared cores; allocated peak, GiB; docs/benchmarks.md has the rest):
  small configurations, chunk 2048: estimate / allocated 1.02-1.12 (peak RSS 0.58-0.99,
  fixed mmap threshold 1.00-1.07); unchunked 1.02-1.11.
  Qwen2.5-0.5B shape, micro 4 x 128, LoRA r=16 all-linear:
    sft  chunk 2048  estimate 4.878  allocated 4.549  x1.07
    sft  chunk 0     estimate 4.585  allocated 4.329  x1.06
    dpo  chunk 2048  estimate 6.763  allocated 6.315  x1.07
    dpo  chunk 0     estimate 6.713  allocated 6.381  x1.05
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.memory.estimate import (  # noqa: E402  (pure arithmetic: no torch import)
    GIB,
    Adapter,
    DeviceLayout,
    ModelShape,
    StageShape,
    estimate,
)

# A base whose weights, activations and logits are each tens to hundreds of MiB: far above the
# allocator's noise, small enough for a 2-core machine.
MEDIUM = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1408,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
}
# Small body, large vocabulary: the logits are the largest item.
WIDE_VOCAB = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 688,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# Qwen2.5-0.5B's exact shape (494M parameters; the 151,936-row embedding is tied to the head).
QWEN_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}
# model key -> (transformers family, config numbers)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "medium": ("llama", MEDIUM),
    "wide-vocab": ("llama", WIDE_VOCAB),
    "qwen2.5-0.5b": ("qwen2", QWEN_05B),
    "qwen-2-blocks": ("qwen2", {**QWEN_05B, "num_hidden_layers": 2}),
}
LORA = {"r": 16, "targets": "all-linear"}
MEASURES = ("allocated", "rss", "rss-fixed-mmap")
# The recipe default of infra.logits_chunk_tokens.
DEFAULT_CHUNK = 2048
CONFIGS: dict[str, dict[str, Any]] = {
    "sft": {"kind": "sft", "model": "medium", "micro": 8, "seq": 256},
    "sft-ac": {"kind": "sft", "model": "medium", "micro": 8, "seq": 256, "ac": True},
    "sft-vocab": {"kind": "sft", "model": "wide-vocab", "micro": 8, "seq": 256},
    "reward": {"kind": "reward", "model": "medium", "micro": 4, "seq": 256},
    "dpo": {"kind": "dpo", "model": "medium", "micro": 4, "seq": 256},
    "ppo": {
        "kind": "ppo",
        "model": "medium",
        "micro": 8,
        "prompt": 64,
        "new": 64,
        "rows": 16,
        "keep_gathered": True,
    },
    # The real 0.5B shape at the measurement point (2 GB of fp32 weights: minutes per
    # step on a small CPU; not in the default selection).
    "qwen-sft": {"kind": "sft", "model": "qwen2.5-0.5b", "micro": 4, "seq": 128},
    "qwen-dpo": {"kind": "dpo", "model": "qwen2.5-0.5b", "micro": 4, "seq": 128},
    # Its real vocabulary on two blocks: the tied 151,936-row embedding (519 MiB) dominates the
    # gathered weights, the logits the step (seconds per step).
    "sft-qwen-vocab": {"kind": "sft", "model": "qwen-2-blocks", "micro": 4, "seq": 128},
}
DEFAULT_CONFIGS = ("sft", "sft-ac", "sft-vocab", "sft-qwen-vocab", "reward", "dpo", "ppo")


def stage_shape(cfg: dict[str, Any], chunk: int = DEFAULT_CHUNK) -> StageShape:
    """The StageShape the pre-flight would build for this configuration, `chunk` tokens per pass
    through the LM head."""
    kind = cfg["kind"]
    policy = Adapter("policy", LORA["r"], LORA["targets"], True)
    if kind == "sft":
        adapters: tuple[Adapter, ...] = (policy,)
    elif kind == "reward":
        adapters = (Adapter("reward", LORA["r"], LORA["targets"], True),)
    elif kind == "dpo":
        adapters = (policy, Adapter("reference", LORA["r"], LORA["targets"], False))
    else:
        adapters = (
            policy,
            Adapter("reference", LORA["r"], LORA["targets"], False),
            Adapter("reward", LORA["r"], LORA["targets"], False),
            Adapter("value", LORA["r"], LORA["targets"], True),
        )
    if kind == "ppo":
        return StageShape(
            "rl",
            micro_batch=cfg["micro"],
            seq_len=cfg["prompt"] + cfg["new"],
            adapters=adapters,
            score_head="frozen",
            value_head=True,
            logit_positions=cfg["new"],
            rollout_rows=cfg["rows"],
            prompt_len=cfg["prompt"],
            new_tokens=cfg["new"],
            keep_gathered=cfg["keep_gathered"],
            activation_checkpointing=cfg.get("ac", False),
            logits_chunk_tokens=chunk,
        )
    family = {"sft": "lm", "reward": "score", "dpo": "pairs"}[kind]
    return StageShape(
        family,
        label=kind,
        micro_batch=cfg["micro"],
        seq_len=cfg["seq"],
        adapters=adapters,
        score_head="trainable" if kind == "reward" else "none",
        activation_checkpointing=cfg.get("ac", False),
        logits_chunk_tokens=chunk,
    )


# ---------------------------------------------------------------------------------------------
# Children (each in its own process)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def prepare_child(key: str, folder: Path, with_reward: bool) -> None:
    """A random-init base saved as the ingest stage saves one (safetensors), plus an SFT (causal
    LM) LoRA adapter on it and (`with_reward`) a reward (sequence classifier + score head) one."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from posttrain.models.lora import apply_lora
    from posttrain.models.reward import score_model_for_training
    from posttrain.sections.shared import LoraConfig

    torch.manual_seed(0)
    arch, numbers = MODELS[key]
    config_cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    config = config_cls(**numbers, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    base = AutoModelForCausalLM.from_config(config)
    base.save_pretrained(folder / "base")
    lora = LoraConfig(r=LORA["r"], alpha=2 * LORA["r"], target_modules=LORA["targets"])
    apply_lora(base, lora).save_pretrained(folder / "sft")
    del base
    if with_reward:  # adapters on the meta-built score model: only they (and the head) are real
        score, _ = score_model_for_training(folder / "base", 0, torch.float32)
        apply_lora(score, lora, task_type="SEQ_CLS").save_pretrained(folder / "reward")


def _import_stage_modules() -> None:
    """Every import a stage has made before its pre-flight (and `_step` needs): the runtime
    RSS is read after them."""
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import posttrain.distributed.fsdp  # noqa: F401
    import posttrain.models.adapters  # noqa: F401
    import posttrain.models.lora  # noqa: F401
    import posttrain.models.reward  # noqa: F401
    import posttrain.models.roles  # noqa: F401
    import posttrain.models.sharded_load  # noqa: F401
    import posttrain.rl.rollout.engine  # noqa: F401
    import posttrain.rl.rollout.sample  # noqa: F401
    import posttrain.sections.shared  # noqa: F401
    import posttrain.train.forward_logps  # noqa: F401
    import posttrain.train.losses  # noqa: F401
    import posttrain.train.optim  # noqa: F401


def measure_child(
    name: str, folder: Path, threads: int, profile: bool, chunk: int
) -> dict[str, Any]:
    """One configuration's real step in this process: the RSS after the imports, and the peak
    RSS or (`profile`) the peak of bytes held by live tensors from loading to the step's end.
    `chunk`: tokens per pass through the LM head (infra.logits_chunk_tokens; 0 = full logits)."""
    from posttrain.distributed.runtime import init_distributed, shutdown

    _import_stage_modules()
    d = init_distributed("cpu", 600, threads)
    baseline = _rss_kib()
    if not profile:
        _step(name, folder, d, chunk)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        shutdown()
        return {"baseline_kib": baseline, "peak_kib": peak}
    out = {"baseline_kib": baseline, **_profiled_step(name, folder, d, chunk)}
    shutdown()
    return out


def measure_many_child(items: list[tuple[str, int]], work: Path, threads: int) -> list[dict]:
    """The allocated measure of each (configuration, chunk) in turn in this one process,
    preparing each model's base (`prepare_child`) when `work` lacks it: one process start
    instead of one per configuration and base. Same figures as `measure_child`'s: the runtime
    RSS is read once, after the imports and before anything is built, and each step's peak is
    of the bytes its own tensors hold (what earlier steps left is collected first)."""
    import gc

    from posttrain.distributed.runtime import init_distributed, shutdown

    _import_stage_modules()
    d = init_distributed("cpu", 600, threads)
    baseline = _rss_kib()
    out = []
    for name, chunk in items:
        folder = _folder(name, work)
        if _needs_prepare(name, folder):
            prepare_child(CONFIGS[name]["model"], folder, _needs_reward(name))
        gc.collect()
        out.append({"baseline_kib": baseline, **_profiled_step(name, folder, d, chunk)})
    shutdown()
    return out


def _step(name: str, folder: Path, d: Any, chunk: int) -> None:
    """Build the stage's model as the stage does (meta build, adapters, shard, fill each rank's
    rows from the safetensors), then one training step through the stage's loss."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.distributed.fsdp import shard_model
    from posttrain.models.adapters import POLICY, REFERENCE, active_adapter, policy_with_reference
    from posttrain.models.lora import apply_lora, prepare_for_training
    from posttrain.models.reward import pair_scores, score_model_for_training
    from posttrain.models.roles import VALUE, build_roles
    from posttrain.models.sharded_load import build_on_meta, fill_from_checkpoint
    from posttrain.rl.rollout.engines import build_engine
    from posttrain.rl.rollout.sample import response_logps, sample
    from posttrain.sections.shared import LoraConfig, OptimConfig, RolloutConfig
    from posttrain.train.forward_logps import forward_nll_sum, forward_sequence_logps
    from posttrain.train.losses import bradley_terry_loss
    from posttrain.train.optim import build_optimizer

    cfg = CONFIGS[name]
    kind, ac = cfg["kind"], cfg.get("ac", False)
    vocab = MODELS[cfg["model"]][1]["vocab_size"]
    base_dir = folder / "base"
    g = torch.Generator().manual_seed(0)
    lora = LoraConfig(r=LORA["r"], alpha=2 * LORA["r"], target_modules=LORA["targets"])
    if kind == "reward":  # reward.py: score_model_for_training
        model, weights = score_model_for_training(base_dir, 0, torch.float32)
        prepare_for_training(model, ac)
        model = apply_lora(model, lora, task_type="SEQ_CLS")
    else:  # sft.py, dpo.py, rl/setup.py: base_for_training (build_on_meta)
        model, weights = build_on_meta(base_dir, AutoModelForCausalLM, torch.float32)
        prepare_for_training(model, ac)
        if kind == "sft":
            model = apply_lora(model, lora)
        elif kind == "dpo":
            model = policy_with_reference(model, folder / "sft")
        else:
            model = build_roles(model, folder / "sft", folder / "reward", critic=True)
    # start_session(weights=...): shard the meta model, then fill this rank's rows.
    model = shard_model(model, d.mesh, "fp32")
    fill_from_checkpoint(model, weights, d.device)
    if kind == "ppo":  # as the stage does: decoding runs on the sharded policy
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(trainable, OptimConfig(lr=1e-4))

    def tokens(rows: int, length: int) -> dict[str, torch.Tensor]:
        # Ordinary ids (no pad 0, no eos 1), every position real and labelled: the full
        # micro x seq load.
        ids = torch.randint(2, vocab, (rows, length), generator=g)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "position_ids": torch.arange(length).expand(rows, length).contiguous(),
            "labels": ids,
        }

    if kind == "sft":  # sft.py: forward_nll_sum
        b = tokens(cfg["micro"], cfg["seq"])
        nll, n = forward_nll_sum(model, b, chunk)
        (nll / n).backward()
    elif kind == "reward":
        b = tokens(2 * cfg["micro"], cfg["seq"])
        rc, rr = pair_scores(model, b)
        bradley_terry_loss(rc, rr).mean().backward()
    elif kind == "dpo":  # dpo.py: pair_logps = forward_sequence_logps, reference first
        b = tokens(2 * cfg["micro"], cfg["seq"])
        with torch.no_grad(), active_adapter(model, REFERENCE):
            ref = forward_sequence_logps(model, b, chunk)[0]
        pol, _ = forward_sequence_logps(model, b, chunk)
        half = pol.size(0) // 2
        margin = (pol[:half] - ref[:half]) - (pol[half:] - ref[half:])
        (-torch.nn.functional.logsigmoid(0.1 * margin)).mean().backward()
    else:  # rl/update.py: response_logps (RoleModel targets when chunked), then the critic
        rollout = RolloutConfig(
            prompts_per_step=cfg["rows"],
            max_new_tokens=cfg["new"],
            keep_gathered=cfg["keep_gathered"],
        )
        prompts = torch.randint(2, vocab, (cfg["rows"], cfg["prompt"]), generator=g).tolist()
        engine = build_engine(rollout, model, POLICY, 1)
        ro = sample(engine, prompts, [[]] * cfg["rows"], rollout, 0, 1, 0)
        b = tokens(cfg["micro"], cfg["prompt"] + cfg["new"])
        del b["labels"]
        inp = {**b, "start": cfg["prompt"] - 1, "stop": cfg["prompt"] + cfg["new"] - 1}
        response = b["input_ids"][:, cfg["prompt"] :]
        mask = torch.ones_like(response)
        logp, ent = response_logps(model, POLICY, inp, response, mask, chunk, entropy=True)
        assert ent is not None
        (-(logp.exp() * 1.0).mean() - 0.01 * ent.mean()).backward()
        model(VALUE, **inp).pow(2).mean().backward()
        del ro
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _profiled_step(name: str, folder: Path, d: Any, chunk: int) -> dict[str, Any]:
    """`_step` under the profiler: the peak of bytes held by live tensors, and where."""
    # torch's CPU allocator reports every allocation and free to the profiler: the running sum
    # of those events is the bytes held by live tensors, its maximum the allocated peak (what
    # torch.cuda.max_memory_allocated measures on a GPU).
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(name, folder, d, chunk)
    all_events = prof.profiler.kineto_results.events()
    events = [e for e in all_events if e.name() == "[memory]"]
    live = allocated = at = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        if live > allocated:
            allocated, at = live, e.start_ns()
    # Where the peak was reached: the ops running at that instant, outermost first (autograd's
    # "evaluate_function: XBackward0" marks the backward), for telling the estimate's rows apart.
    running = sorted(
        (e for e in all_events if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns()),
        key=lambda e: e.start_ns(),
    )
    return {
        "allocated_peak_bytes": allocated,
        "peak_during": " > ".join(e.name() for e in running),
    }


# ---------------------------------------------------------------------------------------------
# Parent


def _child(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    if out.returncode:
        raise RuntimeError(f"child {args} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _folder(name: str, work: Path) -> Path:
    return work / CONFIGS[name]["model"]


def _needs_reward(name: str) -> bool:
    return CONFIGS[name]["kind"] in ("reward", "ppo")


def _needs_prepare(name: str, folder: Path) -> bool:
    """Whether the configuration's base (and the adapters it starts from) are not saved yet."""
    missing_reward = _needs_reward(name) and not (folder / "reward").exists()
    return not (folder / "sft").exists() or missing_reward


def _beside(out: dict[str, Any], name: str, folder: Path, measure: str, m: dict) -> None:
    """The estimate beside one child's measure `m`, into the row `out`."""
    model = ModelShape.from_hf_config(json.loads((folder / "base" / "config.json").read_text()))
    baseline = m["baseline_kib"] * 1024
    if measure == "allocated":
        peak = baseline + m["allocated_peak_bytes"]
        out["allocated_peak_during"] = m["peak_during"]
    else:
        peak = m["peak_kib"] * 1024
    # The framework row is this child's runtime, as the pre-flight reads it on CPU.
    shape = stage_shape(CONFIGS[name], out["chunk"])
    est = estimate(model, shape, DeviceLayout(), overhead_bytes=baseline)
    out["estimate_gib"] = est.total / GIB
    out["runtime_gib"] = baseline / GIB
    out[f"{measure}_gib"] = peak / GIB
    out[f"ratio_{measure}"] = est.total / peak
    # Above the runtime: what the model, its state and the step add.
    out[f"ratio_{measure}_above_runtime"] = (est.total - baseline) / max(1, peak - baseline)
    out["components_mib"] = {
        r.name + (f" [{r.phase}]" if r.phase else ""): round(r.bytes / 2**20, 1) for r in est.rows
    }


def run_config(
    name: str,
    work: Path,
    threads: int = 1,
    measures: tuple[str, ...] = MEASURES,
    chunk: int = DEFAULT_CHUNK,
) -> dict[str, Any]:
    """Prepare the configuration's base (once per model and `work` folder), measure one step in
    a child per measure, and put the estimate beside each: `allocated` (runtime RSS + the peak
    of live tensor bytes), `rss` (peak RSS, glibc defaults), `rss-fixed-mmap` (peak RSS with
    MALLOC_MMAP_THRESHOLD_=65536: freed tensors go back to the OS at once). `chunk`: tokens per
    pass through the LM head (infra.logits_chunk_tokens; 0 = full logits)."""
    folder = _folder(name, work)
    if _needs_prepare(name, folder):
        reward = "reward" if _needs_reward(name) else "-"
        _child(["--prepare", CONFIGS[name]["model"], str(folder), reward])
    out: dict[str, Any] = {"config": name, "chunk": chunk}
    for measure in measures:
        args = ["--measure", name, str(folder), str(threads), str(chunk)]
        env = {"MALLOC_MMAP_THRESHOLD_": "65536"} if measure == "rss-fixed-mmap" else {}
        m = _child(args + (["profile"] if measure == "allocated" else []), env)
        _beside(out, name, folder, measure, m)
    return out


def run_configs_allocated(
    items: list[tuple[str, int]], work: Path, threads: int = 1
) -> list[dict[str, Any]]:
    """`run_config(name, work, threads, ("allocated",), chunk)` for each (name, chunk), all
    prepared and measured in one child (`measure_many_child`): the allocated peak is the step's
    own tensors, so it needs no fresh process per configuration as peak RSS does."""
    arg = json.dumps([list(item) for item in items])
    got = _child(["--measure-many", arg, str(work), str(threads)])["rows"]
    rows = []
    for (name, chunk), m in zip(items, got, strict=True):
        out: dict[str, Any] = {"config": name, "chunk": chunk}
        _beside(out, name, _folder(name, work), "allocated", m)
        rows.append(out)
    return rows


def print_row(r: dict[str, Any], components: bool = False) -> None:
    parts = [f"{r['config']:<10} chunk {r['chunk']:<5} estimate {r['estimate_gib']:.3f} GiB"]
    for measure in MEASURES:
        if f"{measure}_gib" in r:
            parts.append(
                f"{measure} {r[f'{measure}_gib']:.3f} (x{r[f'ratio_{measure}']:.2f}, above "
                f"runtime x{r[f'ratio_{measure}_above_runtime']:.2f})"
            )
    print("  ".join(parts) + f"  runtime {r['runtime_gib']:.3f}", flush=True)
    if components:
        if "allocated_peak_during" in r:
            print(f"    allocated peak during: {r['allocated_peak_during'] or '?'}", flush=True)
        for k, v in r["components_mib"].items():
            print(f"    {k:<32} {v:>10.1f} MiB", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--prepare":
        prepare_child(sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "reward")
        print(json.dumps({"ok": True}))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--measure-many":
        items = [(n, int(c)) for n, c in json.loads(sys.argv[2])]
        rows = measure_many_child(items, Path(sys.argv[3]), int(sys.argv[4]))
        print(json.dumps({"rows": rows}))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        name, folder, threads, chunk = sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5]
        profile = len(sys.argv) > 6 and sys.argv[6] == "profile"
        print(json.dumps(measure_child(name, folder, int(threads), profile, int(chunk))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "configs", nargs="*", help=f"some of {', '.join(CONFIGS)} (default: {DEFAULT_CONFIGS})"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument(
        "--measures",
        default=",".join(MEASURES),
        help=f"comma-separated, of {', '.join(MEASURES)} (one child process each)",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help="tokens per pass through the LM head (infra.logits_chunk_tokens; 0 = full logits)",
    )
    ap.add_argument(
        "--work",
        help="keep the saved bases here and reuse them (default: a temporary folder); the "
        "0.5B base is 2 GB and takes minutes to write",
    )
    ap.add_argument(
        "--components",
        action="store_true",
        help="print the estimate's rows and the ops running at the allocated peak",
    )
    args = ap.parse_args()
    if unknown := set(args.configs) - set(CONFIGS):
        ap.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-estimate-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        names, measures = args.configs or list(DEFAULT_CONFIGS), tuple(args.measures.split(","))
        if measures == ("allocated",):  # one child for them all (printed at the end)
            items = [(name, args.chunk) for name in names]
            rows = run_configs_allocated(items, work, args.threads)
            for row in rows:
                print_row(row, args.components)
        else:
            for name in names:
                rows.append(run_config(name, work, args.threads, measures, args.chunk))
                print_row(rows[-1], args.components)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
