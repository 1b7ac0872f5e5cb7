"""Tool calls in a model family's own words: which format a chat template renders them in, and
the calls a generated reply makes in it.

Three formats cover the families whose templates render `tool_calls`:

- `hermes` (Qwen2.5, Qwen3): any number of `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>` blocks after optional text (Qwen3's template also passes `arguments` through
  when it is already a JSON string).
- `llama3_json` (Llama 3.1/3.2/3.3): the whole reply is one JSON object `{"name": ...,
  "parameters": {...}}`, optionally after `<|python_tag|>`; built-in tools as
  `<|python_tag|>name.call(key="value", ...)`. One call per message (the template refuses more).
- `mistral` (Mistral v0.3): text, then `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id":
  "<9 alphanumerics>"}, ...]`.

A template that renders no tool calls (Gemma-2, Phi-3.5, DeepSeek-R1-Distill) has no format: a
recipe that gives such a policy tools is refused (`require_format`).

A malformed call (bad JSON, no name, arguments not an object) is kept as an error of the
parsed reply, not raised: to the episode loop it is a failed call the model is told about.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import StageVerdict

FORMATS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None  # Mistral's 9-character call id; None where the format has none


@dataclass(frozen=True)
class ParsedReply:
    content: str  # the reply's text outside the calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # calls that could not be read: why, each

    @property
    def attempted(self) -> int:  # calls the model tried to make, well-formed or not
        return len(self.calls) + len(self.errors)


def format_of_template(template: str | None) -> str | None:
    """The tool-call format a chat template renders assistant `tool_calls` in, or None when it
    renders none. Read from the markers the template writes, not from the model's name, so a
    fine-tuned checkpoint keeps its base family's format."""
    if not template or "tool_calls" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return "llama3_json"
    return None


class ToolsUnsupported(StageVerdict, ValueError):
    """A recipe gives tools to a model whose chat template renders none."""


def require_format(template: str | None, model: str) -> str:
    """`format_of_template`, or a one-line error for a model whose template has no tools."""
    fmt = format_of_template(template)
    if fmt is None:
        raise ToolsUnsupported(
            f"{model}: its chat template renders no tool calls (Gemma-2, Phi-3.5 and "
            "DeepSeek-R1-Distill have none), so it cannot be given rollout.tools or a tool "
            "environment; use a family whose template has tools (Qwen2.5/3, Llama 3.1, "
            "Mistral v0.3) or set a template that does"
        )
    return fmt


def parse_reply(text: str, fmt: str) -> ParsedReply:
    """The calls `text` makes in format `fmt`: `text` is the decoded reply without its
    end-of-turn token, other special tokens (`<|python_tag|>`, `[TOOL_CALLS]`) kept."""
    if fmt == "hermes":
        return _hermes(text)
    if fmt == "llama3_json":
        return _llama3(text)
    if fmt == "mistral":
        return _mistral(text)
    raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")


def _call(obj: Any, args_key: str, where: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or why it is not one."""
    if not isinstance(obj, dict):
        return f"{where}: a call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: the call has no function name"
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some templates and models pass arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"{where}: {name}'s arguments are not JSON ({exc.msg})"
    if not isinstance(args, dict):
        return f"{where}: {name}'s arguments must be an object, got {type(args).__name__}"
    call_id = obj.get("id")
    return ToolCall(name, args, call_id if isinstance(call_id, str) else None)


def _loads(text: str, where: str) -> Any | str:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        return _Malformed(f"{where}: not JSON ({exc.msg} at character {exc.pos})")


class _Malformed(str):
    """A reason, told apart from a decoded JSON string."""


def _add(out: ParsedReply, found: ToolCall | str) -> None:
    if isinstance(found, ToolCall):
        out.calls.append(found)
    else:
        out.errors.append(found)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> ParsedReply:
    out = ParsedReply(_HERMES.sub("", text).strip())
    for i, m in enumerate(_HERMES.finditer(text)):
        where = f"tool call {i + 1}"
        obj = _loads(m.group(1).strip(), where)
        _add(out, obj if isinstance(obj, _Malformed) else _call(obj, "arguments", where))
    return out


_BUILTIN = re.compile(r"^\s*([A-Za-z_][\w.]*)\.call\((.*)\)\s*$", re.DOTALL)
_KWARG = re.compile(r'\s*([A-Za-z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def _llama3(text: str) -> ParsedReply:
    tagged = "<|python_tag|>" in text
    body = text.split("<|python_tag|>", 1)[1] if tagged else text
    stripped = body.strip()
    if tagged and (m := _BUILTIN.match(stripped)):
        return _llama3_builtin(m.group(1), m.group(2))
    if not (tagged or stripped.startswith("{")):
        return ParsedReply(text.strip())  # a plain answer
    obj = _loads(stripped, "tool call")
    if isinstance(obj, _Malformed):
        if not tagged and '"name"' not in stripped:
            return ParsedReply(text.strip())  # text that happens to start with a brace
        return ParsedReply("", errors=[str(obj)])
    out = ParsedReply("")
    _add(out, _call(obj, "parameters", "tool call"))
    return out


def _llama3_builtin(name: str, arg_text: str) -> ParsedReply:
    """`name.call(key="value", ...)`: Llama 3.1's built-in tool form (string arguments only)."""
    args: dict[str, Any] = {}
    pos = 0
    while pos < len(arg_text.strip()):
        m = _KWARG.match(arg_text, pos)
        if m is None:
            return ParsedReply("", errors=[f'tool call: {name}\'s arguments are not key="value"'])
        args[m.group(1)] = json.loads(f'"{m.group(2)}"')
        pos = m.end()
    return ParsedReply("", calls=[ToolCall(name, args)])


def _mistral(text: str) -> ParsedReply:
    if "[TOOL_CALLS]" not in text:
        return ParsedReply(text.strip())
    content, rest = text.split("[TOOL_CALLS]", 1)
    out = ParsedReply(content.strip())
    obj = _loads(rest.strip(), "[TOOL_CALLS]")
    if isinstance(obj, _Malformed):
        out.errors.append(str(obj))
        return out
    for i, item in enumerate(obj if isinstance(obj, list) else [obj]):
        _add(out, _call(item, "arguments", f"tool call {i + 1}"))
    return out
