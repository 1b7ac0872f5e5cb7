"""What the agent tests share: a tool with the shape transformers can describe, and the text a
Qwen-style (`<tool_call>` JSON) policy writes to call it."""

from __future__ import annotations


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def call(a: int, b: int) -> str:
    """The `<tool_call>` block that calls `add(a, b)`."""
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
