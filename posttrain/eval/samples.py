"""What a policy says: its answers to held-out prompts under every decoding setting of the
recipe, as rows of evaluate's samples.jsonl (`{"sampling", "prompt", "reference", "output"}`).

Each setting is its own `generate` call with the run's seed, so a setting's samples do not depend
on which settings came before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from posttrain.eval.generation import generate
from posttrain.sections.shared import SamplingConfig


def sample_rows(
    sampling: str, prompts: Sequence[str], refs: Sequence[str], outputs: Sequence[str]
) -> list[dict[str, Any]]:
    """One samples.jsonl row per prompt under the setting named `sampling`."""
    return [
        {"sampling": sampling, "prompt": p, "reference": r, "output": o}
        for p, r, o in zip(prompts, refs, outputs, strict=True)
    ]


def policy_samples(
    model: Any,
    tok: Any,
    prompts: Sequence[str],
    refs: Sequence[str],
    settings: list[SamplingConfig],
    seed: int,
    batch_size: int,
) -> list[dict[str, Any]]:
    """`sample_rows` of the active adapter's answers under each of `settings`, in order."""
    rows: list[dict[str, Any]] = []
    for s in settings:
        outs = generate(model, tok, list(prompts), s, seed, batch_size)
        rows += sample_rows(s.name, prompts, refs, outs)
    return rows
