"""`evaluate.policies` side by side: each listed policy against its own parent, so a chain
(`[sft, dpo, grpo]`) shows what each link gained: held-out loss, greedy exact match and, with a
reward model, the win-rate against the parent.

Every policy is an adapter of the one evaluation model (`as_policy`), scored on the same held-out
examples and prompts, so the rows compare like with like.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftModel

from posttrain.eval.exact_match import exact_match, greedy_answers
from posttrain.eval.heldout import policy_heldout_loss
from posttrain.eval.preference_eval import policy_win_rate
from posttrain.kinds.evaluate import EvaluateConfig

log = logging.getLogger("posttrain.evaluate")


@dataclass(frozen=True)
class Link:
    """One listed policy of the chain and what it is judged against."""

    name: str  # its stage
    kind: str  # its stage's kind
    parent: str  # the stage it started from (its base's name for a base)
    adapter: str  # its adapter on the evaluation model
    # The prompts its answers and its parent's are judged on by the reward model; None when
    # there is no win-rate to take (no reward model, or a parent that is no policy: the base).
    win_prompts: list[list[dict]] | None


@dataclass(frozen=True)
class HeldOut:
    """What every policy is scored on: tokenized held-out rows (loss; none when the run has no
    held-out split) and their templated prompts with reference replies (exact match)."""

    examples: list[dict]
    prompts: list[str]
    refs: list[str]


def compare_policies(
    model: PeftModel,
    tok: Any,
    rm: torch.nn.Module | None,
    links: list[Link],
    held: HeldOut,
    base: dict[str, float],
    base_name: str,
    cfg: EvaluateConfig,
    seed: int,
    chunk_tokens: int,
) -> dict[str, Any]:
    """stage -> its row {kind, parent[, loss, exact_match][, win_rate_vs_parent]}, in order;
    `base`'s figures first (as `base_name`) when a listed policy started from the base."""
    out: dict[str, Any] = {}
    if base and any(link.parent == base_name for link in links):
        out[base_name] = {"kind": "base", "parent": "", **base}
    greedy = next((s for s in cfg.sampling if s.strategy == "greedy"), None)
    for link in links:
        row: dict[str, Any] = {"kind": link.kind, "parent": link.parent}
        if held.examples:
            row["loss"] = policy_heldout_loss(
                model, link.adapter, held.examples, tok.pad_token_id, cfg.batch_size, chunk_tokens
            )["loss"]
            if greedy is not None:
                answers = greedy_answers(
                    model, link.adapter, tok, held.prompts, greedy, seed, cfg.batch_size
                )
                row["exact_match"] = exact_match(answers, held.refs)
        if rm is not None and link.win_prompts is not None:
            wr = policy_win_rate(
                model, tok, rm, link.win_prompts, (link.name, link.adapter), link.parent, cfg, seed
            )
            if wr is not None:
                row["win_rate_vs_parent"] = wr["win_rate"]
        out[link.name] = row
        log.info(
            "policy %s (from %s): %s",
            link.name,
            link.parent,
            {k: v for k, v in row.items() if k not in ("kind", "parent")},
        )
    return out
