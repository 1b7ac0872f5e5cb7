"""The teacher of a distilled policy, scored beside it: greedy exact match on the same held-out
rows with the same decoding as the base and the tuned policy (`posttrain.eval.exact_match`),
and with verifiers its pass@1 figures (`posttrain.eval.verify`), so a report says how much of the
student-to-teacher gap distillation closed (`posttrain.rl.distill_losses.teacher_gap_closed`).

The teacher stands on a base of its own (the `teacher_base` role), possibly wider and with its
own tokenizer and chat template (an SFT teacher writes text): it is loaded whole on that base,
with its adapter when it is a policy, its prompts rendered with its own tokenizer, and freed
before the evaluation goes on.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch
from peft import PeftModel

from posttrain.eval.exact_match import exact_match
from posttrain.eval.generation import generate
from posttrain.eval.inputs import (
    prompts_and_refs,
    verifier_episodes,
    verifier_prompts,
    verifier_specs,
    verifiers_field,
)
from posttrain.eval.verify import samples_pass_k, verify_policy
from posttrain.models.loading import load_base
from posttrain.models.stop_tokens import model_stop_token_ids
from posttrain.rewards.combine import load_rewards
from posttrain.rewards.judge_server import judge_servers
from posttrain.runtime.context import StageContext
from posttrain.sections.shared import SamplingConfig

log = logging.getLogger("posttrain.evaluate")


def teacher_model(ctx: StageContext, device: torch.device) -> tuple[Any, Any]:
    """(the teacher on its own base, with its frozen adapter active when it is a policy, on
    `device` in eval mode; its base's tokenizer)."""
    base, tok = load_base(
        ctx.role_dir("teacher_base"),
        ctx.role_manifest("teacher_base"),
        attention=ctx.recipe.infra.attention,
    )
    model: Any = base
    if (adapter := ctx.adapter_dir("teacher")) is not None:
        model = PeftModel.from_pretrained(base, str(adapter))
    return model.to(device).eval(), tok


def teacher_scores(
    ctx: StageContext,
    rows: list[dict],
    greedy: SamplingConfig | None,
    verify: bool,
    device: torch.device,
) -> dict[str, Any]:
    """The teacher's exact match on `rows` and verifier figures (when asked); freed after."""
    cfg, seed = ctx.recipe.evaluate, ctx.recipe.run.seed
    out: dict[str, Any] = {
        "stage": ctx.stage.roles["teacher"],
        "base": ctx.stage.roles["teacher_base"],
    }
    model, tok = teacher_model(ctx, device)
    try:
        if greedy is not None and rows:
            prompts, refs = prompts_and_refs(ctx, tok, rows)
            answers = generate(model, tok, prompts, greedy, seed, cfg.batch_size)
            out["exact_match"] = exact_match(answers, refs)
            log.info(
                "greedy exact match on %d held-out prompts: teacher %s %.3f",
                len(refs),
                out["stage"],
                out["exact_match"],
            )
        found = verifier_prompts(ctx) if verify else None
        specs = verifier_specs(ctx) if found is not None else None
        if found is not None and specs is not None:
            funcs = load_rewards(specs, where=verifiers_field(ctx))
            episodes = verifier_episodes(ctx, tok, model_stop_token_ids(model, tok))
            sample = samples_pass_k(out["stage"], ctx.stage.roles["policy"], cfg.pass_k_policies)
            with judge_servers(funcs, ctx.stage.out_dir):
                out["verifier"], _ = verify_policy(
                    model, tok, found[0], funcs, cfg, seed, episodes, sample
                )
            log.info("verifiers: teacher %s %s", out["stage"], out["verifier"])
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
