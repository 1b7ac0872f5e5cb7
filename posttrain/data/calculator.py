"""The calculator task: generated tool-use SFT traces for the agent demo.

Each row asks one two-digit sum, difference or product; the assistant calls the matching tool
(`add(a=37, b=45)`), the tool answers (`82`), and the final assistant turn is exactly the answer,
so an exact-match reward or eval on the `answer` column scores it. The `tools` column holds the
tools' JSON schemas as transformers describes them (`get_json_schema`).

The tools are the functions below; the demo's `recipes/calculator.py` offers them to the RL
stage as `rollout.tools`.
"""

from __future__ import annotations

import json
import random
from typing import Any

from transformers.utils import get_json_schema

SYSTEM_PROMPT = "Use a tool, then give only the number."


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


# (tool, the sign the question writes); addition twice as often as each of the others.
OPERATIONS = ((add, "+"), (add, "+"), (subtract, "-"), (multiply, "*"))


def calculator_schemas() -> list[dict[str, Any]]:
    """The tools' JSON schemas, in the order recipes/calculator.py defines them."""
    return [get_json_schema(fn) for fn in (add, subtract, multiply)]


def _question(rng: random.Random) -> tuple[Any, str, int, int]:
    """(tool, sign, a, b) of one drawn question."""
    fn, sign = OPERATIONS[rng.randrange(len(OPERATIONS))]
    return fn, sign, rng.randint(10, 99), rng.randint(10, 99)


def calculator_sft_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """n rows {"messages", "tools", "answer", "task"}, deterministic in seed: system, the
    question, a tool-call turn, the tool's result, the answer."""
    rng = random.Random(seed)
    tools = calculator_schemas()
    rows = []
    for i in range(n):
        fn, sign, a, b = _question(rng)
        answer = str(fn(a, b))
        call_id = f"call{i:05d}"
        call = {"name": fn.__name__, "arguments": {"a": a, "b": b}}
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {a} {sign} {b}?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "id": call_id, "function": call}],
            },
            {"role": "tool", "name": fn.__name__, "tool_call_id": call_id, "content": answer},
            {"role": "assistant", "content": answer},
        ]
        rows.append({"messages": messages, "tools": tools, "answer": answer, "task": "calculator"})
    return rows


def calculator_corpus(n: int, seed: int) -> list[str]:
    """Plain text shaped like the traces (question, call JSON, the tool's result, the answer
    repeating it), for the tokenizer and warm-up of a from-config base that will learn the task.
    The result comes before the answer, as in a trace: a warm-up that saw the answer right
    after the call would teach the tiny model to guess the sum (the arithmetic the tool is
    for) rather than to read it back, and SFT could not unteach that in minutes."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        fn, sign, a, b = _question(rng)
        call, result = json.dumps({"name": fn.__name__, "arguments": {"a": a, "b": b}}), fn(a, b)
        q = f"What is {a} {sign} {b}?"
        docs.append(f"{q} <tool_call>\n{call}\n</tool_call>\ntool\n{result}\nassistant\n{result}")
    return docs
