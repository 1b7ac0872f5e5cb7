"""Calculator tools for the agent demo (`rollout.tools: [calculator:add, ...]`).

The SFT traces of `sft.data.synthetic.task: calculator` call these by name and carry their
schemas (posttrain/data/calculator.py repeats them; a test checks the two agree).
"""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract b from a.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return a - b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
