"""Tool-call formats: a reply rendered by a family-style template parses back to the calls it
was rendered from; malformed calls are counted, never raised; templates without tools refused.

The templates (tests/tool_templates.py) are written for these tests, each rendering tool calls
the way one family's template does; they are not copies of the real ones.
"""

from __future__ import annotations

import pytest
from chat_template_fixtures import FIXTURES, base_tokenizer, with_chat_tokens
from tool_templates import HERMES, STYLES

from posttrain.agents.tool_calls import (
    ParsedReply,
    ToolCall,
    format_of_template,
    parse_reply,
    require_format,
)
from posttrain.models.chatml import CHATML_TEMPLATE


def _assistant(calls: list[ToolCall], content: str = "") -> dict:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ],
    }


def _rendered_reply(fmt: str, reply: dict) -> str:
    """The text a policy generates for `reply` under the style's template: the full render less
    the render up to the generation prompt, up to the end-of-turn marker."""
    template, specials, bos, eos, stop = STYLES[fmt]
    tok = with_chat_tokens(base_tokenizer(), template, specials, bos, eos)
    before = [{"role": "user", "content": "What is 12 + 30?"}]
    after = [{"role": "tool", "content": "42", "tool_call_id": "call00001"}]
    if fmt == "mistral":
        prompt = tok.apply_chat_template(before, tokenize=False)  # no generation prompt
    else:
        prompt = tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template([*before, reply, *after], tokenize=False)
    assert full.startswith(prompt)
    return full[len(prompt) :].split(stop)[0]


@pytest.mark.parametrize("fmt", sorted(STYLES))
def test_a_rendered_call_parses_back_to_the_call(fmt: str) -> None:
    call = ToolCall("add", {"a": 12, "b": 30}, "call00001" if fmt == "mistral" else None)
    text = _rendered_reply(fmt, _assistant([call]))
    assert parse_reply(text, fmt) == ParsedReply("", [call], [])
    assert format_of_template(STYLES[fmt][0]) == fmt


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_several_calls_and_text_before_them(fmt: str) -> None:
    ids = ("call00001", "call00002") if fmt == "mistral" else (None, None)
    calls = [ToolCall("add", {"a": 1, "b": 2}, ids[0]), ToolCall("mul", {"a": 3, "b": 4}, ids[1])]
    content = "" if fmt == "mistral" else "Let me compute."
    parsed = parse_reply(_rendered_reply(fmt, _assistant(calls, content)), fmt)
    assert parsed.calls == calls and parsed.errors == [] and parsed.content == content


def test_plain_answers_make_no_call() -> None:
    for fmt in STYLES:
        assert parse_reply("12 + 30 = 42.", fmt) == ParsedReply("12 + 30 = 42.")
    # A Llama answer that merely starts with a brace is text, not a failed call.
    assert parse_reply("{1, 2} is a set.", "llama3_json") == ParsedReply("{1, 2} is a set.")


@pytest.mark.parametrize(
    ("fmt", "text", "reason"),
    [
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>', "not JSON"),
        ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "no function name"),
        ("hermes", '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>', "object"),
        ("hermes", '<tool_call>\n{"name": "add", "argu', "not JSON"),  # cut by the budget
        ("llama3_json", '{"name": "add", "parameters": {"a": 1', "not JSON"),
        ("llama3_json", "<|python_tag|>not a call at all", "not JSON"),
        ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}', "not JSON"),
        ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": "{bad"}]', "not JSON"),
    ],
)
def test_a_malformed_call_is_counted_not_raised(fmt: str, text: str, reason: str) -> None:
    parsed = parse_reply(text, fmt)
    assert parsed.calls == [] and len(parsed.errors) == 1 and parsed.attempted == 1
    assert reason in parsed.errors[0]


def test_one_good_and_one_bad_call_in_one_reply() -> None:
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        "<tool_call>\n{oops}\n</tool_call>"
    )
    parsed = parse_reply(text, "hermes")
    assert parsed.calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert parsed.attempted == 2 and parsed.errors[0].startswith("tool call 2:")


def test_string_arguments_and_llama_builtin_calls() -> None:
    qwen3 = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 5}"}\n</tool_call>'
    assert parse_reply(qwen3, "hermes").calls == [ToolCall("add", {"a": 5})]
    tagged = '<|python_tag|>{"name": "add", "parameters": {"a": 5}}'
    assert parse_reply(tagged, "llama3_json").calls == [ToolCall("add", {"a": 5})]
    builtin = '<|python_tag|>brave_search.call(query="the \\"best\\" pizza", n="3")'
    assert parse_reply(builtin, "llama3_json").calls == [
        ToolCall("brave_search", {"query": 'the "best" pizza', "n": "3"})
    ]


def test_templates_without_tools_are_refused_in_one_line() -> None:
    for template in [CHATML_TEMPLATE, *(f.template for f in FIXTURES)]:
        assert format_of_template(template) is None
    with pytest.raises(ValueError) as info:
        require_format(CHATML_TEMPLATE, "google/gemma-2-2b-it")
    assert "google/gemma-2-2b-it" in str(info.value) and "\n" not in str(info.value)
    assert require_format(HERMES, "Qwen/Qwen2.5-0.5B-Instruct") == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_reply("x", "pythonic")
