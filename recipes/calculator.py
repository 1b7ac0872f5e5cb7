"""Calculator tools for the agent demo (`rollout.tools: [calculator:add, ...]`).

They are the calculator task's own functions (`posttrain.data.calculator`), so the SFT traces
of `sft.data.synthetic.task: calculator` and the tools GRPO calls cannot drift apart. Tools of
your own are plain functions like these: type hints and a Google-style docstring with `Args:`.
"""

from posttrain.data.calculator import add, multiply, subtract

__all__ = ["add", "multiply", "subtract"]
