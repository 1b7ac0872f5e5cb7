"""evaluate: how much did SFT help, what does the model say, and how fast does it answer?

- Held-out loss and perplexity of the base and of base+adapter on the rows SFT held out (the
  same model object: the adapter is disabled for the base, so both see identical weights).
- Exact match of greedy answers against the held-out references, base vs tuned.
- Generations from held-out prompts under every sampling setting of the recipe (samples.jsonl).
- Inference figures of the merged tuned model (what export ships): time to first token, time
  per output token and tokens/s, with the KV cache on and off.
Runs as one process on one device: evaluation of a model that needs sharding is future work.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import torch

from posttrain import jsonsafe
from posttrain.data.batching import pad_batch
from posttrain.data.chat import prompt_text
from posttrain.data.sft_data import saved_split, tokenize_rows, write_rows
from posttrain.eval.generation import generate
from posttrain.eval.heldout import heldout_loss
from posttrain.eval.inference import compare_cache_modes
from posttrain.models.adapters import active_adapter
from posttrain.models.loading import load_base
from posttrain.pipeline import policy_stage
from posttrain.stages.common import StageContext, stage_main

log = logging.getLogger("posttrain.evaluate")


def _batches(examples: list[dict], pad_id: int, size: int):
    for i in range(0, len(examples), size):
        yield pad_batch(examples[i : i + size], pad_id)


def _inference_prompt(tok: Any, prompts: list[str], n_tokens: int) -> torch.Tensor:
    """[1, n_tokens] prompt ids cut from real held-out prompts (repeated if they are short)."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        for p in prompts:
            ids += tok(p, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:n_tokens]])


def _pairs(ctx: StageContext, stage: str, tok: Any) -> list[dict]:
    """Encoded held-out pairs of a preference stage (its data/eval.jsonl, its length limits)."""
    from posttrain.data.preference import encode_pairs

    cfg = getattr(ctx.recipe, stage).data
    rows = [
        json.loads(x)
        for x in (ctx.parent_dir(stage) / "data" / "eval.jsonl").read_text().splitlines()
    ]
    return encode_pairs(
        tok, rows[: ctx.recipe.evaluate.max_eval_rows], cfg.max_seq_len, cfg.max_prompt_len, "skip"
    )[0]


def preference_metrics(
    ctx: StageContext, model: Any, tok: Any, device: torch.device
) -> dict[str, Any]:
    """Reward-model accuracy, DPO implicit-reward accuracy and the tuned policy's (DPO, PPO or
    GRPO) win-rate against the SFT policy judged by the reward model — each when its stages
    ran."""
    from posttrain.eval.preference_eval import implicit_reward_accuracy, reward_accuracy, win_rate
    from posttrain.models.reward import load_reward_model

    cfg = ctx.recipe.evaluate
    out: dict[str, Any] = {}
    rm = None
    if "reward" in ctx.parents:
        ingest = ctx.parent_manifest("ingest")["summary"]
        rm = load_reward_model(
            ingest["model_dir"],
            ctx.parent_dir("reward") / "adapter",
            tok.pad_token_id,
            ingest.get("trust_remote_code", False),
        ).to(device)
        out["reward_model"] = reward_accuracy(
            rm, _pairs(ctx, "reward", tok), tok.pad_token_id, cfg.batch_size
        )
        log.info("reward model held-out accuracy %.3f", out["reward_model"]["accuracy"])
    if "dpo" in ctx.parents:
        assert ctx.recipe.dpo is not None
        pairs = _pairs(ctx, "dpo", tok)
        out["dpo_implicit"] = implicit_reward_accuracy(
            model,
            "default",
            "sft",
            pairs,
            tok.pad_token_id,
            ctx.recipe.dpo.beta,
            cfg.batch_size,
            ctx.recipe.infra.logits_chunk_tokens,
            loss=ctx.recipe.dpo.loss,
        )
        log.info("DPO implicit-reward held-out accuracy %.3f", out["dpo_implicit"]["accuracy"])
    tuned = policy_stage(ctx.parents)
    if rm is not None and tuned != "sft":
        rows = [
            json.loads(x)
            for x in (ctx.parent_dir(tuned) / "data" / "eval.jsonl").read_text().splitlines()
        ]
        prompts = [r["prompt"] for r in rows[: cfg.win_rate_prompts]]
        wr = win_rate(
            model,
            tok,
            rm,
            prompts,
            "default",
            "sft",
            cfg.win_rate_sampling,
            ctx.recipe.run.seed,
            cfg.batch_size,
        )
        write_rows(ctx.out_dir / "win_rate_samples.jsonl", wr.pop("examples"))
        out["win_rate_vs_sft"] = wr
        log.info(
            "%s policy vs SFT policy, judged by the reward model: %d wins, %d losses, "
            "%d ties (win-rate %.3f)",
            tuned.upper(),
            wr["wins"],
            wr["losses"],
            wr["ties"],
            wr["win_rate"],
        )
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    from peft import PeftModel

    cfg = ctx.recipe.evaluate
    seed = ctx.recipe.run.seed
    device = torch.device("cuda" if ctx.recipe.infra.device == "cuda" else "cpu")
    base, tok = load_base(
        ctx.parent_dir("ingest"),
        ctx.parent_manifest("ingest"),
        attention=ctx.recipe.infra.attention,
    )
    sft_dir = ctx.parent_dir("sft")
    # The tuned policy is the policy stage that ran (dpo, ppo or grpo), else sft; the SFT policy
    # is then loaded as a second adapter ("sft") on the same base, for the comparisons below.
    tuned = policy_stage(ctx.parents)
    model = PeftModel.from_pretrained(base, str(ctx.parent_dir(tuned) / "adapter"))
    if tuned != "sft":
        model.load_adapter(str(sft_dir / "adapter"), adapter_name="sft")
    model = model.to(device).eval()

    rows = saved_split(sft_dir, "eval")[: cfg.max_eval_rows]
    held_out = bool(rows)
    if not held_out:
        # SFT kept no held-out split (eval_fraction 0, no eval_path): there is nothing unseen to
        # score, so loss and exact match are left out rather than measured on training rows;
        # samples and the inference benchmark still need prompts, and take training ones.
        log.warning(
            "no held-out rows (sft.data.eval_fraction is 0 and no eval_path): held-out loss "
            "and exact match are skipped; samples and the inference benchmark use training "
            "prompts"
        )
        rows = saved_split(sft_dir, "train")[: cfg.max_eval_rows]
    chunk = ctx.recipe.infra.logits_chunk_tokens
    base_scores = tuned_scores = None
    if held_out:
        examples, _ = tokenize_rows(rows, tok, ctx.recipe.sft.data)
        with model.disable_adapter():
            base_scores = heldout_loss(
                model, _batches(examples, tok.pad_token_id, cfg.batch_size), device, chunk
            )
        tuned_scores = heldout_loss(
            model, _batches(examples, tok.pad_token_id, cfg.batch_size), device, chunk
        )
        log.info(
            "held-out loss: base %.4f -> tuned %.4f (perplexity %.2f -> %.2f)",
            base_scores["loss"],
            tuned_scores["loss"],
            base_scores["perplexity"],
            tuned_scores["perplexity"],
        )

    prompts, refs = zip(*(prompt_text(tok, r["messages"]) for r in rows), strict=True)
    n = min(cfg.num_prompts, len(prompts))
    samples: list[dict[str, Any]] = []
    exact: dict[str, float] = {}
    greedy = next((s for s in cfg.sampling if s.strategy == "greedy"), None)
    if greedy is not None and held_out:
        with model.disable_adapter():
            base_out = generate(model, tok, list(prompts), greedy, seed, cfg.batch_size)
        tuned_out = generate(model, tok, list(prompts), greedy, seed, cfg.batch_size)
        exact = {
            "base": sum(o.strip() == r.strip() for o, r in zip(base_out, refs, strict=True))
            / len(refs),
            "tuned": sum(o.strip() == r.strip() for o, r in zip(tuned_out, refs, strict=True))
            / len(refs),
        }
        log.info(
            "greedy exact match on %d held-out prompts: base %.3f -> tuned %.3f",
            len(refs),
            exact["base"],
            exact["tuned"],
        )
        samples += [
            {"sampling": f"base/{greedy.name}", "prompt": p, "reference": r, "output": o}
            for p, r, o in zip(prompts[:n], refs[:n], base_out[:n], strict=True)
        ]
    for s in cfg.sampling:
        outs = generate(model, tok, list(prompts[:n]), s, seed, cfg.batch_size)
        samples += [
            {"sampling": s.name, "prompt": p, "reference": r, "output": o}
            for p, r, o in zip(prompts[:n], refs[:n], outs, strict=True)
        ]
    write_rows(ctx.out_dir / "samples.jsonl", samples)

    merged = copy.deepcopy(model).merge_and_unload().eval()
    ids = _inference_prompt(tok, list(prompts), cfg.inference_prompt_tokens).to(device)
    inference = compare_cache_modes(merged, ids, cfg.inference_new_tokens, cfg.inference_repeats)
    for mode in ("cache", "no_cache"):
        inference[mode].pop("token_ids", None)
    log.info(
        "inference (merged, %d prompt + %d new tokens): cache %.1f tok/s, TTFT %.1f ms, "
        "TPOT %.1f ms; no cache %.1f tok/s",
        cfg.inference_prompt_tokens,
        cfg.inference_new_tokens,
        inference["cache"]["tokens_per_s"],
        1e3 * inference["cache"]["ttft_s"],
        1e3 * (inference["cache"]["tpot_s"] or 0),
        inference["no_cache"]["tokens_per_s"],
    )

    heldout: dict[str, Any] | None = None
    if held_out:
        heldout = {"base": base_scores, "tuned": tuned_scores, "rows": len(examples)}
    if held_out and tuned != "sft":  # how far preference tuning moved the policy from SFT's fit
        with active_adapter(model, "sft"):
            heldout["sft"] = heldout_loss(
                model, _batches(examples, tok.pad_token_id, cfg.batch_size), device, chunk
            )
    report = {
        "policy": tuned,
        "heldout": heldout,
        "exact_match": exact,
        "inference": inference,
        "samples": len(samples),
    }
    report |= preference_metrics(ctx, model, tok, device)
    (ctx.out_dir / "eval.json").write_text(jsonsafe.dumps(report, indent=2))
    headline: dict[str, float] = {}
    if heldout is not None:
        headline |= {
            "base_loss": base_scores["loss"],
            "tuned_loss": tuned_scores["loss"],
            "tuned_ppl": tuned_scores["perplexity"],
        }
    if exact:
        headline |= {"exact_match_base": exact["base"], "exact_match_tuned": exact["tuned"]}
    if heldout is not None and "sft" in heldout:
        headline["sft_loss"] = heldout["sft"]["loss"]
    headline["decode_tok/s"] = inference["cache"]["tokens_per_s"]
    if "reward_model" in report:
        headline["rm_accuracy"] = report["reward_model"]["accuracy"]
    if "dpo_implicit" in report:
        headline["dpo_accuracy"] = report["dpo_implicit"]["accuracy"]
    if "win_rate_vs_sft" in report:
        wr = report["win_rate_vs_sft"]
        headline |= {
            "win_rate_vs_sft": wr["win_rate"],
            "wins": wr["wins"],
            "losses": wr["losses"],
            "ties": wr["ties"],
        }
    return {**report, "headline": {k: round(v, 4) for k, v in headline.items()}}


if __name__ == "__main__":
    stage_main("evaluate", run)
