"""A number game for the agent demo (`rollout.environment: guess_number:GuessNumber`): an
environment without tools, in the gym-like shape `posttrain.agents.environment` takes.

The policy says a number (the last one of its reply: replies may write its bounds first,
`= 11 18: 15`); the game answers "higher" or "lower" until it is found. Finding it is
worth 1, every turn costs 0.1 whatever happens, so fewer turns to the answer score more and an
episode that never finds it scores below one that does.
"""

from __future__ import annotations

import re
from typing import Any

FOUND_REWARD = 1.0
TURN_COST = 0.1


class GuessNumber:
    """One game; `reset(target)` with the prompt row's `target` column starts it."""

    def __init__(self) -> None:
        self.target = 0

    def reset(self, target: int, **columns: Any) -> str | None:
        # The row's other columns (`task`) are not the game's; nothing is added to the prompt.
        self.target = int(target)
        return None

    def step(self, message: dict[str, Any]) -> tuple[str, float, bool]:
        """(observation, reward, done) for the policy's reply: its last whole number is the
        guess; a reply without one is told so and costs its turn like a wrong guess."""
        numbers = re.findall(r"\d+", message.get("content") or "")
        if not numbers:
            return "Say a number.", -TURN_COST, False
        guess = int(numbers[-1])
        if guess == self.target:
            return "Found it.", FOUND_REWARD - TURN_COST, True
        return ("higher" if guess < self.target else "lower"), -TURN_COST, False
