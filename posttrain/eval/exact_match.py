"""Greedy exact match: the share of held-out prompts a policy answers with the reference reply
itself (surrounding whitespace aside).

Greedy decoding, because exact match of a sampled answer measures the sampler as much as the
policy; the policies are adapters of one model (`as_policy`), so the base and every policy answer
the same templated prompts with the same decoding setting and seeds.
"""

from __future__ import annotations

import logging
from typing import Any

from peft import PeftModel

from posttrain.eval.generation import generate
from posttrain.models.adapters import as_policy
from posttrain.sections.shared import SamplingConfig

log = logging.getLogger("posttrain.evaluate")


def exact_match(outputs: list[str], refs: list[str]) -> float:
    """Share of `outputs` equal to their reference (`refs[i]`), both stripped."""
    return sum(o.strip() == r.strip() for o, r in zip(outputs, refs, strict=True)) / len(refs)


def greedy_answers(
    model: PeftModel,
    adapter: str | None,
    tok: Any,
    prompts: list[str],
    greedy: SamplingConfig,
    seed: int,
    batch_size: int,
) -> list[str]:
    """The answers of the policy of `adapter` (None = the base) to `prompts`, under `greedy`."""
    with as_policy(model, adapter):
        return generate(model, tok, prompts, greedy, seed, batch_size)


def base_vs_tuned(
    model: PeftModel,
    tok: Any,
    prompts: list[str],
    refs: list[str],
    greedy: SamplingConfig,
    seed: int,
    batch_size: int,
    tuned: tuple[str, str],
) -> tuple[dict[str, float], list[str]]:
    """({"base", "tuned"} exact match, the base's answers, for the samples); `tuned` = (its
    stage name, its adapter on `model`)."""
    name, adapter = tuned
    base_out = greedy_answers(model, None, tok, prompts, greedy, seed, batch_size)
    tuned_out = greedy_answers(model, adapter, tok, prompts, greedy, seed, batch_size)
    exact = {"base": exact_match(base_out, refs), "tuned": exact_match(tuned_out, refs)}
    log.info(
        "greedy exact match on %d held-out prompts: base %.3f -> %s %.3f",
        len(refs),
        exact["base"],
        name,
        exact["tuned"],
    )
    return exact, base_out
