"""The guess task: prompts for a number game played against an environment (the demo's
recipes/guess_number.py), each with the number to find in its `target` column.

The policy says a number, the environment answers "higher" or "lower" until it is found; the
prompt only states the rules and the range, so what the policy learns is how to use the answers.
A reply writes the bounds the answers so far set, then its guess (`= 11 18: 15`): the state of
the game is in the last reply, so a small policy reads it there instead of working it out from
the whole history. The bounds are exclusive so that an answer moves one of them to the guess
itself (a copy, not a subtraction); every number follows a space, so that a byte-level BPE
gives it the same token as a bound and as a guess; and the reply has no word, whose pieces a
small base may have seen too rarely to write reliably. What is left to learn by RL is where
between the bounds to guess.
"""

from __future__ import annotations

import random
from typing import Any

# Two-digit numbers, as the calculator policy it may start from writes them.
LOW, HIGH = 10, 25
SYSTEM_PROMPT = "Find the number. Reply = the two numbers it is between: your guess."


def _rules() -> list[dict[str, str]]:
    question = f"I am thinking of a number from {LOW} to {HIGH}. Guess it."
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def guess_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """n prompt rows (`posttrain.data.prompts` shape), deterministic in seed: the rules as
    system and user turns, the number in `target` (an int: the environment's reset gets it)."""
    rng = random.Random(seed)
    return [
        {"messages": _rules(), "columns": {"target": rng.randint(LOW, HIGH), "task": "guess"}}
        for _ in range(n)
    ]


def guess_sft_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n played games as SFT rows {"messages", "task"}, deterministic in seed: the prompt of
    `guess_prompts`, then replies `= low high: guess` answered "higher"/"lower" until the
    guess is the number. The bounds are what the answers so far set; the guess is drawn at
    random between them: a policy that learns this plays by the rules, and RL has the turns a
    halving search saves left to find."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        target, low, high = rng.randint(LOW, HIGH), LOW - 1, HIGH + 1  # exclusive bounds
        messages = _rules()
        while True:
            guess = rng.randint(low + 1, high - 1)
            messages.append({"role": "assistant", "content": f"= {low} {high}: {guess}"})
            if guess == target:
                break
            if guess < target:
                low = guess
            else:
                high = guess
            messages.append({"role": "user", "content": "higher" if guess < target else "lower"})
        rows.append({"messages": messages, "task": "guess"})
    return rows
