"""head_to_head: a candidate export against the champion's, judged by the reward model.

Not a stage of the recipe's graph: the promotion gate (flows/gate.py) plans it
(`posttrain.workspace.promotion.head_to_head_stage`) after a completed run whose pipeline has a
champion, and launches it like any stage: `python -m posttrain.stages.head_to_head --spec
<spec.json>`.
Its parents, by role:
  - candidate: this run's export artifact (merged model in model/);
  - champion:  the champion's export artifact;
  - reward:    this run's reward artifact: the judge (adapter/) and the prompts (data/eval.jsonl);
  - ingest:    this run's ingest artifact: the base the reward adapter sits on, its tokenizer.

Both models answer the first `evaluate.win_rate_prompts` prompts of the reward stage's held-out
pairs (never trained on by the judge) under `evaluate.win_rate_sampling` with the run's seed;
the reward model scores both answers to each prompt. Writes samples.jsonl (prompt, both answers,
both scores) and a summary whose headline is `win_rate_vs_champion` = (wins + ties / 2) / n.
Runs as one process on one device, in fp32, like evaluate.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from posttrain.data.sft_data import write_rows
from posttrain.errors import RecipeVerdict
from posttrain.eval.preference_eval import head_to_head
from posttrain.models.loading import load_tokenizer
from posttrain.models.reward import load_reward_model
from posttrain.runtime.context import StageContext, section_path
from posttrain.stages.common import stage_main
from posttrain.workspace.promotion import HEAD_TO_HEAD, WIN_RATE_VS_CHAMPION

log = logging.getLogger("posttrain.head_to_head")


def heldout_prompts(reward_dir: Path, n: int) -> list[list[dict[str, str]]]:
    """The prompts (chat messages) of the first `n` held-out pairs of a reward artifact."""
    lines = (reward_dir / "data" / "eval.jsonl").read_text().splitlines()
    return [json.loads(x)["prompt"] for x in lines if x.strip()][:n]


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.recipe.evaluate
    device = torch.device("cuda" if ctx.recipe.infra.device == "cuda" else "cpu")
    ingest = ctx.parent_manifest("base")["summary"]
    trust = bool(ingest.get("trust_remote_code", False))
    prompts = heldout_prompts(ctx.parent_dir("reward_model"), cfg.win_rate_prompts)
    if not prompts:
        judge = ctx.parents["reward_model"].stage
        raise RecipeVerdict(
            "data.eval_fraction",
            f"the reward artifact {ctx.parent_dir('reward_model')} holds no held-out pairs, "
            "whose prompts the head-to-head against the champion is judged on; set "
            "eval_fraction > 0 or give data.eval_path",
            section_path(ctx.recipe, judge),
        )
    tok = load_tokenizer(ctx.parent_dir("base") / "tokenizer")
    rm = load_reward_model(
        ingest["model_dir"], ctx.parent_dir("reward_model") / "adapter", tok.pad_token_id, trust
    ).to(device)
    result = head_to_head(
        ctx.parent_dir("candidate") / "model",
        ctx.parent_dir("champion") / "model",
        rm,
        tok,
        prompts,
        cfg.win_rate_sampling,
        ctx.recipe.run.seed,
        cfg.batch_size,
        device,
        trust,
    )
    write_rows(ctx.stage.out_dir / "samples.jsonl", result.pop("examples"))
    log.info(
        "candidate vs champion on %d held-out prompts, judged by the reward model: %d wins, "
        "%d losses, %d ties (win-rate %.3f; mean reward %.3f vs %.3f)",
        result["n"],
        result["wins"],
        result["losses"],
        result["ties"],
        result["win_rate"],
        result["mean_reward"]["candidate"],
        result["mean_reward"]["champion"],
    )
    exports = {role: str(ctx.parent_dir(role) / "model") for role in ("candidate", "champion")}
    headline = {
        WIN_RATE_VS_CHAMPION: round(result["win_rate"], 4),
        "wins": result["wins"],
        "losses": result["losses"],
        "ties": result["ties"],
    }
    return {
        **result,
        "exports": exports,
        "prompts_from": "reward data/eval.jsonl",
        "headline": headline,
    }


if __name__ == "__main__":
    stage_main(run, kind=HEAD_TO_HEAD)
