"""What a GRPO-shaped RL step spends on generation, and what the rollout engine's options save.

One process, world size 1, fp32 on CPU. A random-init Llama (--hidden/--layers/--vocab) wrapped
as the RL role model (`RoleModel`: one base, LoRA adapters for policy / reference / reward and a
score head), --prompts prompts x --samples samples per rollout (GRPO groups), prompts of 16-48
random tokens. Each step is timed per phase, as the online-RL loop logs them:
- generation: `posttrain.rl.rollout.sample.sample` (the rollout engine),
- scoring: policy and reference log-probs (`score`) and the reward forward on the rollout,
- update: one epoch of clipped GRPO updates (micro-batches of --micro, AdamW on the policy
  adapter) with group advantages.
A random-init model does not learn when to stop, so response lengths are made to vary with a stop
set: --stop-share of the vocabulary (random ids) ends a response, i.e. roughly geometric lengths
with mean 1/stop-share, cut at max_new_tokens; the mean length and stop rate are printed.

Rows per configuration (each at max_new_tokens 24 and 64; --steps steps, the first left out as
warm-up, medians shown):
- generate:           transformers' generate, dynamic KV cache (the default engine path)
- generate, static:   generate with cache_implementation="static" (preallocated KV cache;
                      on GPU it is what makes torch.compile of the decode step possible)
- decode loop:        `rollout.drop_finished=true`: finished rows leave the batch and its cache
- fast:               `rollout.engine: fast`: a plain copy with the LoRA merged, static cache
                      (`posttrain.rl.rollout.fast_engine`; eager on CPU, its compiled decode
                      step is CUDA's), built once; its gen s includes the copy's refresh and
                      probe after each update (`sync_weights`)
keep_gathered is not a row: at world size 1 FSDP's all-gather is a no-op (bench/rl_memory.py
measures it on 2 ranks).

    python bench/rollout_cost.py [--steps 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.models.adapters import POLICY, REFERENCE
from posttrain.models.roles import REWARD, RoleModel
from posttrain.rl.losses import clipped_policy_loss, group_advantages, loss_weights
from posttrain.rl.rollout.engine import HFEngine, RolloutEngine
from posttrain.rl.rollout.engines import build_engine
from posttrain.rl.rollout.sample import Rollout, response_logps, sample, score
from posttrain.sections.shared import RolloutConfig

PAD = 0


def role_model(args: argparse.Namespace) -> RoleModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=args.hidden * 8 // 3,
        max_position_embeddings=512,
        pad_token_id=PAD,
        eos_token_id=1,
        bos_token_id=2,
    )
    base = LlamaForCausalLM(cfg).float().eval()
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    lm = get_peft_model(base, lora)
    for name in (REFERENCE, REWARD):
        lm.add_adapter(name, lora)
    for n, p in lm.named_parameters():
        p.requires_grad_(".default." in n)
    return RoleModel(lm, nn.Linear(args.hidden, 1).requires_grad_(False), None)


def grpo_update(model: RoleModel, ro: Rollout, opt: Any, micro: int, group: int) -> None:
    """One epoch of clipped GRPO updates on the rollout (advantages from the reward scores)."""
    adv = group_advantages(ro.scored["scores"], group)  # [N]
    model.train()
    for start in range(0, ro.n, micro):
        idx = list(range(start, min(start + micro, ro.n)))
        inp = ro.inputs(idx)
        logp, _ = response_logps(model, POLICY, inp, ro.response[idx], ro.mask[idx], 0)
        loss, _ = clipped_policy_loss(
            logp, ro.scored["logps"][idx], adv[idx, None].expand_as(logp), 0.2
        )
        # The token mean as the stage's update takes it (`posttrain.rl.update.update`).
        weights, count = loss_weights(ro.mask[idx], "token_mean", ro.width[1])
        ((loss * weights).sum() * (1 / max(1.0, count))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def step(
    model: RoleModel,
    opt: Any,
    prompts: list[list[int]],
    cfg: RolloutConfig,
    stops: list[int],
    seed: int,
    args: argparse.Namespace,
    cache: str | None,
    fast: RolloutEngine | None = None,
) -> dict[str, float]:
    t0 = time.perf_counter()
    if fast is not None:  # the engine lives across steps, as in the stage
        ro = sample(fast, prompts, [[]] * len(prompts), cfg, PAD, stops, seed)
    elif cache:  # generate with another KV cache: the engine itself, as `sample` would call it
        engine = HFEngine(model, POLICY, 1, cache_implementation=cache)
        response = engine.generate(prompts, _sampling(cfg), stops, PAD, seed)
        ro = _rollout(prompts, response, stops)
    else:
        engine = build_engine(cfg, model, POLICY, 1)
        ro = sample(engine, prompts, [[]] * len(prompts), cfg, PAD, stops, seed)
    t_gen = time.perf_counter() - t0
    score(model, ro, None, args.micro, 0, roles=(POLICY, REFERENCE))
    with torch.no_grad():
        scores = [
            model(
                REWARD,
                **{
                    k: v
                    for k, v in ro.inputs(list(range(s, s + args.micro))).items()
                    if k in ("input_ids", "attention_mask", "position_ids")
                },
            )
            for s in range(0, ro.n, args.micro)
        ]
    ro.scored["scores"] = torch.cat(scores)
    t_score = time.perf_counter() - t0 - t_gen
    grpo_update(model, ro, opt, args.micro, args.samples)
    t_upd = time.perf_counter() - t0 - t_gen - t_score
    if fast is not None:  # the refresh and probe belong to sampling's cost
        t = time.perf_counter()
        fast.sync_weights(model)
        t_gen += time.perf_counter() - t
    total = time.perf_counter() - t0
    return {
        "gen": t_gen,
        "score": t_score,
        "update": t_upd,
        "share": t_gen / total,
        "new_tokens": float(ro.mask.sum()),
        "width": ro.width[1],
        "stop_rate": float(ro.stopped.float().mean()),
    }


def _sampling(cfg: RolloutConfig) -> Any:
    from posttrain.rl.rollout.sample import sampling_of

    return sampling_of(cfg)


def _rollout(prompts: list[list[int]], response: torch.Tensor, stops: list[int]) -> Rollout:
    from posttrain.rl.rollout.sample import left_pad, response_mask

    ids, attn = left_pad(prompts, PAD)
    mask, stopped = response_mask(response, stops)
    return Rollout(ids, attn, response, mask, stopped, [[]] * len(prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--stop-share", type=float, default=1 / 16)
    ap.add_argument("--max-new", type=int, nargs="+", default=[24, 64])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    stops = torch.randperm(args.vocab - 3, generator=g)[: int(args.vocab * args.stop_share)] + 3
    stops = stops.tolist()
    configs = (
        ("generate", False, None),
        ("generate, static", False, "static"),
        ("decode loop", True, None),
        ("fast", False, "fast"),
    )
    n_params = None
    print(
        f"{args.prompts} prompts x {args.samples} samples, hidden {args.hidden}, {args.layers} "
        f"layers, vocab {args.vocab}, stop share {args.stop_share:.3f}, {args.threads} threads, "
        f"medians of {args.steps - 1} steps after a warm-up"
    )
    hdr = (
        "max_new",
        "engine path",
        "gen s",
        "score s",
        "update s",
        "gen share",
        "gen tok/s",
        "mean len",
        "stopped",
        "gen vs generate",
    )
    print(" | ".join(hdr))
    for max_new in args.max_new:
        cfg = RolloutConfig(
            prompts_per_step=args.prompts,
            samples_per_prompt=args.samples,
            max_new_tokens=max_new,
            temperature=1.0,
        )
        base_gen = None
        for name, drop, cache in configs:
            model = role_model(args)  # same init for every configuration
            n_params = n_params or sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
            rng = torch.Generator().manual_seed(2)
            fast = None
            if cache == "fast":
                fast = build_engine(cfg.model_copy(update={"engine": "fast"}), model, POLICY, 1)
            runs = []
            for s in range(args.steps):
                lens = torch.randint(16, 49, (args.prompts,), generator=rng).tolist()
                ps = [torch.randint(3, args.vocab, (n,), generator=rng).tolist() for n in lens]
                prompts = [p for p in ps for _ in range(args.samples)]
                c = cfg.model_copy(update={"drop_finished": drop})
                runs.append(step(model, opt, prompts, c, stops, 100 + s, args, cache, fast))
            m = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
            base_gen = base_gen or m["gen"]
            n = args.prompts * args.samples
            print(
                f"{max_new:7d} | {name:16s} | {m['gen']:5.2f} | {m['score']:7.2f} | "
                f"{m['update']:8.2f} | {100 * m['share']:8.0f}% | {m['new_tokens'] / m['gen']:9.0f}"
                f" | {m['new_tokens'] / n:8.1f} | {100 * m['stop_rate']:6.0f}% | "
                f"{base_gen / m['gen']:.2f}x"
            )
    print(
        f"({n_params / 1e6:.1f}M parameters with adapters; gen tok/s = real response tokens "
        "(up to each stop) per generation second)"
    )


if __name__ == "__main__":
    main()
