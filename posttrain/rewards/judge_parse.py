"""A judge model's reply -> a score in [0, 1], or None when the reply says no score we can read.

Two rules (`judge.score`):
- `number`: the number after `score:` / `rating:` (also `score =`, `Rating 7`), else the
  reply's last number; a denominator (`7/10`, `8.5 out of 10`) is not a candidate. The number is
  mapped from `judge.range` [lo, hi] to [0, 1]; outside the range it is unparsed (a judge asked
  for 1-10 that says 42 did not follow the rubric).
- `choice`: the choice named in brackets (`[[A]]`, `[A]`, `(A)`), after `answer:` / `choice:` /
  `verdict:`, as the whole reply, or as the only choice word in it; two different choices named
  as words is ambiguous (None). Matching is exact up to case.
"""

from __future__ import annotations

import re

_NUM = r"[-+]?\d+(?:\.\d+)?"
# A number with its denominator, if any: the denominator is consumed, never a candidate.
_VALUE = re.compile(rf"(?<![\w.])({_NUM})(?:\s*(?:/|out of)\s*{_NUM})?", re.IGNORECASE)
_KEYWORD = re.compile(rf"\b(?:score|rating)\b\s*(?:is\s*)?[:=]?\s*\**\s*({_NUM})", re.IGNORECASE)
_LEAD = re.compile(r"\b(?:answer|choice|verdict)\b\s*(?:is\s*)?[:=]?\s*\**\s*([^\s*.,;:!?]+)", re.I)


def parse_number(reply: str, lo: float, hi: float) -> float | None:
    """The reply's score mapped from [lo, hi] to [0, 1], or None (no number, or out of range)."""
    text = reply.replace("\u2212", "-")
    m = _KEYWORD.search(text)
    if m is not None:
        value = float(m[1])
    else:
        found = _VALUE.findall(text)
        if not found:
            return None
        value = float(found[-1])
    if not lo <= value <= hi:
        return None
    return (value - lo) / (hi - lo)


def parse_choice(reply: str, choices: dict[str, float]) -> float | None:
    """The score of the choice the reply names, or None (none named, or ambiguous)."""
    by_key = {k.strip().lower(): v for k, v in choices.items()}
    key = choice_key(reply, list(by_key))
    return None if key is None else by_key[key]


def choice_key(reply: str, keys: list[str]) -> str | None:
    """Which of `keys` (lower case) the reply names, by the rules of the module docstring."""
    text = reply.strip()
    bracketed = re.findall(r"\[\[\s*([^\]]+?)\s*\]\]|\[\s*([^\]]+?)\s*\]|\(\s*([^)]+?)\s*\)", text)
    named = {next(g for g in groups if g).lower() for groups in bracketed}
    hits = [k for k in keys if k in named]
    if len(hits) == 1:
        return hits[0]
    m = _LEAD.search(text)
    if m is not None and m[1].lower() in keys:
        return m[1].lower()
    whole = text.strip("*.!:;\"'` \n\t").lower()
    if whole in keys:
        return whole
    words = {w.lower() for w in re.findall(r"[\w-]+", text)}
    hits = [k for k in keys if k in words]
    return hits[0] if len(hits) == 1 else None
