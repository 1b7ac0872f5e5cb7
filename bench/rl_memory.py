"""RL roles: memory on one base vs four full models, and the share of PPO time spent generating.

Side by side in one run: the four RL roles co-located on one base vs four separately loaded
models (memory), and the real ppo stage with keep_gathered on vs off (time).

Part 1 (memory). A fresh workspace gets an ingest (a from-config base big enough that its
weights dominate process memory), a short SFT adapter and a short reward adapter. Then, each in
its own process so that peaks don't mix:
  co-located  `build_roles(..., critic=True)` (one base, four LoRA adapters + two heads),
              sharded once by `shard_model` at world size 1, as the ppo stage holds it;
  separate    four separately loaded models: policy (base + SFT LoRA, trainable), reference
              (base + SFT LoRA, frozen), critic (sequence-classification base + reward LoRA and
              score head, trainable) and reward model (`load_reward_model`, frozen), each sharded
              by `shard_model` as every model of every stage is.
Both run one forward per role on the same small batch and one PPO-like update: a policy and a
value backward (one per role, as the stage's update does) and an AdamW step. Reported: the exact
parameter bytes (numel x element size of unique parameters), and the peak RSS (getrusage
ru_maxrss) minus the RSS right after the imports, i.e. without the Python/torch runtime.

Part 2 (time). The real ppo stage (`tests/stage_helpers.run_inprocess`) for a few rollouts on
the same artifacts, once with `ppo.rollout.keep_gathered=true` (every sharded block gathered
once per rollout) and once with `=false` (every block gathered at every decoded token), each in
its own process. From metrics.jsonl: mean generation / scoring / training / step seconds and
generation_share (the first step left out as warm-up when there are 3+).

The parent never imports torch: Linux carries ru_maxrss across fork+exec, so a big parent would
hide its children's own peaks. Every child runs `--threads` torch threads (default 1): on a
2-core machine shared with another process, two OpenMP threads made decoding ~30x slower.

    .venv/bin/python bench/rl_memory.py             # default: 4 rollouts per PPO run
    .venv/bin/python bench/rl_memory.py --quick     # 2 rollouts per PPO run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before anything imports transformers (in the children too, which inherit the environment).
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]

from tiny_models import stage_helpers  # noqa: E402 (bench/, the script's folder, is on the path)

# A base whose fp32 weights (~100 MB) stand well above the activations of the small batch below.
BASE = {
    "hidden_size": 512,
    "num_layers": 8,
    "num_heads": 8,
    "intermediate_size": 1408,
    "vocab_size": 4096,
    "max_position_embeddings": 256,
    # A handful of warm-up steps: the weights only need to exist, not to be good.
    "pretrain_steps": 5,
    "pretrain_batch_size": 8,
    "pretrain_seq_len": 64,
    # vocab_size is an upper bound: the BPE stops when the synthetic corpus has no merges left
    # (about 800 tokens here), which the report prints.
    "corpus_examples": 2000,
}
LORA = {"r": 8, "alpha": 16}
PAIRS = {
    "synthetic": {"n_examples": 40},
    "eval_fraction": 0.2,
    "max_seq_len": 64,
    "max_prompt_len": 40,
}
RECIPE: dict[str, Any] = {
    "run": {"name": "rl-memory", "seed": 0},
    "infra": {"device": "cpu", "devices_per_node": 1},
    "ingest": {"source": "from_config", "from_config": BASE},
    "sft": {
        "data": {"synthetic": {"n_examples": 120}, "eval_fraction": 0.1, "max_seq_len": 64},
        "lora": LORA,
        "optim": {"lr": 1e-2},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 3,
        "checkpoint_every": 0,
    },
    "reward": {
        "data": PAIRS,
        "lora": LORA,
        "optim": {"lr": 1e-2},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 3,
        "checkpoint_every": 0,
    },
    "ppo": {
        "data": {
            "synthetic": {"n_examples": 120, "seed": 7},
            "eval_fraction": 0.1,
            "max_prompt_len": 40,
        },
        "rollout": {"prompts_per_step": 8, "max_new_tokens": 16},
        "optim": {"lr": 5e-3},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 4,
        "checkpoint_every": 0,
        # The stage's closing held-out evaluation samples from the reference and the policy: keep
        # it small, it is not what is measured here.
        "eval_prompts": 4,
        "max_kl": None,  # no quality gate: these few steps measure time, not learning
    },
}
# Sequences, prompt and response tokens of the memory batch: a PPO micro-batch's shape, small
# enough that its activations stay below the base's weights.
MEM_BATCH, MEM_PROMPT, MEM_RESPONSE = 4, 24, 24
CONFIGS = ("co-located", "separate")
STEP_KEYS = ("generation_s", "scoring_s", "training_s", "step_time_s", "generation_share")


# ---------------------------------------------------------------------------------------------
# Process memory (Linux)


def proc_kib(key: str) -> int:
    """A "Key:  N kB" field of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _mib(kib: float) -> float:
    return kib / 1024


# ---------------------------------------------------------------------------------------------
# Children


def prepare_child(work: Path, threads: int) -> dict[str, Any]:
    """ingest, sft and reward in this process, in a fresh workspace under `work`."""
    helpers = stage_helpers()
    work.mkdir(parents=True, exist_ok=True)
    # threads_per_rank is no fingerprint input: the ppo runs reuse these parents whatever it is.
    data = {**RECIPE, "infra": {**RECIPE["infra"], "threads_per_rank": threads}}
    recipe = helpers.write_recipe(work, data)
    out: dict[str, Any] = {"recipe": str(recipe)}
    for stage in ("ingest", "sft", "reward"):
        t = time.perf_counter()
        out[stage] = str(helpers.run_inprocess(stage, recipe))
        out[f"{stage}_s"] = time.perf_counter() - t
    manifest = json.loads((Path(out["ingest"]) / "manifest.json").read_text())
    out["base_params"] = manifest["summary"]["num_params"]
    out["vocab_size"] = manifest["summary"]["vocab_size"]
    return out


def param_bytes(*modules: Any) -> int:
    """numel x element size of every parameter, each counted once (tied weights are one
    Parameter object; separately loaded models have distinct ones)."""
    unique = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in unique.values())


def memory_batch(vocab: int) -> dict[str, Any]:
    """A fixed [B, P+R] batch of ordinary tokens (ids above the special tokens, so nothing is
    read as padding), no padding: every configuration sees the same work."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(16, vocab, (MEM_BATCH, MEM_PROMPT + MEM_RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.size(1)).expand_as(ids).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def policy_loss(logits: Any, ids: Any) -> Any:
    """Stand-in for the clipped policy loss, same shapes: mean response-token log-prob."""
    import torch

    return -torch.log_softmax(logits.float(), -1).gather(-1, ids[:, MEM_PROMPT:, None]).mean()


def value_loss(values: Any) -> Any:
    """Stand-in for the clipped value loss, same shapes: mean squared per-token value."""
    return values.float().pow(2).mean()


def colocated_models(d: Any, ingest: Path, sft: Path, reward: Path) -> tuple[Any, int, Any]:
    """(step function, parameter bytes, trainable parameters) of the stage's RoleModel."""
    import torch

    from posttrain.distributed.fsdp import shard_model
    from posttrain.models.adapters import POLICY, REFERENCE
    from posttrain.models.loading import load_base
    from posttrain.models.lora import prepare_for_training
    from posttrain.models.roles import REWARD, VALUE, build_roles

    base, _ = load_base(ingest, json.loads((ingest / "manifest.json").read_text()))
    prepare_for_training(base, activation_checkpointing=False)
    roles = build_roles(base, sft / "adapter", reward / "adapter", critic=True)
    held = param_bytes(roles)  # before sharding: plain tensors, exact fp32 sizes
    roles = shard_model(roles, d.mesh, "fp32")
    span = {"start": MEM_PROMPT - 1, "stop": MEM_PROMPT + MEM_RESPONSE - 1}

    def step(b: dict[str, Any]) -> float:
        with torch.no_grad():
            roles(REFERENCE, **b, **span)
            roles(REWARD, **b)
        pg = policy_loss(roles(POLICY, **b, **span), b["input_ids"])
        pg.backward()
        vf = value_loss(roles(VALUE, **b, **span))
        vf.backward()
        return float(pg.detach() + vf.detach())

    return step, held, [p for p in roles.parameters() if p.requires_grad]


def separate_models(d: Any, ingest: Path, sft: Path, reward: Path) -> tuple[Any, int, Any]:
    """(step function, parameter bytes, trainable parameters) of four stand-alone models."""
    import torch
    from peft import PeftModel

    from posttrain.distributed.fsdp import shard_model
    from posttrain.models.loading import load_base
    from posttrain.models.lora import prepare_for_training
    from posttrain.models.reward import load_reward_model, load_score_model

    manifest = json.loads((ingest / "manifest.json").read_text())
    model_dir = manifest["summary"]["model_dir"]

    def causal(trainable: bool) -> Any:
        base, tok = load_base(ingest, manifest)
        prepare_for_training(base, activation_checkpointing=False)
        return PeftModel.from_pretrained(base, str(sft / "adapter"), is_trainable=trainable), tok

    policy, tok = causal(True)
    reference, _ = causal(False)
    reference.requires_grad_(False)
    critic = load_score_model(model_dir, tok.pad_token_id)
    critic.config.use_cache = False
    # is_trainable: LoRA and the score head (peft modules_to_save) train, as the value role does.
    critic = PeftModel.from_pretrained(critic, str(reward / "adapter"), is_trainable=True)
    rm = load_reward_model(model_dir, reward / "adapter", tok.pad_token_id)
    rm.requires_grad_(False)
    held = param_bytes(policy, reference, critic, rm)
    models = [shard_model(m, d.mesh, "fp32") for m in (policy, reference, critic, rm)]
    policy, reference, critic, rm = models
    reference.eval()
    rm.eval()
    # The sequence classifier scores every position and returns only the last one: the score
    # head's full output [B, T, 1] is the per-token value, captured on its way (with its graph).
    # It goes through the root forward, which a sharded model needs to gather its weights.
    score_out: dict[str, Any] = {}
    head = critic.get_base_model().score
    head.register_forward_hook(lambda _m, _i, out: score_out.__setitem__("v", out))
    keep = MEM_RESPONSE + 1  # logits of positions P-1 .. T-1; the last one is dropped below

    def step(b: dict[str, Any]) -> float:
        ids, mask = b["input_ids"], b["attention_mask"]
        with torch.no_grad():
            reference(**b, logits_to_keep=keep)
            rm(input_ids=ids, attention_mask=mask)
        logits = policy(**b, logits_to_keep=keep).logits[:, :-1]
        pg = policy_loss(logits, ids)
        pg.backward()
        pooled = critic(input_ids=ids, attention_mask=mask).logits
        # The zero term puts the root output in the graph: FSDP unshards the root's parameters
        # (the score head among them) for backward from a hook on that output, which a loss on
        # the captured values alone would bypass.
        vf = value_loss(score_out.pop("v")[:, MEM_PROMPT - 1 : -1, 0]) + 0.0 * pooled.sum()
        vf.backward()
        return float(pg.detach() + vf.detach())

    return step, held, [p for m in models for p in m.parameters() if p.requires_grad]


def memory_child(
    config: str, ingest: Path, sft: Path, reward: Path, threads: int
) -> dict[str, Any]:
    """One configuration in this process: build, one forward per role, one update; memory."""
    # Everything either configuration imports, before the baseline: the runtime is left out.
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import posttrain.distributed.fsdp  # noqa: F401
    import posttrain.models.loading  # noqa: F401
    import posttrain.models.lora  # noqa: F401
    import posttrain.models.reward  # noqa: F401
    import posttrain.models.roles  # noqa: F401
    from posttrain.distributed.runtime import init_distributed, shutdown

    d = init_distributed("cpu", 600, threads)  # a world of one, as in a single-process stage
    after_import = proc_kib("VmRSS")
    build = colocated_models if config == "co-located" else separate_models
    t = time.perf_counter()
    step, held, trainable = build(d, ingest, sft, reward)
    loaded = {"rss": proc_kib("VmRSS"), "peak": peak_kib()}
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    vocab = json.loads((ingest / "manifest.json").read_text())["summary"]["vocab_size"]
    loss = step(memory_batch(vocab))
    opt.step()
    opt.zero_grad(set_to_none=True)
    wall = time.perf_counter() - t
    shutdown()
    return {
        "config": config,
        "param_bytes": held,
        "trainable_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "import_rss_kib": after_import,
        "load_rss_kib": loaded["rss"],
        "load_peak_kib": loaded["peak"],
        "peak_kib": peak_kib(),
        "vm_hwm_kib": proc_kib("VmHWM"),  # this mm's own high-water mark, for a cross-check
        "end_rss_kib": proc_kib("VmRSS"),
        "end_anon_kib": proc_kib("RssAnon"),
        "end_file_kib": proc_kib("RssFile"),
        "above_import_kib": peak_kib() - after_import,
        "loss": loss,
        "wall_s": wall,
    }


def ppo_child(recipe: Path, keep_gathered: str, rollouts: int) -> dict[str, Any]:
    """The real ppo stage in this process; per-step means from its metrics.jsonl."""
    helpers = stage_helpers()
    from posttrain.telemetry.records import read_metrics

    over = (f"ppo.rollout.keep_gathered={keep_gathered}", f"ppo.max_steps={rollouts}")
    t = time.perf_counter()
    out = helpers.run_inprocess("ppo", recipe, *over)
    wall = time.perf_counter() - t
    rows = read_metrics(out / "metrics.jsonl", "train")
    assert len(rows) == rollouts, f"{out}: {len(rows)} train records, expected {rollouts}"
    used = rows[1:] if len(rows) >= 3 else rows  # the first step pays one-off warm-up costs
    means = {k: sum(r[k] for r in used) / len(used) for k in STEP_KEYS}
    return {
        "keep_gathered": keep_gathered,
        "steps": len(rows),
        "steps_used": len(used),
        **means,
        "tokens_per_s": sum(r["tokens_per_s"] for r in used) / len(used),
        "response_len": sum(r["response_len"] for r in used) / len(used),
        "mem_peak_rss_gib": max(r["mem_peak_rss_gib"] for r in rows),
        "stage_wall_s": wall,
        "out_dir": str(out),
    }


def run_child(*argv: str, threads: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """This script in a fresh process; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, __file__, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), **(env or {})},
    )
    if proc.returncode:
        sys.exit(
            f"child {' '.join(argv[:3])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


# glibc otherwise raises its mmap threshold as buffers are freed and keeps later activation
# buffers in the heap, which it rarely returns: RSS would then grow with every forward by what the
# allocator caches (measured: +400 MB here), not by what is live. A fixed threshold hands every
# large buffer back on free, so peak RSS follows the live memory of both configurations alike.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


# ---------------------------------------------------------------------------------------------
# Report


def table(hdr: tuple[str, ...], rows: list[list[str]]) -> None:
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        print(" | ".join(r))


def _above(m: dict[str, Any], key: str) -> float:
    """MiB of a KiB figure above the child's post-import RSS."""
    return _mib(m[key] - m["import_rss_kib"])


def report_memory(prep: dict[str, Any], mem: dict[str, dict[str, Any]]) -> None:
    co, se = mem["co-located"], mem["separate"]
    base_mib = 4 * prep["base_params"] / 2**20
    runtime = f"{_mib(co['import_rss_kib']):.0f} / {_mib(se['import_rss_kib']):.0f} MB"
    print(
        "\n".join(
            [
                "",
                "1. Memory of the four RL roles (policy, reference, value, reward); each "
                "configuration runs in",
                "   its own process.",
                "   co-located  one base + four LoRA adapters + score and value heads (build_roles)",
                "   separate    four separately loaded models: policy and reference (base + SFT "
                "LoRA), critic and",
                "               reward model (sequence classifier + reward LoRA and score head)",
                "   Every model sharded by shard_model at world size 1 (FSDP2 copies the weights "
                "out of the read-only",
                "   safetensors mapping: each model's weights are its own memory), then one "
                "forward per role and a",
                f"   policy + value backward and AdamW step on {MEM_BATCH} x "
                f"{MEM_PROMPT + MEM_RESPONSE} tokens.",
                "   param MB: exact bytes of unique parameters. peak above imports: ru_maxrss "
                "minus the RSS right after",
                f"   importing torch/transformers/peft/posttrain (that runtime, {runtime}, is "
                "left out); (at load): the",
                "   same, taken once the models are built and sharded, before any forward. live "
                "after step: RSS above",
                f"   imports at the end. fp32 base: {prep['base_params']:,} params = "
                f"{base_mib:.1f} MB (vocabulary {prep['vocab_size']}).",
                "",
            ]
        )
    )
    rows = [
        [
            c,
            f"{m['param_bytes'] / 2**20:.1f}",
            f"{m['trainable_bytes'] / 2**20:.2f}",
            f"{_mib(m['above_import_kib']):.0f}",
            f"{_above(m, 'load_peak_kib'):.0f}",
            f"{_above(m, 'end_rss_kib'):.0f}",
            f"{_mib(m['peak_kib']):.0f}",
            f"{m['wall_s']:.1f}",
        ]
        for c, m in mem.items()
    ]
    rows.append(
        [
            "separate/co-located",
            f"{se['param_bytes'] / co['param_bytes']:.2f}x",
            f"{se['trainable_bytes'] / co['trainable_bytes']:.2f}x",
            f"{se['above_import_kib'] / co['above_import_kib']:.2f}x",
            f"{_above(se, 'load_peak_kib') / _above(co, 'load_peak_kib'):.2f}x",
            f"{_above(se, 'end_rss_kib') / _above(co, 'end_rss_kib'):.2f}x",
            f"{se['peak_kib'] / co['peak_kib']:.2f}x",
            "",
        ]
    )
    table(
        (
            "config",
            "param MB",
            "trainable MB",
            "peak above imports MB",
            "(at load)",
            "live after step MB",
            "peak RSS MB",
            "build+step s",
        ),
        rows,
    )
    saved_param = (se["param_bytes"] - co["param_bytes"]) / 2**20
    saved_peak = _mib(se["above_import_kib"] - co["above_import_kib"])
    hwm_ok = all(abs(m["vm_hwm_kib"] - m["peak_kib"]) < 1024 for m in mem.values())
    same_loss = abs(co["loss"] - se["loss"]) < 1e-4
    # Where each peak is: at load (sharding a model briefly holds its mapped file pages and FSDP's
    # copy of them) or in the step (activations and gradients on top of the weights).
    where = [
        "at load" if _above(m, "load_peak_kib") > 0.95 * _mib(m["above_import_kib"]) else "in step"
        for m in (co, se)
    ]
    print(
        f"\n=> Co-locating holds {saved_param:.0f} MB less parameter memory "
        f"({saved_param / base_mib:.2f} base copies; {se['param_bytes'] / co['param_bytes']:.2f}x "
        f"less) and peaks {saved_peak:.0f} MB lower above imports "
        f"({se['above_import_kib'] / co['above_import_kib']:.2f}x less). Peaks, in base sizes: "
        f"co-located {_mib(co['above_import_kib']) / base_mib:.1f} ({where[0]}), separate "
        f"{_mib(se['above_import_kib']) / base_mib:.1f} ({where[1]}); live after the step "
        f"{_above(co, 'end_rss_kib') / base_mib:.1f} vs {_above(se, 'end_rss_kib') / base_mib:.1f}."
        f" Losses {co['loss']:.6f} vs {se['loss']:.6f} ({'same' if same_loss else 'DIFFERENT'} "
        f"weights and batch); ru_maxrss {'matches' if hwm_ok else 'DIFFERS from'} each child's "
        "VmHWM to 1 MB."
    )


def report_ppo(runs: dict[str, dict[str, Any]], rollouts: int) -> None:
    on, off = runs["true"], runs["false"]
    skipped = "step 1 left out as warm-up" if on["steps_used"] < on["steps"] else "every step"
    ppo = RECIPE["ppo"]
    print(
        "\n".join(
            [
                "",
                f"2. PPO step time: the real ppo stage, {rollouts} rollouts of "
                f"{ppo['rollout']['prompts_per_step']} prompts x <= "
                f"{ppo['rollout']['max_new_tokens']} new tokens, update micro-batch "
                f"{ppo['batch']['micro_batch_size']};",
                f"   means over steps ({skipped}).",
                "   keep_gathered=true gathers each sharded block once per rollout, false gathers "
                "it again at every",
                "   decoded token. generation / scoring / training / step s and generation share "
                "(generation_s over",
                "   the step's time) are the stage's own metrics; peak RSS is the stage process's "
                "ru_maxrss (runtime",
                "   included).",
                "",
            ]
        )
    )
    rows = [
        [
            r["keep_gathered"],
            *(f"{r[k]:.2f}" for k in STEP_KEYS[:-1]),
            f"{100 * r['generation_share']:.0f}%",
            f"{r['response_len']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['mem_peak_rss_gib'] * 1024:.0f}",
            f"{r['stage_wall_s']:.0f}",
        ]
        for r in (on, off)
    ]
    rows.append(
        [
            "false/true",
            *(f"{off[k] / on[k]:.2f}x" for k in STEP_KEYS[:-1]),
            f"{off['generation_share'] / on['generation_share']:.2f}x",
            "",
            f"{off['tokens_per_s'] / on['tokens_per_s']:.2f}x",
            f"{off['mem_peak_rss_gib'] / on['mem_peak_rss_gib']:.2f}x",
            "",
        ]
    )
    table(
        (
            "keep_gathered",
            "generation s",
            "scoring s",
            "training s",
            "step s",
            "generation share",
            "response len",
            "tokens/s",
            "peak RSS MB",
            "stage wall s",
        ),
        rows,
    )
    ratio = off["generation_s"] / on["generation_s"]
    phases = {k.removesuffix("_s"): on[k] / on["step_time_s"] for k in STEP_KEYS[:3]}
    top = max(phases, key=phases.__getitem__)
    print(
        f"\n=> Generation is {100 * on['generation_share']:.0f}% of a PPO step with "
        f"keep_gathered=true and {100 * off['generation_share']:.0f}% with false (the largest "
        f"phase with true: {top}, {100 * phases[top]:.0f}%). Gathering at every token makes "
        f"generation {ratio:.2f}x {'slower' if ratio > 1 else 'as fast or faster'} and the step "
        f"{off['step_time_s'] / on['step_time_s']:.2f}x as long; peak RSS "
        f"{off['mem_peak_rss_gib'] / on['mem_peak_rss_gib']:.2f}x that of true. Responses "
        f"averaged {on['response_len']:.1f} / {off['response_len']:.1f} tokens (same seeds)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 PPO rollouts per run instead of 4")
    ap.add_argument("--rollouts", type=int, help="PPO rollouts per run (overrides --quick)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per process (default 1: with as many OpenMP threads as cores, a "
        "competing process slowed decoding 30x here; more threads speed up training, not decode)",
    )
    ap.add_argument("--prepare-child", type=Path, help=argparse.SUPPRESS)  # internal: WORK
    ap.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)  # CONFIG INGEST SFT RM
    ap.add_argument("--ppo-child", nargs=3, help=argparse.SUPPRESS)  # RECIPE KEEP ROLLOUTS
    args = ap.parse_args()
    if args.prepare_child:
        print(json.dumps(prepare_child(args.prepare_child, args.threads)))
        return
    if args.memory_child:
        config, *dirs = args.memory_child
        print(json.dumps(memory_child(config, *(Path(x) for x in dirs), args.threads)))
        return
    if args.ppo_child:
        recipe, keep, n = args.ppo_child
        print(json.dumps(ppo_child(Path(recipe), keep, int(n))))
        return
    rollouts = args.rollouts or (2 if args.quick else 4)
    if rollouts < 1:
        ap.error("--rollouts must be at least 1")
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    threads = ("--threads", str(args.threads))
    with tempfile.TemporaryDirectory(prefix="rl_memory_") as tmp:
        prep = run_child("--prepare-child", tmp, *threads, threads=args.threads)
        dirs = (prep["ingest"], prep["sft"], prep["reward"])
        mem = {
            c: run_child("--memory-child", c, *dirs, *threads, threads=args.threads, env=MEMORY_ENV)
            for c in CONFIGS
        }
        # threads_per_rank is in the recipe the prepare child wrote.
        runs = {
            keep: run_child(
                "--ppo-child", prep["recipe"], keep, str(rollouts), threads=args.threads
            )
            for keep in ("true", "false")
        }
    print(
        f"\nRL memory and generation time: fp32 CPU ({os.cpu_count()} cores), {args.threads} "
        f"torch thread(s) per process. Setup in a fresh temporary workspace: ingest "
        f"{prep['ingest_s']:.0f} s, sft {prep['sft_s']:.0f} s, reward {prep['reward_s']:.0f} s."
    )
    report_memory(prep, mem)
    report_ppo(runs, rollouts)
    load1 = os.getloadavg()[0]
    # This run keeps `threads` cores busy; a load average well above that is someone else's.
    busy = max(load0, load1) > args.threads + 0.5
    print(
        f"\n(total wall {time.perf_counter() - t0:.0f} s; 1-min load average {load0:.1f} at the "
        f"start, {load1:.1f} at the end: "
        + (
            f"above this run's {args.threads} thread(s), so other processes (or the tail of an "
            "earlier run) may have shared the CPUs: timings are noisy)"
            if busy
            else "no sign of other processes competing for the CPUs)"
        )
    )
    # Machine-readable figures; the temporary paths are gone by now, so they are left out.
    paths = ("recipe", "ingest", "sft", "reward", "out_dir")
    figures = {
        "prepare": {k: v for k, v in prep.items() if k not in paths},
        "memory": mem,
        "ppo": {k: {f: v for f, v in r.items() if f not in paths} for k, r in runs.items()},
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
