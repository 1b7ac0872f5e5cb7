"""Running the tool calls of a turn: every call of every live episode at once, each bounded by
a timeout, each ending as the text the model is told (its result, or what went wrong).

Tools run in this process, on threads, because an environment's tools are methods of a
stateful per-episode object. A call that outlives its timeout cannot be killed: its thread is
a daemon, abandoned (it cannot keep the process from exiting), and the model is told the call
timed out. A tool that raises, an unknown tool or arguments that do not fit the signature
become an error message and a count, never a crashed stage.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.agents.tool_calls import ToolCall

# Why a call failed (None: it returned) -> the metric that counts it.
OUTCOMES = {
    "error": "tool_errors",
    "timeout": "tool_timeouts",
    "unknown_tool": "tool_unknown",
    "bad_arguments": "tool_bad_arguments",
}
MAX_RESULT_CHARS = 4000  # a tool's answer is cut here: it becomes prompt tokens of the next turn


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall
    content: str  # the `tool` message the model reads
    failure: str | None  # a key of OUTCOMES, or None
    seconds: float


def result_text(value: Any) -> str:
    """A tool's return value as the model reads it: strings as they are, other JSON-able
    values as JSON, anything else by `str`; cut at MAX_RESULT_CHARS."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " [cut]"


class _Call(threading.Thread):
    """One call on a daemon thread; `outcome` is set when it ends."""

    def __init__(self, fn: Callable[..., Any], call: ToolCall) -> None:
        super().__init__(daemon=True, name=f"tool-{call.name}")
        self.fn, self.call = fn, call
        self.outcome: tuple[str, str | None] | None = None
        self.started = time.monotonic()
        self.ended: float | None = None

    def run(self) -> None:
        self.started = time.monotonic()
        try:
            value = self.fn(**self.call.arguments)
            self.outcome = (result_text(value), None)
        except Exception as exc:  # a tool's own failure is the model's to read, not ours
            self.outcome = (f"Error: {self.call.name} raised {type(exc).__name__}: {exc}", "error")
        self.ended = time.monotonic()


def _refusal(
    fn: Callable[..., Any] | None, call: ToolCall, names: Sequence[str]
) -> ToolResult | None:
    """The result of a call that cannot start (unknown tool, arguments that do not bind)."""
    if fn is None:
        known = ", ".join(names) or "none"
        return ToolResult(
            call, f"Error: no tool named {call.name!r} (tools: {known})", "unknown_tool", 0.0
        )
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return ToolResult(call, f"Error: {call.name}: {exc}", "bad_arguments", 0.0)
    except ValueError:  # a builtin without a signature: let the call itself decide
        pass
    return None


def run_calls(
    calls: Sequence[Sequence[ToolCall]],
    tools: Sequence[dict[str, Callable[..., Any]]],
    timeout_s: float,
) -> list[list[ToolResult]]:
    """Run `calls[e]` (episode e's calls this turn) with `tools[e]`, all episodes' calls at
    once, each with `timeout_s` from when all started -> each episode's results, in order."""
    if len(calls) != len(tools):
        raise ValueError(f"{len(calls)} episodes' calls but {len(tools)} tool sets")
    results: list[list[ToolResult | _Call]] = []
    for episode_calls, episode_tools in zip(calls, tools, strict=True):
        row: list[ToolResult | _Call] = []
        for call in episode_calls:
            fn = episode_tools.get(call.name)
            refused = _refusal(fn, call, sorted(episode_tools))
            row.append(refused if refused is not None else _Call(fn, call))  # type: ignore[arg-type]
        results.append(row)
    threads = [t for row in results for t in row if isinstance(t, _Call)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [[_finished(t, timeout_s) for t in row] for row in results]


def _finished(item: ToolResult | _Call, timeout_s: float) -> ToolResult:
    if isinstance(item, ToolResult):
        return item
    outcome, ended = item.outcome, item.ended
    if outcome is None or ended is None:  # still running: abandoned
        text = f"Error: {item.call.name} timed out after {timeout_s:g} s"
        return ToolResult(item.call, text, "timeout", timeout_s)
    return ToolResult(item.call, outcome[0], outcome[1], ended - item.started)


def failure_counts(results: Sequence[Sequence[ToolResult]]) -> dict[str, int]:
    """{"tool_calls": n, and each of OUTCOMES' counts} over a batch's results."""
    flat = [r for row in results for r in row]
    out = {"tool_calls": len(flat), **{v: 0 for v in OUTCOMES.values()}}
    for r in flat:
        if r.failure is not None:
            out[OUTCOMES[r.failure]] += 1
    return out
