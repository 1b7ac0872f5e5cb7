"""What evaluate scores each policy on, read from its parents' artifacts: the held-out
conversations (or, without a held-out split, training rows for samples and latency only), a
stage's held-out prompts and preference pairs, and the verifiers with their prompts.

The choices here (which stage's rows, how many, what stands in when a split is missing) are the
stage's; `posttrain/eval/` computes on whatever it is given.
"""

from __future__ import annotations

import logging
from typing import Any

from posttrain.data.chat import prompt_text
from posttrain.data.preference import encode_pairs
from posttrain.data.sft_data import saved_split
from posttrain.eval.verify import VerifyPrompts
from posttrain.rl.rollout.multiturn import EpisodeSetup, episode_setup
from posttrain.runtime.context import StageContext
from posttrain.sections.rewards import RewardSpec

log = logging.getLogger("posttrain.evaluate")


def conversations(ctx: StageContext) -> tuple[list[dict], bool]:
    """(rows, held out?): the held-out conversations of the nearest stage of the final policy's
    lineage that trained on conversations. No such stage (say, ORPO started from the base): no
    rows, so loss and exact match are left out and the samples use the final stage's own
    prompts. A stage without a held-out split: its training rows, not held out."""
    cfg = ctx.recipe.evaluate
    if not ctx.has_role("heldout"):
        return [], False
    source = ctx.role_dir("heldout")
    rows = saved_split(source, "eval")[: cfg.max_eval_rows]
    if rows:
        return rows, True
    # No held-out split (eval_fraction 0, no eval_path): there is nothing unseen to score, so
    # loss and exact match are left out rather than measured on training rows; samples and the
    # inference benchmark still need prompts, and take training ones.
    log.warning(
        "no held-out rows (%s.data.eval_fraction is 0 and no eval_path): held-out loss "
        "and exact match are skipped; samples and the inference benchmark use training "
        "prompts",
        ctx.stage.roles["heldout"],
    )
    return saved_split(source, "train")[: cfg.max_eval_rows], False


def stage_prompts(ctx: StageContext, stage: str, n: int) -> list[Any]:
    """Up to `n` held-out prompts of stage `stage` (its data/eval.jsonl rows' `prompt`)."""
    return [r["prompt"] for r in saved_split(ctx.parent_dir(stage), "eval") if "prompt" in r][:n]


def prompts_and_refs(ctx: StageContext, tok: Any, rows: list[dict]) -> tuple[list, list]:
    """(templated prompts, reference replies) of `rows`; without rows, the final stage's own
    held-out prompts with empty references."""
    if rows:
        pairs = (prompt_text(tok, r["messages"], r.get("tools")) for r in rows)
        prompts, refs = zip(*pairs, strict=True)
        return list(prompts), list(refs)
    own = stage_prompts(ctx, ctx.stage.roles["policy"], ctx.recipe.evaluate.max_eval_rows)
    as_turns = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in own]
    prompts = [prompt_text(tok, [*p, {"role": "assistant", "content": ""}])[0] for p in as_turns]
    return prompts, [""] * len(prompts)


def stage_pairs(ctx: StageContext, stage: str, tok: Any) -> list[dict]:
    """Encoded held-out pairs of a preference stage (its data/eval.jsonl, its length limits)."""
    cfg = ctx.recipe.stage(stage).data
    rows = saved_split(ctx.parent_dir(stage), "eval")
    return encode_pairs(
        tok, rows[: ctx.recipe.evaluate.max_eval_rows], cfg.max_seq_len, cfg.max_prompt_len, "skip"
    )[0]


def verifier_specs(ctx: StageContext) -> list[RewardSpec] | None:
    """`evaluate.verifiers`, else the first reward function of the verifier stage (the nearest
    of the lineage with `rewards` or an environment); [] when that stage's environment is the
    only verifier; None for `evaluate.verifiers: []` or when there is none."""
    cfg = ctx.recipe.evaluate
    if cfg.verifiers is not None:
        return cfg.verifiers or None
    source = ctx.stage.roles.get("verifier")
    if source is not None and ctx.recipe.stage(source).rewards:
        return ctx.recipe.stage(source).rewards[:1]
    if source is not None and _has_environment(ctx.recipe.stage(source)):
        return []  # its episodes' environment is the verifier
    return None


def verifiers_field(ctx: StageContext) -> str:
    """The recipe field `verifier_specs` came from (`evaluate.verifiers`, `grpo.rewards`), which
    a misbehaving function's error starts with."""
    source = ctx.stage.roles.get("verifier")
    if ctx.recipe.evaluate.verifiers is not None or source is None:
        return "evaluate.verifiers"
    return f"{ctx.recipe.graph().get(source).where}.rewards"


def _has_environment(section: Any) -> bool:
    rollout = getattr(section, "rollout", None)
    return rollout is not None and rollout.environment is not None


def verifier_episodes(ctx: StageContext, tok: Any, stop_ids: list[int]) -> EpisodeSetup | None:
    """The verifier stage's episodes (its rollout's tools or environment, its limits) when it
    rolled out multi-turn: the pass@k report then plays episodes too."""
    source = ctx.stage.roles.get("verifier")
    rollout = getattr(ctx.recipe.stage(source), "rollout", None) if source else None
    if rollout is None or not rollout.episodes:
        return None
    # The verifiers score these episodes, whatever the environment rewards.
    what = f"the policies evaluated on {source}'s episodes"
    return episode_setup(rollout, tok, stop_ids, what, rewarded=True)


def verifier_prompts(ctx: StageContext) -> tuple[VerifyPrompts, str] | None:
    """(held-out prompts with references, where they come from): the verifier stage's held-out
    prompts, else the held-out conversations; None when there are none."""
    rows: list[dict] = []
    if ctx.has_role("verifier"):
        # Prompts saved without their columns (an artifact from before they were kept) have no
        # references to check against: the held-out conversations have them.
        rows = [r for r in saved_split(ctx.role_dir("verifier"), "eval") if len(r) > 1]
        origin = f"{ctx.stage.roles['verifier']} held-out prompts"
    if not rows and ctx.has_role("heldout"):
        rows = saved_split(ctx.role_dir("heldout"), "eval")
        origin = f"{ctx.stage.roles['heldout']} held-out conversations"
    if not rows:
        log.warning("verifiers but no held-out prompts with references: no pass@k report")
        return None
    prompts = VerifyPrompts.from_rows(rows[: ctx.recipe.evaluate.pass_prompts], origin)
    return (prompts, origin) if prompts.messages else None
