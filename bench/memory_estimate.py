"""Memory pre-flight estimate vs the measured peak of one real training step, on CPU.

For each configuration, a fresh child process loads a saved base the way the stage does
(`load_causal_lm` / `load_score_model` / `policy_with_reference` / `build_roles`), applies
activation checkpointing and LoRA as the stage does, shards it with `shard_model` at world size
one, builds AdamW, and runs one training step at full length (micro x seq tokens, no padding):
the forward, the stage's loss, backward, clipping, the optimizer step. The ppo configuration
first samples a rollout with the real `sample` (KV cache, keep_gathered) and then takes one
PPO-shaped update (policy pass with log-probs and entropy, then the critic's pass).

Each measure is its own child (the parent never imports torch: Linux carries ru_maxrss across
fork+exec, so a big parent would hide the children's peaks):
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

    .venv/bin/python bench/memory_estimate.py                       # every configuration
    .venv/bin/python bench/memory_estimate.py sft dpo --measures allocated
    .venv/bin/python bench/memory_estimate.py --json out.json
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
LORA = {"r": 16, "targets": "all-linear"}
MEASURES = ("allocated", "rss", "rss-fixed-mmap")
CONFIGS: dict[str, dict[str, Any]] = {
    "sft": {"kind": "sft", "model": MEDIUM, "micro": 8, "seq": 256},
    "sft-ac": {"kind": "sft", "model": MEDIUM, "micro": 8, "seq": 256, "ac": True},
    "sft-vocab": {"kind": "sft", "model": WIDE_VOCAB, "micro": 8, "seq": 256},
    "reward": {"kind": "reward", "model": MEDIUM, "micro": 4, "seq": 256},
    "dpo": {"kind": "dpo", "model": MEDIUM, "micro": 4, "seq": 256},
    "ppo": {
        "kind": "ppo",
        "model": MEDIUM,
        "micro": 8,
        "prompt": 64,
        "new": 64,
        "rows": 16,
        "keep_gathered": True,
    },
}


def stage_shape(cfg: dict[str, Any]) -> StageShape:
    """The StageShape the pre-flight would build for this configuration."""
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
            "ppo",
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
        )
    return StageShape(
        kind,
        micro_batch=cfg["micro"],
        seq_len=cfg["seq"],
        adapters=adapters,
        score_head="trainable" if kind == "reward" else "none",
        activation_checkpointing=cfg.get("ac", False),
    )


# ---------------------------------------------------------------------------------------------
# Children (each in its own process)


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def prepare_child(model_cfg: dict[str, Any], folder: Path) -> None:
    """A random-init base saved as the ingest stage saves one, plus an SFT (causal LM) and a
    reward (sequence classifier + score head) LoRA adapter on it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from posttrain.config.schema import LoraConfig
    from posttrain.models.lora import apply_lora

    torch.manual_seed(0)
    config = LlamaConfig(**model_cfg, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder / "base")
    lora = LoraConfig(r=LORA["r"], alpha=2 * LORA["r"], target_modules=LORA["targets"])
    base = LlamaForCausalLM.from_pretrained(folder / "base")
    apply_lora(base, lora).save_pretrained(folder / "sft")
    score = LlamaForSequenceClassification.from_pretrained(folder / "base", num_labels=1)
    score.config.pad_token_id = 0
    apply_lora(score, lora, task_type="SEQ_CLS").save_pretrained(folder / "reward")


def measure_child(name: str, folder: Path, threads: int, profile: bool) -> dict[str, Any]:
    """One configuration's real step in this process: the RSS after the imports, and the peak
    RSS or (`profile`) the peak of bytes held by live tensors from loading to the step's end."""
    import peft  # noqa: F401  (every import a stage has made before its pre-flight)
    import torch
    import transformers  # noqa: F401

    from posttrain.config.schema import LoraConfig, OptimConfig, RolloutConfig
    from posttrain.distributed.fsdp import shard_model
    from posttrain.distributed.runtime import init_distributed, shutdown
    from posttrain.models.adapters import POLICY, REFERENCE, active_adapter, policy_with_reference
    from posttrain.models.loading import load_causal_lm
    from posttrain.models.lora import apply_lora, prepare_for_training
    from posttrain.models.reward import load_score_model, pair_scores
    from posttrain.models.roles import VALUE, build_roles
    from posttrain.train.losses import bradley_terry_loss, sequence_logps, token_nll_sum
    from posttrain.train.optim import build_optimizer
    from posttrain.train.rl_losses import entropy_from_logits, token_logps
    from posttrain.train.rollout import sample

    cfg = CONFIGS[name]
    d = init_distributed("cpu", 600, threads)
    baseline = _rss_kib()

    def step() -> None:
        """Build the stage's model as the stage does, then one training step."""
        kind, ac = cfg["kind"], cfg.get("ac", False)
        vocab = cfg["model"]["vocab_size"]
        base_dir = folder / "base"
        g = torch.Generator().manual_seed(0)
        lora = LoraConfig(r=LORA["r"], alpha=2 * LORA["r"], target_modules=LORA["targets"])
        if kind == "sft":
            model = load_causal_lm(base_dir)
            prepare_for_training(model, ac)
            model = apply_lora(model, lora)
        elif kind == "reward":
            model = load_score_model(base_dir, pad_token_id=0)
            prepare_for_training(model, ac)
            model = apply_lora(model, lora, task_type="SEQ_CLS")
        elif kind == "dpo":
            model = load_causal_lm(base_dir)
            prepare_for_training(model, ac)
            model = policy_with_reference(model, folder / "sft")
        else:
            model = load_causal_lm(base_dir)
            prepare_for_training(model, ac)
            model = build_roles(model, folder / "sft", folder / "reward", critic=True)
        model = shard_model(model, d.mesh, "fp32")
        if kind == "ppo":  # as the stage does: decoding runs on the sharded policy
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(model, "generate")
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(trainable, OptimConfig(lr=1e-4))

        def tokens(rows: int, length: int) -> dict[str, torch.Tensor]:
            # Ordinary ids (no pad 0, no eos 1), every position real: the full micro x seq load.
            ids = torch.randint(2, vocab, (rows, length), generator=g)
            return {
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "position_ids": torch.arange(length).expand(rows, length).contiguous(),
            }

        if kind == "sft":
            b = tokens(cfg["micro"], cfg["seq"])
            out = model(**b).logits  # [B, T, V]
            nll, n = token_nll_sum(out, b["input_ids"])
            del out
            (nll / n).backward()
        elif kind == "reward":
            b = tokens(2 * cfg["micro"], cfg["seq"])
            rc, rr = pair_scores(model, b)
            bradley_terry_loss(rc, rr).mean().backward()
        elif kind == "dpo":
            b = {**tokens(2 * cfg["micro"], cfg["seq"])}
            b["labels"] = b["input_ids"]
            with torch.no_grad(), active_adapter(model, REFERENCE):
                ref = sequence_logps(model(**b).logits, b["labels"])[0]
            logits = model(**b).logits  # [2B, T, V]
            pol, _ = sequence_logps(logits, b["labels"])
            del logits
            half = pol.size(0) // 2
            margin = (pol[:half] - ref[:half]) - (pol[half:] - ref[half:])
            (-torch.nn.functional.logsigmoid(0.1 * margin)).mean().backward()
        else:
            rollout = RolloutConfig(
                prompts_per_step=cfg["rows"],
                max_new_tokens=cfg["new"],
                keep_gathered=cfg["keep_gathered"],
            )
            prompts = torch.randint(2, vocab, (cfg["rows"], cfg["prompt"]), generator=g).tolist()
            ro = sample(model, prompts, [[]] * cfg["rows"], rollout, 0, 1, 0, 1)
            b = tokens(cfg["micro"], cfg["prompt"] + cfg["new"])
            span = {"start": cfg["prompt"] - 1, "stop": cfg["prompt"] + cfg["new"] - 1}
            response = b["input_ids"][:, cfg["prompt"] :]
            logits = model(POLICY, **b, **span)  # [B, R, V]
            logp = token_logps(logits, response)
            ent = entropy_from_logits(logits)
            del logits
            (-(logp.exp() * 1.0).mean() - 0.01 * ent.mean()).backward()
            model(VALUE, **b, **span).pow(2).mean().backward()
            del ro
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if not profile:
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        shutdown()
        return {"baseline_kib": baseline, "peak_kib": peak}
    # torch's CPU allocator reports every allocation and free to the profiler: the running sum
    # of those events is the bytes held by live tensors, its maximum the allocated peak (what
    # torch.cuda.max_memory_allocated measures on a GPU).
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = allocated = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        allocated = max(allocated, live)
    shutdown()
    return {"baseline_kib": baseline, "allocated_peak_bytes": allocated}


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


def run_config(
    name: str, work: Path, threads: int = 1, measures: tuple[str, ...] = MEASURES
) -> dict[str, Any]:
    """Prepare the configuration's base (once per model), measure one step in a child per
    measure, and put the estimate beside each: `allocated` (runtime RSS + the peak of live
    tensor bytes), `rss` (peak RSS, glibc defaults), `rss-fixed-mmap` (peak RSS with
    MALLOC_MMAP_THRESHOLD_=65536: freed tensors go back to the OS at once)."""
    cfg = CONFIGS[name]
    model_key = "medium" if cfg["model"] is MEDIUM else "wide-vocab"
    folder = work / model_key
    if not (folder / "reward").exists():
        _child(["--prepare", model_key, str(folder)])
    model = ModelShape.from_hf_config(json.loads((folder / "base" / "config.json").read_text()))
    out: dict[str, Any] = {"config": name}
    for measure in measures:
        args = ["--measure", name, str(folder), str(threads)]
        env = {"MALLOC_MMAP_THRESHOLD_": "65536"} if measure == "rss-fixed-mmap" else {}
        m = _child(args + (["profile"] if measure == "allocated" else []), env)
        baseline = m["baseline_kib"] * 1024
        if measure == "allocated":
            peak = baseline + m["allocated_peak_bytes"]
        else:
            peak = m["peak_kib"] * 1024
        # The framework row is this child's runtime, as the pre-flight reads it on CPU.
        est = estimate(model, stage_shape(cfg), DeviceLayout(), overhead_bytes=baseline)
        out["estimate_gib"] = est.total / GIB
        out["runtime_gib"] = baseline / GIB
        out[f"{measure}_gib"] = peak / GIB
        out[f"ratio_{measure}"] = est.total / peak
        # Above the runtime: what the model, its state and the step add.
        out[f"ratio_{measure}_above_runtime"] = (est.total - baseline) / max(1, peak - baseline)
        out["components_mib"] = {
            r.name + (f" [{r.phase}]" if r.phase else ""): round(r.bytes / 2**20, 1)
            for r in est.rows
        }
    return out


def print_row(r: dict[str, Any]) -> None:
    parts = [f"{r['config']:<10} estimate {r['estimate_gib']:.3f} GiB"]
    for measure in MEASURES:
        if f"{measure}_gib" in r:
            parts.append(
                f"{measure} {r[f'{measure}_gib']:.3f} (x{r[f'ratio_{measure}']:.2f}, above "
                f"runtime x{r[f'ratio_{measure}_above_runtime']:.2f})"
            )
    print("  ".join(parts) + f"  runtime {r['runtime_gib']:.3f}", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--prepare":
        prepare_child(MEDIUM if sys.argv[2] == "medium" else WIDE_VOCAB, Path(sys.argv[3]))
        print(json.dumps({"ok": True}))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        profile = len(sys.argv) > 5 and sys.argv[5] == "profile"
        print(json.dumps(measure_child(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), profile)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help=f"some of {', '.join(CONFIGS)} (default: all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per child")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument(
        "--measures",
        default=",".join(MEASURES),
        help=f"comma-separated, of {', '.join(MEASURES)} (one child process each)",
    )
    args = ap.parse_args()
    if unknown := set(args.configs) - set(CONFIGS):
        ap.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-estimate-") as tmp:
        for name in args.configs or list(CONFIGS):
            rows.append(run_config(name, Path(tmp), args.threads, tuple(args.measures.split(","))))
            print_row(rows[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
