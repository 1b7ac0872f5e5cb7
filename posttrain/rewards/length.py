"""DAPO's soft overlong punishment (Yu et al., 2025, eq. 13): a reward that falls as a reply nears
the token limit, so a policy learns to finish before it is cut off.

Contract, as for every built-in reward: `fn(prompts, completions, **kwargs) -> list[float | None]`.
The length is `len(completion_ids[i])`, the reply's tokens including its stop token, as the online
RL stage passes them. With L the length, M `max_tokens` and B `buffer`:

    r = 0                          if L <= M - B
    r = ((M - B) - L) / B * p      if M - B < L <= M      (linear from 0 down to -p)
    r = -p                         if L > M

`max_tokens` should be the stage's max_new_tokens; DAPO used M = 20480, B = 4096, p = 1.
"""

from __future__ import annotations

import math

from posttrain.rewards.match import require_column

__all__ = ["length_penalty"]


def length_penalty(
    prompts: list,
    completions: list,
    completion_ids: list | None = None,
    max_tokens: int | None = None,
    buffer: int | None = None,
    penalty: float = 1.0,
    **kwargs,
) -> list[float | None]:
    """0 up to `max_tokens - buffer` tokens, then linearly down to `-penalty` at `max_tokens`."""
    ids = require_column("length_penalty", "completion_ids", completion_ids)
    if max_tokens is None or buffer is None:
        raise TypeError(
            "length_penalty needs kwargs max_tokens (the stage's max_new_tokens) and buffer "
            "(the tokens before it where the penalty ramps up)"
        )
    if not 1 <= buffer <= max_tokens:
        raise ValueError(
            f"length_penalty: need 1 <= buffer <= max_tokens, got {buffer=} {max_tokens=}"
        )
    if not (math.isfinite(penalty) and penalty >= 0):
        raise ValueError(f"length_penalty: penalty must be finite and >= 0, got {penalty!r}")
    start = max_tokens - buffer
    scores: list[float | None] = []
    for row in ids:
        n = len(row)
        if n <= start:
            scores.append(0.0)
        elif n <= max_tokens:
            scores.append((start - n) / buffer * penalty)
        else:
            scores.append(-float(penalty))
    return scores
