"""The guess task: prompts for a number game played against an environment (the demo's
recipes/guess_number.py), each with the number to find in its `target` column.

The policy says a number, the environment answers "higher" or "lower" until it is found; the
prompt only states the rules and the range, so what the policy learns is how to use the answers.
"""

from __future__ import annotations

import random
from typing import Any

# Two-digit numbers, as the calculator policy it may start from writes them.
LOW, HIGH = 10, 25
SYSTEM_PROMPT = "Find the number. Reply with a number only."


def guess_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """n prompt rows (`posttrain.data.prompts` shape), deterministic in seed: the rules as
    system and user turns, the number in `target` (an int: the environment's reset gets it)."""
    rng = random.Random(seed)
    question = f"I am thinking of a number from {LOW} to {HIGH}. Guess it."
    return [
        {
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            "columns": {"target": rng.randint(LOW, HIGH), "task": "guess"},
        }
        for _ in range(n)
    ]


def guess_sft_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n played games as SFT rows {"messages", "task"}, deterministic in seed: the prompt of
    `guess_prompts`, then guesses answered "higher"/"lower" until the last one is the number.
    Each guess is drawn at random from the numbers the answers so far leave (never one they
    rule out): a policy that learns this plays by the rules, and RL has the turns a halving
    search saves left to find."""
    rng = random.Random(seed)
    question = f"I am thinking of a number from {LOW} to {HIGH}. Guess it."
    rows = []
    for _ in range(n):
        target, low, high = rng.randint(LOW, HIGH), LOW, HIGH
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
        ]
        while True:
            guess = rng.randint(low, high)
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == target:
                break
            if guess < target:
                low = guess + 1
            else:
                high = guess - 1
            messages.append({"role": "user", "content": "higher" if guess < target else "lower"})
        rows.append({"messages": messages, "task": "guess"})
    return rows
