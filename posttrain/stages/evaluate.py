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
- A distilled final policy (its stage has a `teacher`): the greedy exact match of its parent
  and of the teacher (on the teacher's own base, `posttrain.eval.teacher`), and the share of
  the gap between them the stage closed (`teacher_gap_closed`); with verifiers, the teacher's
  pass@1 beside the others'.
- With verifiers (the reward functions RL trained against, or `evaluate.verifiers`): greedy
  pass@1 of the base, the parent, the final policy and each listed policy on held-out prompts
  with references, and sampled pass@k of the final policy (of the others too as
  `evaluate.pass_k_policies` asks: sampling is most of the stage's time) (`posttrain.eval.verify`).
- Generations from held-out prompts under every sampling setting of the recipe (samples.jsonl).
- `evaluate.speed`: decode figures of the merged tuned model (what export ships): time to first
  token, time per output token and tokens/s with the KV cache (and without, when asked).
- `evaluate.lm_eval`: lm-evaluation-harness tasks on the base, the SFT and the final policy
  (LoRA merged, in-process, HF backend); the final policy's scores are headline metrics
  `lm_eval/<task>/<metric>` (`posttrain.eval.lm_eval_harness`, decision 48).
Runs as one process on one device: evaluation of a model that needs sharding is future work.

This module is the stage's wiring: which models are loaded and in which order, which metric
family runs on which of them, and the summary with its headline. Each family is a module of
`posttrain/eval/` (heldout, exact_match, samples, inference, preference_eval, side_by_side,
verify, lm_eval_harness); what each is scored on is read from the parents' artifacts by
`posttrain.eval.inputs`. `run` keeps the families in the order they always ran in.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from peft import PeftModel

from posttrain import jsonsafe
from posttrain.data.sft_data import tokenize_rows, write_rows
from posttrain.eval.exact_match import base_vs_tuned, exact_match, greedy_answers
from posttrain.eval.heldout import policy_heldout_loss
from posttrain.eval.inference import compare_cache_modes, inference_prompt, measure_inference
from posttrain.eval.inputs import (
    conversations,
    prompts_and_refs,
    stage_pairs,
    stage_prompts,
    verifier_episodes,
    verifier_prompts,
    verifier_specs,
    verifiers_field,
)
from posttrain.eval.lm_eval_harness import harness_report
from posttrain.eval.lm_eval_harness import headline as lm_eval_headline
from posttrain.eval.preference_eval import (
    implicit_reward_accuracy,
    policy_win_rate,
    reward_accuracy,
)
from posttrain.eval.samples import policy_samples, sample_rows
from posttrain.eval.side_by_side import HeldOut, Link, compare_policies
from posttrain.eval.teacher import teacher_scores
from posttrain.eval.verify import samples_pass_k, verifier_report
from posttrain.kinds.evaluate import SpeedConfig
from posttrain.models.adapters import merged_copy
from posttrain.models.loading import load_base
from posttrain.models.reward import load_reward_model
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rewards.combine import load_rewards
from posttrain.rewards.judge_server import judge_servers
from posttrain.rl.distill_losses import teacher_gap_closed
from posttrain.runtime.context import StageContext
from posttrain.stages.common import stage_main

log = logging.getLogger("posttrain.evaluate")

# The final policy's adapter name on the evaluation model; every other policy goes by its
# stage name.
ADAPTER = "default"


def _adapter(ctx: StageContext, stage: str) -> str | None:
    """The adapter of policy `stage` on the evaluation model; None for the base (adapters off)."""
    if stage == ctx.stage.roles["base"]:
        return None
    return ADAPTER if stage == ctx.stage.roles["policy"] else stage


# --- the evaluation model ---------------------------------------------------------------------


def _lm_eval_sft(ctx: StageContext) -> str | None:
    """The stage `evaluate.lm_eval`'s `sft` names: the last SFT stage of the final policy's
    lineage (the final policy itself when it is one); None when not asked for or there is none."""
    cfg = ctx.recipe.evaluate.lm_eval
    if cfg is None or "sft" not in cfg.policies:
        return None
    graph = ctx.recipe.graph()
    return next(
        (n for n in graph.lineage(ctx.stage.roles["policy"]) if graph.get(n).kind.name == "sft"),
        None,
    )


def _evaluation_model(ctx: StageContext, device: torch.device) -> tuple[PeftModel, Any]:
    """(the base + the final policy's adapter, active as ADAPTER, + every other policy the
    evaluation compares, each named after its stage, in eval mode; the base's tokenizer)."""
    base, tok = load_base(
        ctx.role_dir("base"), ctx.role_manifest("base"), attention=ctx.recipe.infra.attention
    )
    graph = ctx.recipe.graph()
    final = ctx.stage.roles["policy"]
    others = [ctx.stage.roles.get("parent")]
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
    return model.to(device).eval(), tok


# --- the families, each on the models it scores -----------------------------------------------


def _heldout_loss(
    ctx: StageContext, model: PeftModel, tok: Any, stage: str, examples: list[dict]
) -> dict[str, float]:
    """Held-out loss/perplexity of policy `stage` (the `base` role's name: the base)."""
    return policy_heldout_loss(
        model,
        _adapter(ctx, stage),
        examples,
        tok.pad_token_id,
        ctx.recipe.evaluate.batch_size,
        ctx.recipe.infra.logits_chunk_tokens,
    )


def _heldout(ctx: StageContext, model: PeftModel, tok: Any, examples: list[dict]) -> dict[str, Any]:
    """The held-out report: the base's and the final policy's ("tuned") scores on `examples`
    (`run` adds the parent's once the merged-model figures are taken)."""
    final = ctx.stage.roles["policy"]
    base = _heldout_loss(ctx, model, tok, ctx.stage.roles["base"], examples)
    tuned = _heldout_loss(ctx, model, tok, final, examples)
    log.info(
        "held-out loss: base %.4f -> %s %.4f (perplexity %.2f -> %.2f)",
        base["loss"],
        final,
        tuned["loss"],
        base["perplexity"],
        tuned["perplexity"],
    )
    return {"base": base, "tuned": tuned, "rows": len(examples)}


def _answers(
    ctx: StageContext, model: PeftModel, tok: Any, held: HeldOut, held_out: bool
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(greedy exact match of the base and the final policy, when the rows are held out and the
    recipe has a greedy setting; the samples: the base's greedy answers, then the final
    policy's under every setting, on the first `num_prompts` prompts)."""
    cfg, seed = ctx.recipe.evaluate, ctx.recipe.run.seed
    n = min(cfg.num_prompts, len(held.prompts))
    prompts, refs = held.prompts[:n], held.refs[:n]
    exact: dict[str, float] = {}
    rows: list[dict[str, Any]] = []
    greedy = next((s for s in cfg.sampling if s.strategy == "greedy"), None)
    if greedy is not None and held_out:
        final = (ctx.stage.roles["policy"], ADAPTER)
        exact, base_out = base_vs_tuned(
            model, tok, held.prompts, held.refs, greedy, seed, cfg.batch_size, final
        )
        rows += sample_rows(f"base/{greedy.name}", prompts, refs, base_out[:n])
    rows += policy_samples(model, tok, prompts, refs, cfg.sampling, seed, cfg.batch_size)
    return exact, rows


def _merged_final(
    ctx: StageContext, model: PeftModel, tok: Any, prompts: list[str], device: Any
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(decode-speed figures, lm_eval report), each None when off, of the final policy with its
    LoRA merged (what export ships): one merged copy serves both, made only when one is on."""
    cfg = ctx.recipe.evaluate
    if cfg.speed is None and cfg.lm_eval is None:
        return None, None
    merged = merged_copy(model, ADAPTER)
    inference = None
    if cfg.speed is not None:
        ids = inference_prompt(tok, prompts, cfg.speed.prompt_tokens).to(device)
        inference = decode_speed(merged, ids, cfg.speed)
    return inference, _lm_eval(ctx, model, tok, merged)


def decode_speed(merged: Any, prompt_ids: torch.Tensor, speed: SpeedConfig) -> dict[str, Any]:
    """`evaluate.speed` on the merged policy: the cached decode, and the uncached (quadratic,
    ~10x the time) baseline when `no_cache`."""
    t0 = time.perf_counter()
    if speed.no_cache:
        inference = compare_cache_modes(merged, prompt_ids, speed.new_tokens, speed.repeats)
    else:
        cached = measure_inference(merged, prompt_ids, speed.new_tokens, True, speed.repeats)
        inference = {"cache": cached}
    for mode in ("cache", "no_cache"):
        inference.get(mode, {}).pop("token_ids", None)
    inference["seconds"] = round(time.perf_counter() - t0, 2)
    cache = inference["cache"]
    log.info(
        "decode speed (merged, %d prompt + %d new tokens, %d timed run(s)): %.1f tok/s, "
        "TTFT %.1f ms, TPOT %.1f ms%s; measured in %.1f s",
        speed.prompt_tokens,
        speed.new_tokens,
        speed.repeats,
        cache["tokens_per_s"],
        1e3 * cache["ttft_s"],
        1e3 * (cache["tpot_s"] or 0),
        f"; no cache {inference['no_cache']['tokens_per_s']:.1f} tok/s" if speed.no_cache else "",
        inference["seconds"],
    )
    return inference


def _lm_eval(ctx: StageContext, model: PeftModel, tok: Any, merged: Any) -> dict[str, Any] | None:
    """`evaluate.lm_eval` on the base, the SFT and the final policy (`merged`); None when off."""
    cfg = ctx.recipe.evaluate.lm_eval
    if cfg is None:
        return None
    graph = ctx.recipe.graph()
    base = ctx.stage.roles["base"]
    stages = {"base": base, "sft": _lm_eval_sft(ctx), "final": ctx.stage.roles["policy"]}
    kinds = {s: "base" if s == base else graph.get(s).kind.name for s in stages.values() if s}
    return harness_report(model, tok, stages, kinds, merged, cfg, ctx.recipe.run.seed)


def _preferences(
    ctx: StageContext, model: PeftModel, tok: Any, device: torch.device
) -> tuple[dict[str, Any], PeftModel | None]:
    """(reward-model accuracy, implicit-reward accuracy, win-rate against the parent, each
    when the run has what it needs; the reward model or None)."""
    cfg = ctx.recipe.evaluate
    final = ctx.stage.roles["policy"]
    out: dict[str, Any] = {}
    rm = None
    if ctx.has_role("reward_model"):
        ingest = ctx.role_manifest("base")["summary"]
        rm = load_reward_model(
            ingest["model_dir"],
            ctx.role_dir("reward_model") / "adapter",
            tok.pad_token_id,
            ingest.get("trust_remote_code", False),
        ).to(device)
        pairs = stage_pairs(ctx, ctx.stage.roles["reward_model"], tok)
        out["reward_model"] = reward_accuracy(rm, pairs, tok.pad_token_id, cfg.batch_size)
        log.info("reward model held-out accuracy %.3f", out["reward_model"]["accuracy"])
    node = ctx.recipe.graph().get(final)
    if node.kind.data == "pairs" and "reference" in node.links:
        out["dpo_implicit"] = implicit_reward_accuracy(
            model,
            ADAPTER,
            node.links["reference"],
            stage_pairs(ctx, final, tok),
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
        parent = ctx.stage.roles["parent"]
        prompts = stage_prompts(ctx, final, cfg.win_rate_prompts)
        wr = policy_win_rate(
            model, tok, rm, prompts, (final, ADAPTER), parent, cfg, ctx.recipe.run.seed
        )
        if wr is not None:
            write_rows(ctx.stage.out_dir / "win_rate_samples.jsonl", wr.pop("examples"))
            out["win_rate_vs_parent"] = {"parent": parent, **wr}
    return out, rm


def _verifiers(ctx: StageContext, model: PeftModel, tok: Any) -> dict[str, Any] | None:
    """Pass@1 under the verifiers of the base, parent, final policy and `evaluate.policies`,
    pass@k of those `evaluate.pass_k_policies` samples; None without verifiers or prompts with
    references."""
    specs = verifier_specs(ctx)
    found = verifier_prompts(ctx) if specs is not None else None
    if found is None:
        return None
    prompts, origin = found
    funcs = load_rewards(specs, where=verifiers_field(ctx))
    episodes = verifier_episodes(ctx, tok, model_stop_token_ids(model, tok))
    final, graph = ctx.stage.roles["policy"], ctx.recipe.graph()
    base = ctx.stage.roles["base"]
    names = [base, ctx.stage.roles.get("parent"), final, *ctx.recipe.evaluate.policies]
    policies = {
        n: _adapter(ctx, n) for n in dict.fromkeys(x for x in names if x) if n == base or n in graph
    }
    setting = ctx.recipe.evaluate.pass_k_policies
    with judge_servers(funcs, ctx.stage.out_dir):  # a judge verifier's server, if any
        report, examples = verifier_report(
            model,
            tok,
            prompts,
            origin,
            funcs,
            policies,
            [n for n in policies if samples_pass_k(n, final, setting)],
            ctx.recipe.evaluate,
            ctx.recipe.run.seed,
            episodes,
        )
    write_rows(ctx.stage.out_dir / "verify_samples.jsonl", examples[final])
    return report


def _side_by_side(
    ctx: StageContext,
    model: PeftModel,
    tok: Any,
    rm: PeftModel | None,
    held: HeldOut,
    base: dict[str, float],
) -> dict[str, Any]:
    """`evaluate.policies`, each against its parent; a policy's win-rate is judged on its own
    stage's held-out prompts, else on the evaluation prompts."""
    cfg = ctx.recipe.evaluate
    graph = ctx.recipe.graph()
    turns = [[{"role": "user", "content": p}] for p in held.prompts]
    links = []
    for n in cfg.policies:
        parent = graph.parent(n)
        win = None
        if rm is not None and parent in graph:  # a win-rate needs the parent's adapter
            win = stage_prompts(ctx, n, cfg.win_rate_prompts) or turns[: cfg.win_rate_prompts]
        links.append(Link(n, graph.get(n).kind.name, parent, _adapter(ctx, n), win))
    return compare_policies(
        model,
        tok,
        rm,
        links,
        held,
        base,
        ctx.stage.roles["base"],
        cfg,
        ctx.recipe.run.seed,
        ctx.recipe.infra.logits_chunk_tokens,
    )


def _teacher(
    ctx: StageContext,
    model: PeftModel,
    tok: Any,
    held: HeldOut,
    exact: dict[str, float],
    rows: list[dict],
    verified: dict[str, Any] | None,
    device: torch.device,
) -> dict[str, Any]:
    """A distilled policy's teacher beside it: the parent's and the teacher's exact match
    (added to `exact`), the share of the gap between them the final policy closed, the
    teacher's verifier figures (added to `verified`). Returns the report's `teacher` and
    `teacher_gap_closed`."""
    cfg, seed = ctx.recipe.evaluate, ctx.recipe.run.seed
    greedy = next((s for s in cfg.sampling if s.strategy == "greedy"), None)
    parent = ctx.stage.roles.get("parent")
    if exact and greedy is not None and parent is not None:
        answers = greedy_answers(
            model, _adapter(ctx, parent), tok, held.prompts, greedy, seed, cfg.batch_size
        )
        exact["parent"] = exact_match(answers, held.refs)
    scores = teacher_scores(ctx, rows if exact else [], greedy, verified is not None, device)
    out: dict[str, Any] = {"teacher": {"stage": scores["stage"], "base": scores["base"]}}
    if "exact_match" in scores:
        exact["teacher"] = scores["exact_match"]
        start = exact.get("parent", exact["base"])
        gap = teacher_gap_closed(start, exact["tuned"], exact["teacher"])
        if gap is not None:  # None: the teacher does not beat the start, no gap to close
            out["teacher_gap_closed"] = gap
        log.info(
            "teacher %s: exact match %.3f; %s closed %s of the gap from %s",
            scores["stage"],
            exact["teacher"],
            ctx.stage.roles["policy"],
            "no gap" if gap is None else f"{gap:.3f}",
            parent or ctx.stage.roles["base"],
        )
    if verified is not None and "verifier" in scores:
        verified["policies"][scores["stage"]] = scores["verifier"]
        if "sampled_pass@1" in scores["verifier"]:  # evaluate.pass_k_policies asked for it
            verified["sampled"].append(scores["stage"])
    return out


# --- the summary ------------------------------------------------------------------------------


def _headline(report: dict[str, Any], base: str) -> dict[str, float]:
    """The figures promotion rules and the run report compare."""
    heldout, exact = report["heldout"], report["exact_match"]
    headline: dict[str, float] = {}
    if heldout is not None:
        headline |= {
            "base_loss": heldout["base"]["loss"],
            "tuned_loss": heldout["tuned"]["loss"],
            "tuned_ppl": heldout["tuned"]["perplexity"],
        }
    if exact:
        headline |= {"exact_match_base": exact["base"], "exact_match_tuned": exact["tuned"]}
        headline |= {f"exact_match_{k}": exact[k] for k in ("parent", "teacher") if k in exact}
    if report.get("teacher_gap_closed") is not None:
        headline["teacher_gap_closed"] = report["teacher_gap_closed"]
    if heldout is not None and "parent" in heldout:
        headline["parent_loss"] = heldout["parent"]["loss"]
    if report["inference"] is not None:
        headline["decode_tok/s"] = report["inference"]["cache"]["tokens_per_s"]
    if "reward_model" in report:
        headline["rm_accuracy"] = report["reward_model"]["accuracy"]
    if "dpo_implicit" in report:
        headline["dpo_accuracy"] = report["dpo_implicit"]["accuracy"]
    if "verifier" in report:
        k, by = report["verifier"]["k"], report["verifier"]["policies"]
        final = report["policy"]
        headline["pass@1"] = by[final]["pass@1"]  # greedy
        if k > 1:
            headline[f"pass@{k}"] = by[final][f"pass@{k}"]
        if report["parent"] in by:
            headline["pass@1_parent"] = by[report["parent"]]["pass@1"]
        headline["pass@1_base"] = by[base]["pass@1"]
        teacher = (report.get("teacher") or {}).get("stage")
        if teacher in by:
            headline["pass@1_teacher"] = by[teacher]["pass@1"]
    if "win_rate_vs_parent" in report:
        wr = report["win_rate_vs_parent"]
        headline |= {
            "win_rate_vs_parent": wr["win_rate"],
            "wins": wr["wins"],
            "losses": wr["losses"],
            "ties": wr["ties"],
        }
    harness = report.get("lm_eval")
    if harness is not None and "final" in harness["policies"]:
        headline |= lm_eval_headline(harness["policies"]["final"]["scores"], harness["tasks"])
    return {k: round(v, 4) for k, v in headline.items()}


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.recipe.evaluate
    device = torch.device("cuda" if ctx.recipe.infra.device == "cuda" else "cpu")
    model, tok = _evaluation_model(ctx, device)
    final = ctx.stage.roles["policy"]
    parent = ctx.stage.roles.get("parent")  # None: the final policy started from the base

    rows, held_out = conversations(ctx)
    examples: list[dict] = []
    heldout: dict[str, Any] | None = None
    if held_out:
        examples, _ = tokenize_rows(rows, tok, ctx.recipe.stage(ctx.stage.roles["heldout"]).data)
        heldout = _heldout(ctx, model, tok, examples)
    held = HeldOut(examples, *prompts_and_refs(ctx, tok, rows))
    exact, samples = _answers(ctx, model, tok, held, held_out)
    write_rows(ctx.stage.out_dir / "samples.jsonl", samples)
    inference, harness = _merged_final(ctx, model, tok, held.prompts, device)
    if heldout is not None and parent is not None:
        # How far the last stage moved the policy from its parent's fit.
        heldout["parent"] = _heldout_loss(ctx, model, tok, parent, examples)

    report: dict[str, Any] = {
        "policy": final,
        "parent": parent,
        "heldout": heldout,
        "exact_match": exact,
        "inference": inference,
        "samples": len(samples),
    }
    prefs, rm = _preferences(ctx, model, tok, device)
    report |= prefs
    verified = _verifiers(ctx, model, tok)
    if verified is not None:
        report["verifier"] = verified
    if ctx.has_role("teacher"):
        held_rows = rows if held_out else []
        report |= _teacher(ctx, model, tok, held, exact, held_rows, verified, device)
    if harness is not None:
        report["lm_eval"] = harness
    if cfg.policies:
        base = {"loss": heldout["base"]["loss"]} if heldout is not None else {}
        if "base" in exact:
            base["exact_match"] = exact["base"]
        report["policies"] = _side_by_side(ctx, model, tok, rm, held, base)
    (ctx.stage.out_dir / "eval.json").write_text(jsonsafe.dumps(report, indent=2))
    return {**report, "headline": _headline(report, ctx.stage.roles["base"])}


if __name__ == "__main__":
    stage_main(run)
