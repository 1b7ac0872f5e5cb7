"""evaluate: how much did the run help, what does the model say, and how fast does it answer?

The final policy (the graph's last policy stage) is scored against the base and against its
parent (the policy it started from), on the rows held out by the nearest stage of its lineage
that trained on conversations:
- Held-out loss and perplexity of the base, the parent and the final policy (one model object:
  adapters are switched, or disabled for the base, so all see identical base weights).
- Exact match of greedy answers against the held-out references, base vs final.
- With a reward model: its held-out accuracy, and the final policy's win-rate against its
  parent; for a policy trained on pairs against a reference, its implicit-reward accuracy.
- `evaluate.policies`: each listed policy against its own parent, side by side.
- With verifiers (the reward functions RL trained against, or `evaluate.verifiers`): greedy
  pass@1 and sampled pass@k of the base, the parent, the final policy and each listed policy on
  held-out prompts with references (`posttrain.eval.verify`).
- Generations from held-out prompts under every sampling setting of the recipe (samples.jsonl).
- Inference figures of the merged tuned model (what export ships): time to first token, time
  per output token and tokens/s, with the KV cache on and off.
- `evaluate.lm_eval`: lm-evaluation-harness tasks on the base, the SFT and the final policy
  (LoRA merged, in-process, HF backend); the final policy's scores are headline metrics
  `lm_eval/<task>/<metric>` (`posttrain.eval.lm_eval_harness`, decision 48).
Runs as one process on one device: evaluation of a model that needs sharding is future work.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch

from posttrain import jsonsafe
from posttrain.config.graph import BASE
from posttrain.data.batching import pad_batch
from posttrain.data.chat import prompt_text
from posttrain.data.sft_data import saved_split, tokenize_rows, write_rows
from posttrain.eval.generation import generate
from posttrain.eval.heldout import heldout_loss
from posttrain.eval.inference import compare_cache_modes
from posttrain.models.adapters import active_adapter
from posttrain.models.loading import load_base
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

    cfg = ctx.recipe.stage(stage).data
    rows = saved_split(ctx.parent_dir(stage), "eval")
    return encode_pairs(
        tok, rows[: ctx.recipe.evaluate.max_eval_rows], cfg.max_seq_len, cfg.max_prompt_len, "skip"
    )[0]


def _prompts(ctx: StageContext, stage: str, n: int) -> list[Any]:
    """Up to `n` held-out prompts of stage `stage` (its data/eval.jsonl rows' `prompt`)."""
    return [r["prompt"] for r in saved_split(ctx.parent_dir(stage), "eval") if "prompt" in r][:n]


def _win_rate(
    ctx: StageContext,
    model: Any,
    tok: Any,
    rm: Any,
    policy: str,
    parent: str,
    fallback: list[Any] | None = None,
) -> dict[str, Any] | None:
    """`policy`'s answers vs its parent's on `policy`'s held-out prompts (else `fallback`'s),
    judged by the reward model; None when there are no prompts."""
    from posttrain.eval.preference_eval import win_rate

    cfg = ctx.recipe.evaluate
    prompts = (
        _prompts(ctx, policy, cfg.win_rate_prompts) or (fallback or [])[: cfg.win_rate_prompts]
    )
    if not prompts:
        return None
    name = ADAPTER if policy == ctx.roles["policy"] else policy
    wr = win_rate(
        model,
        tok,
        rm,
        prompts,
        name,
        parent,
        cfg.win_rate_sampling,
        ctx.recipe.run.seed,
        cfg.batch_size,
    )
    log.info(
        "%s vs %s, judged by the reward model: %d wins, %d losses, %d ties (win-rate %.3f)",
        policy,
        parent,
        wr["wins"],
        wr["losses"],
        wr["ties"],
        wr["win_rate"],
    )
    return wr


def preference_metrics(
    ctx: StageContext, model: Any, tok: Any, device: torch.device
) -> tuple[dict[str, Any], Any]:
    """Reward-model accuracy, the final policy's implicit-reward accuracy (kinds trained on
    pairs against a reference) and its win-rate against its parent judged by the reward model
    — each when the run has what it needs. Returns (report, reward model or None)."""
    from posttrain.eval.preference_eval import implicit_reward_accuracy, reward_accuracy
    from posttrain.models.reward import load_reward_model

    cfg = ctx.recipe.evaluate
    out: dict[str, Any] = {}
    rm = None
    final = ctx.roles["policy"]
    if ctx.has_role("reward_model"):
        ingest = ctx.role_manifest("base")["summary"]
        rm = load_reward_model(
            ingest["model_dir"],
            ctx.role_dir("reward_model") / "adapter",
            tok.pad_token_id,
            ingest.get("trust_remote_code", False),
        ).to(device)
        out["reward_model"] = reward_accuracy(
            rm, _pairs(ctx, ctx.roles["reward_model"], tok), tok.pad_token_id, cfg.batch_size
        )
        log.info("reward model held-out accuracy %.3f", out["reward_model"]["accuracy"])
    node = ctx.recipe.graph().get(final)
    if node.kind.data == "pairs" and "reference" in node.links:
        pairs = _pairs(ctx, final, tok)
        out["dpo_implicit"] = implicit_reward_accuracy(
            model,
            ADAPTER,
            node.links["reference"],
            pairs,
            tok.pad_token_id,
            node.section.beta,
            cfg.batch_size,
            ctx.recipe.infra.logits_chunk_tokens,
            loss=getattr(node.section, "loss", "sigmoid"),
        )
        log.info(
            "%s implicit-reward held-out accuracy %.3f", final, out["dpo_implicit"]["accuracy"]
        )
    if rm is not None and ctx.has_role("parent"):
        wr = _win_rate(ctx, model, tok, rm, final, ctx.roles["parent"])
        if wr is not None:
            write_rows(ctx.out_dir / "win_rate_samples.jsonl", wr.pop("examples"))
            out["win_rate_vs_parent"] = {"parent": ctx.roles["parent"], **wr}
    return out, rm


def verifier_metrics(ctx: StageContext, model: Any, tok: Any) -> dict[str, Any] | None:
    """Greedy pass@1 and sampled pass@k under the verifiers, for the base, the parent, the
    final policy and `evaluate.policies`; None when the run has no verifier or no prompts with
    references."""
    from posttrain.eval.verify import VerifyPrompts, verify_policy
    from posttrain.rewards.combine import load_rewards

    cfg = ctx.recipe.evaluate
    source = ctx.roles.get("verifier")
    if cfg.verifiers == []:
        return None
    if cfg.verifiers is not None:
        specs = cfg.verifiers
    elif source is not None and ctx.recipe.stage(source).rewards:
        specs = ctx.recipe.stage(source).rewards[:1]
    else:
        return None
    rows: list[dict] = []
    if source is not None and ctx.has_role("verifier"):
        # Prompts saved without their columns (an artifact from before they were kept) have no
        # references to check against: the held-out conversations have them.
        rows = [r for r in saved_split(ctx.role_dir("verifier"), "eval") if len(r) > 1]
        origin = f"{source} held-out prompts"
    if not rows and ctx.has_role("heldout"):
        rows = saved_split(ctx.role_dir("heldout"), "eval")
        origin = f"{ctx.roles['heldout']} held-out conversations"
    if not rows:
        log.warning("verifiers but no held-out prompts with references: no pass@k report")
        return None
    prompts = VerifyPrompts.from_rows(rows[: cfg.pass_prompts], origin)
    if not prompts.messages:
        return None
    funcs = load_rewards(specs)
    final = ctx.roles["policy"]
    graph = ctx.recipe.graph()
    names = [BASE, ctx.roles.get("parent"), final, *cfg.policies]
    out: dict[str, Any] = {}
    for n in dict.fromkeys(x for x in names if x):
        if n != BASE and n not in graph:
            continue
        adapter = None if n == BASE else ADAPTER if n == final else n
        with _as_policy(model, adapter):
            out[n], examples = verify_policy(
                model,
                tok,
                prompts,
                funcs,
                cfg.pass_sampling,
                cfg.pass_samples,
                cfg.pass_k,
                ctx.recipe.run.seed,
                cfg.batch_size,
                cfg.pass_threshold,
            )
        if n == final:
            write_rows(ctx.out_dir / "verify_samples.jsonl", examples)
        log.info("verifiers on %d prompts: %s %s", out[n]["prompts"], n, out[n])
    return {
        "verifiers": [{"label": f.label, "fn": f.fn_ref, "sha256": f.sha256} for f in funcs],
        "source": origin,
        "k": cfg.pass_k,
        "samples": cfg.pass_samples,
        "threshold": cfg.pass_threshold,
        "policies": out,
    }


# The final policy's adapter name on the evaluation model; every other policy goes by its
# stage name.
ADAPTER = "default"


def _load_policies(ctx: StageContext, base: Any) -> tuple[Any, list[str]]:
    """Base + the final policy's adapter (active, as "default") + every other policy the
    evaluation compares (its parent, its reference, the `policies` and their parents), each
    named after its stage."""
    from peft import PeftModel

    graph = ctx.recipe.graph()
    final = ctx.roles["policy"]
    others = [ctx.roles.get("parent")]
    others.append(graph.get(final).links.get("reference"))
    for n in ctx.recipe.evaluate.policies:
        others += [n, graph.parent(n)]
    sft = _lm_eval_sft(ctx)
    if sft is not None:
        others.append(sft)
    names = [n for n in dict.fromkeys(others) if n and n in graph and n != final]
    model = PeftModel.from_pretrained(base, str(ctx.role_dir("policy") / "adapter"))
    for n in names:
        model.load_adapter(str(ctx.parent_dir(n) / "adapter"), adapter_name=n)
    return model, names


def _lm_eval_sft(ctx: StageContext) -> str | None:
    """The stage `evaluate.lm_eval`'s `sft` names: the last SFT stage of the final policy's
    lineage (the final policy itself when it is one); None when not asked for or there is none."""
    cfg = ctx.recipe.evaluate.lm_eval
    if cfg is None or "sft" not in cfg.policies:
        return None
    graph = ctx.recipe.graph()
    return next(
        (n for n in graph.lineage(ctx.roles["policy"]) if graph.get(n).kind.name == "sft"), None
    )


def _merged(model: Any, adapter: str) -> Any:
    """A copy of the policy of `adapter` with its LoRA merged into the weights (what export
    ships): a plain `transformers` model. Costs one more copy of the model while it lives."""
    merged = copy.deepcopy(model)
    merged.set_adapter(adapter)  # first: deleting the active adapter would switch to another
    for name in list(merged.peft_config):
        if name != adapter:
            merged.delete_adapter(name)
    return merged.merge_and_unload().eval()


def lm_eval_report(
    ctx: StageContext, model: Any, tok: Any, merged_final: Any
) -> dict[str, Any] | None:
    """`evaluate.lm_eval`'s tasks on each of its `policies`: the base (adapters off), the SFT
    and the final policy (merged; `merged_final` is the copy the inference figures used).
    None when the section is off."""
    cfg = ctx.recipe.evaluate.lm_eval
    if cfg is None:
        return None
    import lm_eval

    from posttrain.eval.lm_eval_harness import run_tasks, task_manager

    graph = ctx.recipe.graph()
    final = ctx.roles["policy"]
    sft = _lm_eval_sft(ctx)
    manager = task_manager(cfg.tasks, cfg.include_path)
    kwargs = {
        "limit": cfg.limit,
        "num_fewshot": cfg.num_fewshot,
        "batch_size": cfg.batch_size,
        "seed": ctx.recipe.run.seed,
        "bootstrap_iters": cfg.bootstrap_iters,
    }
    by_stage: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for label in cfg.policies:
        stage = {"base": BASE, "sft": sft, "final": final}[label]
        if stage is None:
            log.warning("lm_eval: the final policy's lineage has no SFT stage: no sft scores")
            continue
        if stage not in by_stage:
            started = time.perf_counter()
            if stage == BASE:
                with model.disable_adapter():
                    by_stage[stage] = run_tasks(
                        model.get_base_model(), tok, cfg.tasks, manager, **kwargs
                    )
            elif stage == final:
                by_stage[stage] = run_tasks(merged_final, tok, cfg.tasks, manager, **kwargs)
            else:
                merged = _merged(model, stage)
                by_stage[stage] = run_tasks(merged, tok, cfg.tasks, manager, **kwargs)
                del merged
            by_stage[stage]["seconds"] = round(time.perf_counter() - started, 2)
        out[label] = {
            "stage": stage,
            "kind": "base" if stage == BASE else graph.get(stage).kind.name,
            **by_stage[stage],
        }
        log.info("lm_eval %s (%s): %s", label, stage, out[label]["scores"])
    return {
        "harness_version": lm_eval.__version__,
        "tasks": list(cfg.tasks),
        "limit": cfg.limit,
        "num_fewshot": cfg.num_fewshot,
        "policies": out,
    }


def _as_policy(model: Any, adapter: str | None) -> Any:
    """A context in which `model` is the policy of `adapter` (None = the base: adapters off)."""
    return model.disable_adapter() if adapter is None else active_adapter(model, adapter)


def _scores(
    model: Any,
    adapter: str | None,
    examples: list[dict],
    pad_id: int,
    bs: int,
    device: Any,
    chunk: int,
) -> dict[str, float]:
    """Held-out loss/perplexity of one adapter (None = the base: adapters disabled)."""
    with _as_policy(model, adapter):
        return heldout_loss(model, _batches(examples, pad_id, bs), device, chunk)


def _exact(model: Any, adapter: str | None, tok: Any, prompts: list, refs: list, ctx: Any) -> float:
    cfg = ctx.recipe.evaluate
    greedy = next(s for s in cfg.sampling if s.strategy == "greedy")
    with _as_policy(model, adapter):
        outs = generate(model, tok, prompts, greedy, ctx.recipe.run.seed, cfg.batch_size)
    return sum(o.strip() == r.strip() for o, r in zip(outs, refs, strict=True)) / len(refs)


def compare_policies(
    ctx: StageContext,
    model: Any,
    tok: Any,
    rm: Any,
    examples: list[dict] | None,
    prompts: list,
    refs: list,
    device: Any,
    base: dict[str, float] | None = None,
) -> dict[str, Any]:
    """`evaluate.policies` side by side, each against its parent: held-out loss, greedy exact
    match, reward-model win-rate (what each link of the chain gained). `base`: the base
    model's loss and exact match, shown first when a listed policy started from the base."""
    cfg = ctx.recipe.evaluate
    graph = ctx.recipe.graph()
    final = ctx.roles["policy"]
    chunk = ctx.recipe.infra.logits_chunk_tokens
    out: dict[str, Any] = {}
    if base and any(graph.parent(n) == BASE for n in cfg.policies):
        out[BASE] = {"kind": "base", "parent": "", **base}
    for n in cfg.policies:
        parent = graph.parent(n)
        row: dict[str, Any] = {"kind": graph.get(n).kind.name, "parent": parent}
        adapter = ADAPTER if n == final else n
        if examples:
            row["loss"] = _scores(
                model, adapter, examples, tok.pad_token_id, cfg.batch_size, device, chunk
            )["loss"]
            if any(x.strategy == "greedy" for x in cfg.sampling):
                row["exact_match"] = _exact(model, adapter, tok, list(prompts), list(refs), ctx)
        if rm is not None and parent in graph:
            turns = [[{"role": "user", "content": p}] for p in prompts]
            wr = _win_rate(ctx, model, tok, rm, n, parent, turns)
            if wr is not None:
                row["win_rate_vs_parent"] = wr["win_rate"]
        out[n] = row
        log.info(
            "policy %s (from %s): %s",
            n,
            parent,
            {k: v for k, v in row.items() if k not in ("kind", "parent")},
        )
    return out


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.recipe.evaluate
    seed = ctx.recipe.run.seed
    device = torch.device("cuda" if ctx.recipe.infra.device == "cuda" else "cpu")
    base, tok = load_base(
        ctx.role_dir("base"),
        ctx.role_manifest("base"),
        attention=ctx.recipe.infra.attention,
    )
    final = ctx.roles["policy"]
    parent = ctx.roles.get("parent")  # None: the final policy started from the base
    model, _ = _load_policies(ctx, base)
    model = model.to(device).eval()

    # Held-out conversations: from the nearest stage of the final policy's lineage that trained
    # on them (none when, say, ORPO started from the base: then loss and exact match are left
    # out, and samples use the final stage's own prompts).
    rows: list[dict] = []
    held_out = False
    if ctx.has_role("heldout"):
        source = ctx.role_dir("heldout")
        rows = saved_split(source, "eval")[: cfg.max_eval_rows]
        held_out = bool(rows)
        if not held_out:
            # No held-out split (eval_fraction 0, no eval_path): there is nothing unseen to
            # score, so loss and exact match are left out rather than measured on training
            # rows; samples and the inference benchmark still need prompts, and take training
            # ones.
            log.warning(
                "no held-out rows (%s.data.eval_fraction is 0 and no eval_path): held-out loss "
                "and exact match are skipped; samples and the inference benchmark use training "
                "prompts",
                ctx.roles["heldout"],
            )
            rows = saved_split(source, "train")[: cfg.max_eval_rows]
    chunk = ctx.recipe.infra.logits_chunk_tokens
    base_scores = tuned_scores = None
    examples: list[dict] = []
    if held_out:
        examples, _ = tokenize_rows(rows, tok, ctx.recipe.stage(ctx.roles["heldout"]).data)
        base_scores = _scores(
            model, None, examples, tok.pad_token_id, cfg.batch_size, device, chunk
        )
        tuned_scores = _scores(
            model, ADAPTER, examples, tok.pad_token_id, cfg.batch_size, device, chunk
        )
        log.info(
            "held-out loss: base %.4f -> %s %.4f (perplexity %.2f -> %.2f)",
            base_scores["loss"],
            final,
            tuned_scores["loss"],
            base_scores["perplexity"],
            tuned_scores["perplexity"],
        )

    if rows:
        prompts, refs = zip(*(prompt_text(tok, r["messages"]) for r in rows), strict=True)
    else:
        own = _prompts(ctx, final, cfg.max_eval_rows)
        as_turns = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in own]
        prompts = tuple(
            prompt_text(tok, [*p, {"role": "assistant", "content": ""}])[0] for p in as_turns
        )
        refs = ("",) * len(prompts)
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
            "greedy exact match on %d held-out prompts: base %.3f -> %s %.3f",
            len(refs),
            exact["base"],
            final,
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

    merged = _merged(model, ADAPTER)
    ids = _inference_prompt(tok, list(prompts), cfg.inference_prompt_tokens).to(device)
    inference = compare_cache_modes(merged, ids, cfg.inference_new_tokens, cfg.inference_repeats)
    harness = lm_eval_report(ctx, model, tok, merged)
    del merged
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
        if parent is not None:  # how far the last stage moved the policy from its parent's fit
            heldout["parent"] = _scores(
                model, parent, examples, tok.pad_token_id, cfg.batch_size, device, chunk
            )
    report: dict[str, Any] = {
        "policy": final,
        "parent": parent,
        "heldout": heldout,
        "exact_match": exact,
        "inference": inference,
        "samples": len(samples),
    }
    prefs, rm = preference_metrics(ctx, model, tok, device)
    report |= prefs
    verified = verifier_metrics(ctx, model, tok)
    if verified is not None:
        report["verifier"] = verified
    if harness is not None:
        report["lm_eval"] = harness
    if cfg.policies:
        base_row = {"loss": base_scores["loss"]} if base_scores else {}
        if "base" in exact:
            base_row["exact_match"] = exact["base"]
        report["policies"] = compare_policies(
            ctx, model, tok, rm, examples, prompts, refs, device, base_row
        )
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
    if heldout is not None and "parent" in heldout:
        headline["parent_loss"] = heldout["parent"]["loss"]
    headline["decode_tok/s"] = inference["cache"]["tokens_per_s"]
    if "reward_model" in report:
        headline["rm_accuracy"] = report["reward_model"]["accuracy"]
    if "dpo_implicit" in report:
        headline["dpo_accuracy"] = report["dpo_implicit"]["accuracy"]
    if verified is not None:
        k, by = verified["k"], verified["policies"]
        headline |= {"pass@1": by[final]["pass@1"], f"pass@{k}": by[final][f"pass@{k}"]}
        if parent in by:
            headline["pass@1_parent"] = by[parent]["pass@1"]
        headline["pass@1_base"] = by[BASE]["pass@1"]
    if "win_rate_vs_parent" in report:
        wr = report["win_rate_vs_parent"]
        headline |= {
            "win_rate_vs_parent": wr["win_rate"],
            "wins": wr["wins"],
            "losses": wr["losses"],
            "ties": wr["ties"],
        }
    if harness is not None and "final" in harness["policies"]:
        from posttrain.eval.lm_eval_harness import headline as lm_eval_headline

        headline |= lm_eval_headline(harness["policies"]["final"]["scores"], harness["tasks"])
    return {**report, "headline": {k: round(v, 4) for k, v in headline.items()}}


if __name__ == "__main__":
    stage_main(run)
