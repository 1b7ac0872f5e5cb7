"""Tool-use traces in SFT rows (OpenAI/TRL shape), checked before anything trains on them.

An assistant message may carry `tool_calls`: `[{"type": "function", "id"?: str, "function":
{"name": str, "arguments": {...} or a JSON-object string}}]` (its content may then be empty or
None). A `tool` message `{"role": "tool", "content": str, "name"?: str, "tool_call_id"?: str}`
answers one call of the assistant turn before it. A row may carry `tools`: the JSON schemas
(`{"type": "function", "function": {"name", ...}}`) its template is given through `tools=`.

Every error is a DataError naming the row's location (`<file>:<line>`, `<file> row <n>`) and the
message, like the rest of `posttrain.data.loading`.
"""

from __future__ import annotations

import json
from typing import Any

from posttrain.data.errors import DataError


def _error(where: str, text: str) -> DataError:
    return DataError(f"{where}: {text}")


def check_tool_calls(calls: Any, where: str, at: str) -> list[dict[str, Any]]:
    """`calls` (an assistant message's `tool_calls`, `at` its path in the row) checked: a
    non-empty list of function calls with a name and object arguments. Arguments given as a
    JSON string are kept as given (`posttrain.data.chat.for_template` decodes them for the
    templates that need an object)."""
    if not isinstance(calls, list) or not calls:
        raise _error(where, f"{at}.tool_calls must be a non-empty list, got {_kind(calls)}")
    for i, call in enumerate(calls):
        here = f"{at}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise _error(where, f"{here} must be {{type: function, function: {{name, arguments}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise _error(where, f"{here}.function has no name")
        _check_arguments(fn.get("arguments"), where, f"{here}.function.arguments")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise _error(where, f"{here}.id must be a string, got {_kind(call['id'])}")
    return calls


def _check_arguments(args: Any, where: str, at: str) -> None:
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise _error(where, f"{at} is a string but not JSON ({exc.msg})") from None
    if not isinstance(args, dict):
        raise _error(where, f"{at} must be an object or a JSON-object string, got {_kind(args)}")


def check_tool_answers(msgs: list[dict[str, Any]], where: str, field: str) -> None:
    """Every `tool` message answers a call of the nearest assistant turn before it (with
    tool_calls), one message per call, its `tool_call_id` (when given) one of that turn's ids."""
    open_ids: list[str | None] = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            open_ids = [c.get("id") for c in m.get("tool_calls") or []]
        elif m["role"] != "tool":
            open_ids = []
        elif not open_ids:
            raise _error(
                where,
                f"{field}[{i}] is a tool message that answers nothing: no assistant tool call "
                "before it is left unanswered",
            )
        else:
            answered = m.get("tool_call_id")
            ids = [x for x in open_ids if x is not None]
            if answered is not None and ids and answered not in ids:
                raise _error(where, f"{field}[{i}].tool_call_id {answered!r} answers none of {ids}")
            open_ids.remove(answered if answered in open_ids else open_ids[0])


def check_tools_column(tools: Any, where: str) -> list[dict[str, Any]]:
    """A row's `tools`: a list of function schemas (a JSON string of one is read too: some
    datasets store the column as text)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise _error(where, f"'tools' is a string but not JSON ({exc.msg})") from None
    if not isinstance(tools, list):
        raise _error(where, f"'tools' must be a list of function schemas, got {_kind(tools)}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _error(where, f"tools[{i}] must be {{type: function, function: {{name, ...}}}}")
    return tools


def clean_tool_fields(m: dict[str, Any]) -> dict[str, Any]:
    """The tool keys of a checked message that training keeps: an assistant's tool_calls, a
    tool message's name and tool_call_id."""
    keys = ("tool_calls",) if m["role"] == "assistant" else ("name", "tool_call_id")
    return {k: m[k] for k in keys if m.get(k) is not None}


def has_tools(row: dict[str, Any]) -> bool:
    """The row is a tool-use trace: a tools column, tool calls or tool messages."""
    msgs = row["messages"]
    return bool(row.get("tools")) or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs)


def _kind(value: Any) -> str:
    return type(value).__name__
