"""Format rewards: does the completion have the required shape, and did it end on its own?

Contract, as for every built-in reward: `fn(prompts, completions, **kwargs) -> list[float | None]`.
`tag_format` checks the text against a regex (the think/answer layout of R1-style training by
default); `missing_eos` penalises replies cut off at max_new_tokens, read from the `stopped` column
the online RL stage passes (True when the reply ended with a stop token).
"""

from __future__ import annotations

import math
import re

from posttrain.rewards.extract import completion_text
from posttrain.rewards.match import require_column

__all__ = ["missing_eos", "tag_format"]

THINK_ANSWER = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


def tag_format(
    prompts: list, completions: list, pattern: str = THINK_ANSWER, **kwargs
) -> list[float | None]:
    """1.0 where the whole completion (surrounding whitespace stripped) matches `pattern`, else 0.0.

    The match is `re.fullmatch` with DOTALL, so `.` spans lines. A chat template whose generation
    prompt already opens the think block (DeepSeek-R1's ends in `<think>\\n`) needs a pattern
    without the leading `<think>`.
    """
    try:
        regex = re.compile(pattern, flags=re.DOTALL)
    except re.error as e:
        raise ValueError(f"tag_format: pattern {pattern!r} is not a valid regex: {e}") from e
    return [float(regex.fullmatch(completion_text(c).strip()) is not None) for c in completions]


def missing_eos(
    prompts: list, completions: list, stopped: list | None = None, penalty: float = -1.0, **kwargs
) -> list[float | None]:
    """`penalty` where the reply did not stop on its own (`stopped` False), else 0.0."""
    flags = require_column("missing_eos", "stopped", stopped)
    if not math.isfinite(penalty):
        raise ValueError(f"missing_eos: penalty must be finite, got {penalty!r}")
    return [0.0 if bool(s) else float(penalty) for s in flags]
