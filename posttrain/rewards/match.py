"""Exact match of a completion against the row's reference answer, after light normalisation.

The verifier for answers that are short sentences or word lists, such as posttrain's quickstart
tasks ("14 + 39 = 53.", "apple river stone", "The capital of France is Paris."). Contract, as for
every built-in reward: `fn(prompts, completions, **kwargs) -> list[float | None]`; the reference
comes in the data column `answer`. For numbers written many ways use `posttrain.rewards.math`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from difflib import SequenceMatcher

from posttrain.rewards.extract import completion_text

__all__ = [
    "against_reference",
    "exact_match",
    "normalize",
    "reference_or_none",
    "require_column",
    "token_similarity",
]

_QUOTES = "\"'`\u201c\u201d\u2018\u2019"


def normalize(text: str) -> str:
    """Strip, casefold, collapse whitespace, drop surrounding quotes and one trailing period.

    `' "The  capital is Paris." '` -> `the capital is paris`.
    """
    text = re.sub(r"\s+", " ", text.casefold()).strip()
    for _ in range(2):  # '"Paris."' and '"Paris".' both reduce to paris
        if len(text) >= 2 and text[0] in _QUOTES and text[-1] in _QUOTES:
            text = text[1:-1].strip()
        if text.endswith("."):
            text = text[:-1].rstrip()
    return text


def reference_or_none(value: object) -> str | None:
    """A row's reference as text, or None when the row has none (None or blank)."""
    if value is None:
        return None
    text = str(value)
    return text if text.strip() else None


def require_column(fn_name: str, column: str, values: list | None) -> list:
    """The column's values; a clear TypeError when the data has no such column."""
    if values is None:
        raise TypeError(
            f"{fn_name} needs the data column {column!r} (passed as the keyword {column}=[...]); "
            f"the prompt rows have none"
        )
    return values


def against_reference(
    fn_name: str,
    completions: list,
    answer: list | None,
    score: Callable[[str, str], float],
) -> list[float | None]:
    """score(completion text, reference text) for each row with a reference, None for rows
    without one; a TypeError naming `fn_name` when the data has no `answer` column."""
    answers = require_column(fn_name, "answer", answer)
    scores: list[float | None] = []
    for completion, ref in zip(completions, answers, strict=True):
        ref_text = reference_or_none(ref)
        scores.append(None if ref_text is None else score(completion_text(completion), ref_text))
    return scores


def exact_match(
    prompts: list, completions: list, answer: list | None = None, **kwargs
) -> list[float | None]:
    """1.0 where normalize(completion) == normalize(answer), else 0.0; None for rows without one."""
    return against_reference(
        "exact_match", completions, answer, lambda c, r: float(normalize(c) == normalize(r))
    )


def _similarity(completion: str, reference: str) -> float:
    a, b = normalize(completion).split(), normalize(reference).split()
    return SequenceMatcher(None, a, b, autojunk=False).ratio() if a or b else 1.0


def token_similarity(
    prompts: list, completions: list, answer: list | None = None, **kwargs
) -> list[float | None]:
    """Partial credit in [0, 1]: 2 x (matched tokens, in order) / (tokens of both), over the
    normalised whitespace tokens (difflib's ratio on token lists); 1.0 exactly when
    `exact_match` is 1. Order counts, so a list copied unsorted scores below a sorted one; a
    denser signal than exact match for a policy that rarely gets everything right. None for
    rows without a reference."""
    return against_reference("token_similarity", completions, answer, _similarity)
