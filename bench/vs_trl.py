"""posttrain vs TRL 1.16: real-token throughput of the SFT and DPO stages, and the GRPO step
time, side by side.

For each model size (Llama built by the project's own ingest `from_config`) and stage, in this one
invocation:
  posttrain  the real stage process (`python -m posttrain.stages.sft|dpo --spec s`), with its
             defaults; figures from its metrics.jsonl train records (`tokens` = attention-mask
             sum = real tokens, `step_time_s`, `loss`).
  TRL        `trl.SFTTrainer` / `trl.DPOTrainer` in a fresh process of its own (so both sides pay
             the same interpreter state), on the same base folder (ingest `model/`, `tokenizer/`),
             the same rows already tokenized by the project (`sft_data.prepare` /
             `pref_prepare.prepare`: both sides compute the loss on exactly the same tokens), in
             the stage's batch order (the rows laid out in `step_indices` order, read
             sequentially), the same LoRA (r, alpha, dropout, all-linear), AdamW (betas, eps,
             weight decay), lr and cosine schedule, grad clipping, micro-batch, accumulation,
             max length, steps and seed; fp32 on CPU, no eval, no checkpoints, `report_to=[]`.
             DPO: policy = base + the SFT stage's adapter, reference = a frozen copy of it on the
             same base (what the dpo stage does, and what TRL does for a PEFT model with an
             adapter), sigmoid loss, the same beta. TRL's other defaults are kept (what users
             run); the ones that matter are printed. Timing: a TrainerCallback's
             on_step_begin -> on_step_end wall time plus the default collator's time for the
             step's micro-batches (the stage's step time includes its collation); real tokens =
             attention-mask sum of each collated micro-batch.
Both sides skip the first 3 steps (warm-up) in tokens/s and mean step time. The table shows
posttrain/TRL real tokens/s, and the loss check: the first step's loss must agree to 1e-3
relative (same base, rows and LoRA B = 0, so it is the SFT step's base-model loss, and the DPO
step's log 2 with policy = reference), the last losses side by side. Both sides seed torch with the
run seed right before the adapter is created, so the new SFT adapters start equal too and the
trajectories agree to float noise (measured: last losses within 1e-6 at the tiny size).

Both sides run one after the other, so on a shared machine a burst of load from other processes
hits one side and not the other: measured here, the same configuration gave posttrain/TRL from
0.08x to 21x as the load moved. Besides the mean (tokens over seconds), the table gives the ratio
of the median step's rate and of the upper-quartile step's rate ("fast"; load only ever slows a
step); every step is in the --json output. Quote figures from an idle machine.

GRPO row (`--stages grpo`; the issue's shape, at `--sizes 11m`, an 11.4M Llama):
  posttrain  the real grpo stage process, a `stages:` entry starting from the SFT stage's
             adapter (LoRA r16): quickstart synthetic prompts, rollout.prompts_per_step 8 x
             samples_per_prompt 8, max_new_tokens 32, the built-in reward
             `posttrain.rewards.match:exact_match`, kl.coef 0, one update epoch with micro 64 x
             accum 1 = the rollout's 64 sequences (one optimizer step, so no scoring pass:
             `posttrain.rl.setup.scoring_passes`), activation_checkpointing off, sampling at the
             section's defaults (temperature 1, no top-k/top-p). Nothing else is tuned unless
             asked: `--grpo-set key.path=value` sets a field of this stage's recipe entry, e.g.
             `rollout.drop_finished=true` (the stage's own decode loop that drops finished
             rows: a recipe setting a user would set, and fair: the same tokens as `generate`
             for the same seed, up to float ties; TRL's nearest option,
             use_transformers_continuous_batching, stays at its default, off). The setting is
             shown in the table; TRL follows any sampling field it changes.
  TRL        `trl.GRPOTrainer` in its own process on the same base + SFT adapter (trainable, no
             reference: beta 0), the same prompts in the stage's per-step order (checked: TRL
             renders them to the stage's prompt ids and stops at the stage's stop ids), the same
             reward function (the stage's own `exact_match`, fed the `answer` column),
             num_generations 8, the stage's micro-batch and accumulation (64 x 1 unless
             `--grpo-set batch.micro_batch_size=16 batch.grad_accum_steps=4`; one generation of
             8 prompts x 8 samples and one optimizer step per step), max_completion_length 32, the
             same temperature/top-k/top-p, clip range, group-std scaling, token-mean loss
             (TRL's `dapo`), lr, AdamW, schedule and grad clipping; gradient checkpointing off
             (unless --trl-gradient-checkpointing on), fp32 CPU, no vLLM, `report_to=[]`.
  Timing: posttrain's train records' `step_time_s` (with their generation_s, scoring_s and
  training_s split); TRL's on_step_begin -> on_step_end, and a timer around its generate call.
  Both skip the first 3 steps; the table shows mean, median and lower-quartile ("fast") step
  times, their ratio posttrain/TRL (below 1: posttrain is faster; the issue's target is
  <= 0.85x), and each side's mean completion length (flagged when they differ by over 10%: the
  sides sample with different random streams, so their tokens differ, but the lengths of a
  policy that rarely stops early are comparable). No loss check: the samples differ.
  Measured on 2 cores with nothing else running, `--stages grpo --sizes 11m --steps 15`:
  posttrain 3.79 s vs TRL 4.72 s median step (0.80x; generation 2.17 s, scoring 0.01 s, update
  1.64 s against TRL's generation 1.93 s), completion lengths 16.2 / 16.1. Before the update
  laid its rows end to end (`batch.padding_free`, decision 61), the update took 2.37 s and the
  step 4.32 s vs 4.97 s (0.87x); with `--grpo-set rollout.drop_finished=true` then 4.12 s vs
  4.56 s (0.90x; generation 1.75 s). Either side's median moved by up to 8% between runs of
  the same command. With gradient accumulation on both sides (`--steps 12 --grpo-set
  batch.micro_batch_size=16 --grpo-set batch.grad_accum_steps=4`, 2 shared cores, two runs):
  median step ratio 0.85x and 0.89x (update 1.29-1.32 s, TRL's 1.73-1.79 s), docs/speed.md.

    pip install -e .[bench]                     # trl==1.16.0; not a runtime dependency
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl.py            # 20 steps, small+medium, sft+dpo
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl.py --steps 40 --sizes medium --stages dpo \\
        --threads 2 --json vs_trl.json
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl.py --trl-gradient-checkpointing off
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl.py --stages grpo --sizes 11m --steps 15
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl.py --stages grpo --sizes 11m --steps 15 \\
        --grpo-set rollout.drop_finished=true
    HF_HUB_OFFLINE=1 .venv/bin/python bench/vs_trl.py --stages sft,dpo,grpo --sizes small
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import ingest_section, stage_process  # noqa: E402 (bench/, on the path above)
from vs_trl_trainers import (  # noqa: E402
    grpo_section,
    stage_dirs,
    trl_dpo,
    trl_grpo,
    trl_sft,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # ~4.9M and ~26M parameters with the 2048-token vocabulary below.
    "small": {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 688},
    "medium": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "intermediate_size": 1376},
    # The GRPO issue's "11M Llama": 10.9M parameters as the ingest builds it (base_params).
    "11m": {"hidden_size": 384, "num_layers": 6, "num_heads": 6, "intermediate_size": 1024},
    # Tests only: seconds per run.
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128},
}
STAGES = ("sft", "dpo", "grpo")  # also the order they run in (dpo and grpo start from sft)
WARMUP = 3  # steps left out of tokens/s and step time, on both sides
# The GRPO row's shape (the issue's): 8 prompts x 8 samples, 32 new tokens, one update.
GRPO_PROMPTS, GRPO_SAMPLES, GRPO_NEW_TOKENS = 8, 8, 32
# The GRPO row's phases, as the stage's train records name them (`posttrain.rl.metrics`).
RL_SPLIT = ("generation_s", "scoring_s", "training_s")
LENGTH_RTOL = 0.1  # mean completion lengths further apart than this are flagged
TARGET_TIME_RATIO = 0.85  # the target: posttrain's GRPO step <= 0.85x TRL's
FIRST_LOSS_RTOL = 1e-3
TRL_MISSING = "trl is not installed: pip install -e .[bench]"


def recipe_for(
    size: dict, steps: int, workspace: Path, threads: int, grpo_set: dict[str, Any] | None = None
) -> dict:
    """One recipe, ingest -> sft -> dpo, and grpo from sft. Stage defaults everywhere the
    comparison allows; warm-up 0 because the stage's warm-up factor is (s+1)/w and
    transformers' is s/w. `grpo_set`: recipe settings of the grpo stage (`with_settings`)."""
    common = {
        "optim": {"lr": 1e-3, "schedule": "cosine", "warmup_steps": 0},
        "batch": {"micro_batch_size": 16, "grad_accum_steps": 1},
        "max_steps": steps,
        "checkpoint_every": 0,
    }
    return {
        "run": {"name": "vs-trl", "workspace": str(workspace), "seed": 0},
        "infra": {"device": "cpu", "devices_per_node": 1, "threads_per_rank": threads},
        "ingest": ingest_section(size),
        "sft": {
            "data": {"synthetic": {"n_examples": 2000}, "max_seq_len": 96},
            "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
            **common,
        },
        "dpo": {
            "data": {
                "synthetic": {"n_examples": 1000},
                "max_seq_len": 96,
                "max_prompt_len": 64,
            },
            "loss": "sigmoid",
            "beta": 0.1,
            **common,
            "optim": {**common["optim"], "lr": 5e-4},
        },
        "stages": [with_settings(grpo_entry(steps), grpo_set or {})],
    }


def grpo_entry(steps: int) -> dict:
    """The GRPO stage, a `stages:` entry so that it can start from the SFT adapter (`from`)
    while the recipe also has a dpo stage (a shorthand `grpo:` would start from dpo's policy).
    The issue's shape: exact-match reward, no KL, one update epoch of one minibatch (micro x
    accum = the rollout's 64 sequences, so one optimizer step), no activation checkpointing."""
    rows = GRPO_PROMPTS * GRPO_SAMPLES
    return {
        "kind": "grpo",
        "name": "grpo",
        "from": "sft",
        "data": {"synthetic": {"n_examples": 400, "seed": 9}, "eval_fraction": 0.05},
        "rollout": {
            "prompts_per_step": GRPO_PROMPTS,
            "samples_per_prompt": GRPO_SAMPLES,
            "max_new_tokens": GRPO_NEW_TOKENS,
        },
        "rewards": [{"fn": "posttrain.rewards.match:exact_match"}],
        "kl": {"coef": 0.0},
        "update_epochs": 1,
        "batch": {"micro_batch_size": rows, "grad_accum_steps": 1},
        "activation_checkpointing": False,
        "optim": {"lr": 1e-5, "schedule": "cosine", "warmup_steps": 0},
        "max_steps": steps,
        "checkpoint_every": 0,
        # The final held-out evaluation runs after the timed steps; a few prompts keep it short.
        "eval_prompts": 8,
    }


def parse_settings(items: list[str]) -> dict[str, Any]:
    """`key.path=value` strings -> {key.path: value}, each value read as YAML (true, 32, null)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected key.path=value, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def with_settings(section: dict, settings: dict[str, Any]) -> dict:
    """A copy of `section` with each dotted path of `settings` set (`rollout.drop_finished`
    -> section["rollout"]["drop_finished"]), sub-sections created as needed."""
    out = json.loads(json.dumps(section))  # deep copy of plain data
    for path, value in settings.items():
        *heads, leaf = path.split(".")
        node = out
        for h in heads:
            node = node.setdefault(h, {})
        node[leaf] = value
    return out


def child_env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def run_stage(stage: str, recipe: Path, threads: int) -> float:
    """One posttrain stage process; returns its wall seconds."""
    with stage_process(stage, recipe) as cmd:
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child_env(threads))
    if proc.returncode:
        raise RuntimeError(f"{stage} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    """steps: per optimizer step {"tokens", "step_time_s", "loss"}, in order -> figures over the
    steps after the warm-up (all of them if there are not more than WARMUP)."""
    timed = steps[WARMUP:] or steps
    secs = sum(s["step_time_s"] for s in timed)
    return {
        "tokens_per_s": sum(s["tokens"] for s in timed) / secs,
        # The median step's rate: a burst of load from other processes that slows a few steps
        # (on a shared machine, one side more than the other) moves it less than the mean.
        "median_tokens_per_s": statistics.median(s["tokens"] / s["step_time_s"] for s in timed),
        # The upper-quartile step rate: load from other processes only ever slows a step, so the
        # fast steps are the nearest to the uncontended speed (best-of, as bench/sft_throughput).
        "fast_tokens_per_s": upper_quartile([s["tokens"] / s["step_time_s"] for s in timed]),
        "step_records": steps,  # every step, so figures can be recomputed from the JSON
        "step_time_s": secs / len(timed),
        "tokens_per_step": sum(s["tokens"] for s in timed) / len(timed),
        "first_loss": steps[0]["loss"],
        "last_loss": steps[-1]["loss"],
        "steps": len(steps),
        "timed_steps": len(timed),
    }


def upper_quartile(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[2] if len(xs) > 1 else xs[0]


def posttrain_figures(stage_dir: Path) -> dict[str, float]:
    from posttrain.telemetry.records import read_metrics

    rows = read_metrics(stage_dir / "metrics.jsonl", "train")
    # One record per step (log_every 1, the default), or the warm-up skip would be off.
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "bench needs log_every 1"
    return summarize([{k: float(r[k]) for k in ("tokens", "step_time_s", "loss")} for r in rows])


def rl_summary(steps: list[dict[str, float]]) -> dict[str, Any]:
    """steps: per RL step {"step_time_s", "completion_len", "loss"} and any of RL_SPLIT's
    phase seconds, in order -> figures over the steps after the warm-up (all of them if there
    are not more than WARMUP): mean, median and lower-quartile ("fast") step time, the mean
    completion length, and the median of each phase that every timed step carries."""
    timed = steps[WARMUP:] or steps
    times = [s["step_time_s"] for s in timed]
    return {
        "step_time_s": statistics.fmean(times),
        "median_step_time_s": statistics.median(times),
        # Load from other processes only ever slows a step: the fast steps are the nearest to
        # the uncontended speed (the step-time twin of fast_tokens_per_s).
        "fast_step_time_s": lower_quartile(times),
        "completion_len": statistics.fmean(s["completion_len"] for s in timed),
        "split": {
            k: statistics.median(s[k] for s in timed)
            for k in RL_SPLIT
            if all(k in s for s in timed)
        },
        "step_records": steps,
        "last_loss": steps[-1]["loss"],
        "steps": len(steps),
        "timed_steps": len(timed),
    }


def lower_quartile(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[0] if len(xs) > 1 else xs[0]


def time_ratios(pt: dict[str, Any], trl: dict[str, Any]) -> dict[str, float]:
    """posttrain's step time over TRL's (below 1: posttrain is faster) by mean, median and
    fast (lower-quartile) step; whether the completion lengths agree to LENGTH_RTOL."""
    rel = abs(pt["completion_len"] - trl["completion_len"]) / max(trl["completion_len"], 1e-9)
    return {
        "time_ratio": pt["step_time_s"] / trl["step_time_s"],
        "median_time_ratio": pt["median_step_time_s"] / trl["median_step_time_s"],
        "fast_time_ratio": pt["fast_step_time_s"] / trl["fast_step_time_s"],
        "completion_len_rel_diff": rel,
        "lengths_comparable": rel <= LENGTH_RTOL,
    }


def posttrain_rl_figures(stage_dir: Path) -> dict[str, Any]:
    """`rl_summary` of an RL stage's metrics.jsonl train records (response_len = response
    tokens up to and including the stop token, TRL's completion length)."""
    from posttrain.telemetry.records import read_metrics

    rows = read_metrics(stage_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "bench needs log_every 1"
    return rl_summary(
        [
            {
                "step_time_s": float(r["step_time_s"]),
                "completion_len": float(r["response_len"]),
                "loss": float(r["loss"]),
                **{k: float(r[k]) for k in RL_SPLIT if k in r},
            }
            for r in rows
        ]
    )


def trl_in_subprocess(stage: str, recipe: Path, steps: int, threads: int, gc: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--trl-run",
                stage,
                str(recipe),
                "--steps",
                str(steps),
                "--threads",
                str(threads),
                "--trl-gradient-checkpointing",
                gc,
                "--trl-out",
                out,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=child_env(threads),
        )
    if proc.returncode:
        raise RuntimeError(f"TRL {stage} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Both sides


def trl_default_notes(stage: str, recipe: Any, gc: str = "default") -> list[str]:
    """TRL defaults this bench keeps (what users run) that differ from the stage and matter for
    speed, and the ones it overrides to compare like with like."""
    from trl import DPOConfig, SFTConfig

    if stage == "grpo":
        return grpo_notes(recipe, gc)
    cls = {"sft": SFTConfig, "dpo": DPOConfig}[stage]
    # The declared defaults: an instance with them cannot be built on CPU (bf16 defaults to True).
    d = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(cls)})
    section = getattr(recipe, stage)
    # batch.padding_free is the stage's own field once it has one; before, the stage pads.
    pt_free = getattr(section.batch, "padding_free", "absent (pads)")
    checkpointing = (
        f"gradient_checkpointing={d.gradient_checkpointing}"
        f"{'' if gc == 'default' else '->' + str(gc == 'on')} "
        f"(stage activation_checkpointing={section.activation_checkpointing})"
    )
    kept = [f"padding_free={d.padding_free} (stage batch.padding_free={pt_free})"]
    if gc == "default":
        kept.insert(0, checkpointing)
    if stage == "sft":
        kept.append(f"packing={d.packing} (stage packing={section.packing})")
    if stage == "dpo":
        kept.append(
            f"precompute_ref_log_probs={d.precompute_ref_log_probs} "
            f"(stage precompute_reference={section.precompute_reference})"
        )
    kept.append(f"use_liger_kernel={d.use_liger_kernel}")
    overridden = [
        f"bf16={d.bf16}->False",
        f"learning_rate={d.learning_rate}->{section.optim.lr}",
        f"lr_scheduler_type={d.lr_scheduler_type}->stage schedule",
        f"logging_steps={d.logging_steps}->1",
        f"max_length={d.max_length}->{section.data.max_seq_len}",
        "sampler random->sequential over rows in the stage's order",
    ] + ([checkpointing] if gc != "default" else [])
    return [f"TRL {stage} defaults kept: " + "; ".join(kept)] + [
        f"TRL {stage} defaults overridden: " + "; ".join(overridden)
    ]


def grpo_notes(recipe: Any, gc: str) -> list[str]:
    """The GRPO row's twin of `trl_default_notes`."""
    from trl import GRPOConfig

    d = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(GRPOConfig)})
    cfg = grpo_section(recipe)
    gc_on = gc == "on"
    kept = [
        f"loss_type={d.loss_type} (stage loss_aggregation={cfg.loss_aggregation})",
        f"scale_rewards={d.scale_rewards} (stage scale_rewards={cfg.scale_rewards})",
        f"cache_implementation={d.cache_implementation} (stage: generate's dynamic cache, "
        f"rollout.drop_finished={cfg.rollout.drop_finished})",
        f"use_transformers_continuous_batching={d.use_transformers_continuous_batching}",
        f"use_liger_kernel={d.use_liger_kernel}",
    ]
    overridden = [
        f"bf16={d.bf16}->False",
        f"learning_rate={d.learning_rate}->{cfg.optim.lr}",
        f"gradient_checkpointing={d.gradient_checkpointing}->{gc_on} "
        f"(stage activation_checkpointing={cfg.activation_checkpointing})",
        f"max_completion_length={d.max_completion_length}->{cfg.rollout.max_new_tokens}",
        f"logging_steps={d.logging_steps}->1",
        f"lr_scheduler_type={d.lr_scheduler_type}->stage schedule",
        "shuffle_dataset=True->False over prompts in the stage's order",
    ]
    return [
        "TRL grpo defaults kept: " + "; ".join(kept),
        "TRL grpo defaults overridden: " + "; ".join(overridden),
    ]


def compare(stage: str, recipe: Path, steps: int, threads: int, gc: str) -> dict[str, Any]:
    """Runs the posttrain stage, then TRL on the same inputs -> figures of both and the checks."""
    if stage == "grpo":
        return compare_grpo(recipe, steps, threads, gc)
    dirs = stage_dirs(recipe)
    wall = run_stage(stage, recipe, threads)
    pt = posttrain_figures(dirs[stage])
    tr = trl_in_subprocess(stage, recipe, steps, threads, gc)
    tl = summarize(tr["steps"])
    rel = abs(pt["first_loss"] - tl["first_loss"]) / max(abs(tl["first_loss"]), 1e-12)
    return {
        "stage": stage,
        "posttrain": pt | {"wall_s": wall},
        "trl": tl | {k: tr[k] for k in ("gradient_checkpointing", "padding_free")},
        "ratio": pt["tokens_per_s"] / tl["tokens_per_s"],
        "median_ratio": pt["median_tokens_per_s"] / tl["median_tokens_per_s"],
        "fast_ratio": pt["fast_tokens_per_s"] / tl["fast_tokens_per_s"],
        "first_loss_rel_diff": rel,
        "first_loss_match": rel <= FIRST_LOSS_RTOL,
    }


def compare_grpo(recipe: Path, steps: int, threads: int, gc: str) -> dict[str, Any]:
    """The GRPO row: the stage, then TRL's GRPOTrainer on the same prompts -> step times, their
    ratios (posttrain / TRL: below 1 posttrain is faster), completion lengths, phase split."""
    dirs = stage_dirs(recipe)
    wall = run_stage("grpo", recipe, threads)
    pt = posttrain_rl_figures(dirs["grpo"])
    tr = trl_in_subprocess("grpo", recipe, steps, threads, gc)
    tl = rl_summary(tr["steps"])
    return {
        "stage": "grpo",
        "posttrain": pt | {"wall_s": wall},
        "trl": tl | {"gradient_checkpointing": tr["gradient_checkpointing"]},
        **time_ratios(pt, tl),
    }


def headline(r: dict[str, Any]) -> dict[str, Any]:
    """A row's ratios: posttrain/TRL real tokens/s (sft, dpo: above 1 posttrain is faster) or
    step time (grpo: below 1 posttrain is faster)."""
    keys = ("time_ratio", "median_time_ratio", "fast_time_ratio")
    if r["stage"] != "grpo":
        keys = ("ratio", "median_ratio", "fast_ratio")
    return {"size": r["size"], "stage": r["stage"], **{k: r[k] for k in keys}}


def measure(
    size: str,
    steps: int,
    stages: list[str],
    threads: int,
    gc: str,
    tmp: Path,
    grpo_set: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every stage's comparison at one size, in one workspace (ingest and sft run once);
    `grpo_set`: the grpo stage's recipe settings beyond the bench's (`with_settings`)."""
    import yaml

    from posttrain.config.loader import load_recipe

    ws = tmp / size
    ws.mkdir(parents=True)
    recipe = ws / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(SIZES[size], steps, ws / "ws", threads, grpo_set)))
    run_stage("ingest", recipe, threads)
    if {"dpo", "grpo"} & set(stages) and "sft" not in stages:
        run_stage("sft", recipe, threads)  # the dpo and grpo stages' policy and reference
    params = base_params(stage_dirs(recipe)["ingest"])
    rows = []
    for stage in sorted(stages, key=STAGES.index):  # sft first: the others start from it
        r = compare(stage, recipe, steps, threads, gc)
        r |= {"size": size, "base_params": params}
        if stage == "grpo":
            r["posttrain_settings"] = dict(grpo_set or {})
        r["notes"] = trl_default_notes(stage, load_recipe(recipe), gc)
        rows.append(r)
        # As each comparison ends: a slow machine's long run shows its figures as they come.
        print(json.dumps(headline(r)))
        sys.stdout.flush()
    return rows


def base_params(ingest_dir: Path) -> int:
    """Parameters of the base checkpoint, read from its safetensors headers."""
    from safetensors import safe_open

    n = 0
    for f in (ingest_dir / "model").glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():  # noqa: SIM118 (safe_open is not iterable)
                shape = s.get_slice(k).get_shape()
                n += _prod(shape)
    return n


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def print_table(rows: list[dict[str, Any]], steps: int, threads: int) -> None:
    """The throughput table (sft, dpo), the GRPO table, then the TRL notes of both."""
    setting = (
        f"fp32 CPU, {threads} threads per side ({os.cpu_count()} cores), both sides fresh "
        f"processes, steps {WARMUP + 1 if steps > WARMUP else 1}..{steps} timed"
    )
    if tput := [r for r in rows if r["stage"] != "grpo"]:
        print_throughput_table(tput, steps, setting)
    if grpo := [r for r in rows if r["stage"] == "grpo"]:
        print_grpo_table(grpo, steps, setting)
    for note in dict.fromkeys(n for r in rows for n in r["notes"]):
        print(note)
    if tput:
        print(
            "TRL's step time = on_step_begin..on_step_end + its collator; its dataset row fetch "
            "and logging are outside it (in TRL's favour)."
        )
    if grpo:
        print(
            "GRPO step time: TRL's on_step_begin..on_step_end (generation, reward, advantages, "
            "loss, backward, optimizer step); posttrain's train record step_time_s (the same "
            "phases, plus its step's metrics)."
        )


def print_throughput_table(rows: list[dict[str, Any]], steps: int, setting: str) -> None:
    print(
        f"\nposttrain vs TRL 1.16, {steps} steps, micro-batch 16, seq <= 96, LoRA r16 all-linear, "
        f"{setting}; tokens/s = real (non-padding) tokens\n"
    )
    hdr = (
        "size",
        "params",
        "stage",
        "posttrain tok/s",
        "TRL tok/s",
        "posttrain/TRL",
        "median-step ratio",
        "fast-step ratio",
        "step s (pt / TRL)",
        "first loss (pt / TRL)",
        "rel diff",
        "last loss (pt / TRL)",
    )
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        p, t = r["posttrain"], r["trl"]
        print(
            f"{r['size']} | {r['base_params'] / 1e6:.1f}M | {r['stage']} | "
            f"{p['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | {r['ratio']:.2f}x | "
            f"{r['median_ratio']:.2f}x | {r['fast_ratio']:.2f}x | "
            f"{p['step_time_s']:.3f} / {t['step_time_s']:.3f} | "
            f"{p['first_loss']:.4f} / {t['first_loss']:.4f} | {r['first_loss_rel_diff']:.1e}"
            f"{'' if r['first_loss_match'] else ' MISMATCH'} | "
            f"{p['last_loss']:.4f} / {t['last_loss']:.4f}"
        )
    print()


def print_grpo_table(rows: list[dict[str, Any]], steps: int, setting: str) -> None:
    print(
        f"\nGRPO, posttrain vs TRL 1.16, {steps} steps of {GRPO_PROMPTS} prompts x "
        f"{GRPO_SAMPLES} samples, <= {GRPO_NEW_TOKENS} new tokens, exact-match reward, no KL, "
        f"one update, LoRA r16 from the SFT adapter, no gradient checkpointing, {setting}; "
        f"step time ratio posttrain/TRL: below 1 posttrain is faster (target <= "
        f"{TARGET_TIME_RATIO}x); phases: medians; posttrain's grpo settings beyond the "
        f"bench recipe (--grpo-set, one per invocation): "
        f"{rows[0].get('posttrain_settings') or 'none'}\n"
    )
    hdr = (
        "size",
        "params",
        "step s mean (pt / TRL)",
        "step s median (pt / TRL)",
        "posttrain/TRL",
        "median-step ratio",
        "fast-step ratio",
        "completion len (pt / TRL)",
        "pt generation / scoring / update s",
        "TRL generation s",
    )
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for r in rows:
        p, t = r["posttrain"], r["trl"]
        split = " / ".join(f"{p['split'][k]:.3f}" if k in p["split"] else "-" for k in RL_SPLIT)
        trl_gen = t["split"].get("generation_s")
        print(
            f"{r['size']} | {r['base_params'] / 1e6:.1f}M | "
            f"{p['step_time_s']:.3f} / {t['step_time_s']:.3f} | "
            f"{p['median_step_time_s']:.3f} / {t['median_step_time_s']:.3f} | "
            f"{r['time_ratio']:.2f}x | {r['median_time_ratio']:.2f}x | "
            f"{r['fast_time_ratio']:.2f}x | "
            f"{p['completion_len']:.1f} / {t['completion_len']:.1f}"
            f"{'' if r['lengths_comparable'] else ' DIFFER'} | {split} | "
            f"{'-' if trl_gen is None else f'{trl_gen:.3f}'}"
        )
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    ap.add_argument("--sizes", default="small,medium", help=f"comma list of {list(SIZES)}")
    ap.add_argument("--stages", default="sft,dpo", help=f"comma list of {','.join(STAGES)}")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides alike")
    ap.add_argument(
        "--trl-gradient-checkpointing",
        choices=("default", "on", "off"),
        default="default",
        help="TRL's gradient checkpointing (default: TRL's own default, on, for sft and dpo; "
        "off for grpo, the issue's shape)",
    )
    ap.add_argument(
        "--grpo-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe setting of posttrain's grpo stage (repeatable), e.g. "
        "rollout.drop_finished=true; shown in the table",
    )
    ap.add_argument("--json", type=Path, help="also save the figures here")
    ap.add_argument("--trl-run", nargs=2, metavar=("STAGE", "RECIPE"), help=argparse.SUPPRESS)
    ap.add_argument("--trl-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in sizes if s not in SIZES] + [s for s in stages if s not in STAGES]
    if bad:
        ap.error(f"unknown size or stage {bad}: sizes {list(SIZES)}, stages {list(STAGES)}")
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit(TRL_MISSING)

    if args.trl_run:
        import torch

        torch.set_num_threads(args.threads)
        stage, recipe = args.trl_run
        fn = {"sft": trl_sft, "dpo": trl_dpo, "grpo": trl_grpo}[stage]
        result = fn(Path(recipe), args.steps, args.trl_out, args.trl_gradient_checkpointing)
        print(json.dumps(result))
        return

    grpo_set = parse_settings(args.grpo_set)
    gc = args.trl_gradient_checkpointing
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            rows += measure(size, args.steps, stages, args.threads, gc, Path(tmp), grpo_set)
    print_table(rows, args.steps, args.threads)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(json.dumps([headline(r) for r in rows]))


if __name__ == "__main__":
    main()
