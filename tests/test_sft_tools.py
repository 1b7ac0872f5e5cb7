"""SFT on tool-use traces: every assistant turn is trained with the call text its template
renders and its end-of-turn, the tool results and their framing never; malformed tool rows name
their file and line; a template without tools is refused before training.

Templates: the tool styles of tests/tool_templates.py (written for these tests) and, for the
refusal, the tool-less family styles of tests/chat_template_fixtures.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from chat_template_fixtures import FIXTURES, base_tokenizer, fixture_tokenizer, with_chat_tokens
from tool_templates import HERMES, HERMES_GENERATION, HERMES_LAST_THINKS, STYLES

from flows.failure_block import stage_failure_block
from posttrain.data.chat import (
    IGNORE,
    _prefix_spans,
    _search_spans,
    encode_chat,
    prompt_text,
    template_info,
)
from posttrain.data.errors import RowsTooLong
from posttrain.data.loading import DataError, load_sft_rows
from posttrain.data.sft_data import prepare
from posttrain.sections.shared import DataConfig

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = {"type": "function", "id": "call00001", "function": {"name": "add", "arguments": None}}
RESULT = "result 82"  # text of the tool result: never trained


def trace(arguments: object = '{"a": 37, "b": 45}') -> list[dict]:
    call = {**CALL, "function": {"name": "add", "arguments": arguments}}
    return [
        {"role": "user", "content": "What is 37 + 45?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "tool_call_id": "call00001", "content": RESULT},
        {"role": "assistant", "content": "37 + 45 = 82."},
    ]


HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 37, "b": 45}}\n</tool_call>'
# (template, specials, bos, eos, the exact text the mask trains on TRACE)
CASES = {
    "hermes": (*STYLES["hermes"][:4], f"{HERMES_CALL}<|im_end|>\n37 + 45 = 82.<|im_end|>\n"),
    "llama3_json": (
        *STYLES["llama3_json"][:4],
        '{"name": "add", "parameters": {"a": 37, "b": 45}}<|eot_id|>37 + 45 = 82.<|eot_id|>',
    ),
    "mistral": (
        *STYLES["mistral"][:4],
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 37, "b": 45}, "id": "call00001"}]</s>'
        " 37 + 45 = 82.</s>",
    ),
    "hermes_last_thinks": (
        HERMES_LAST_THINKS,
        *STYLES["hermes"][1:4],
        f"{HERMES_CALL}<|im_end|>\n37 + 45 = 82.<|im_end|>\n",
    ),
    "hermes_generation": (
        HERMES_GENERATION,
        *STYLES["hermes"][1:4],
        f"{HERMES_CALL}<|im_end|>\n37 + 45 = 82.<|im_end|>\n",
    ),
}


def _tok(name: str):
    template, specials, bos, eos, _ = CASES[name]
    return with_chat_tokens(base_tokenizer(), template, specials, bos, eos)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tool_calls_are_trained_and_tool_results_are_not(name: str) -> None:
    tok = _tok(name)
    enc = encode_chat(tok, trace(), max_len=4096, tools=TOOLS)
    ids, labels = enc["input_ids"], enc["labels"]
    # Token by token: each label is its id (trained) or IGNORE, and the trained ones are the
    # call text, its end-of-turn, the answer and its end-of-turn, exactly.
    assert all(lab in (IGNORE, i) for i, lab in zip(ids, labels, strict=True))
    trained = [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE]
    assert tok.decode(trained) == CASES[name][4]
    # Every token of the tool result, and of the framing around it, is IGNORE.
    full = tok.decode(ids)
    offsets = tok(full, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    lo = full.index(RESULT)
    hi = len(full[: full.index("37 + 45 = 82.")].rstrip())  # Mistral's reply opens with " "
    between = [t for t, (s, e) in enumerate(offsets) if s < hi and e > lo]  # overlapping
    assert between and all(labels[t] == IGNORE for t in between)
    tool_tokens = [t for t, (s, e) in enumerate(offsets) if s < lo + len(RESULT) and e > lo]
    assert tok.decode([ids[t] for t in tool_tokens]).strip() == RESULT


@pytest.mark.parametrize("fmt", sorted(STYLES))
def test_search_agrees_with_prefix_on_tool_traces(fmt: str) -> None:
    tok = _tok(fmt)
    assert template_info(tok).strategy == "prefix"
    assert _search_spans(tok, trace(), TOOLS) == _prefix_spans(tok, trace(), TOOLS)


def test_string_and_object_arguments_train_the_same_text() -> None:
    tok = _tok("hermes")
    as_string = encode_chat(tok, trace('{"a": 37, "b": 45}'), 4096, tools=TOOLS)
    as_object = encode_chat(tok, trace({"a": 37, "b": 45}), 4096, tools=TOOLS)
    assert as_string == as_object


def test_the_tools_reach_the_template() -> None:
    listing = HERMES.replace(
        "{% for m in messages %}",
        "{% for t in tools or [] %}{{ t.function.name + '\n' }}{% endfor %}{% for m in messages %}",
        1,
    )
    tok = with_chat_tokens(base_tokenizer(), listing, *STYLES["hermes"][1:4])
    prompt, answer = prompt_text(tok, trace(), TOOLS)
    assert prompt.startswith("add\n<|im_start|>user") and answer == "37 + 45 = 82."
    assert HERMES_CALL in prompt and RESULT in prompt


BAD_ROWS = [
    (
        {"tool_calls": {"function": {"name": "add"}}},
        r"messages\[1\].tool_calls must be a non-empty list",
    ),
    ({"tool_calls": [{"function": {"arguments": {}}}]}, r"tool_calls\[0\].function has no name"),
    ({"tool_calls": [{"function": {"name": "add", "arguments": [1]}}]}, "must be an object"),
    (
        {"tool_calls": [{"function": {"name": "add", "arguments": "{1"}}]},
        "is a string but not JSON",
    ),
    ({"tool_calls": [{"function": {"name": "add", "arguments": "[1]"}}]}, "must be an object"),
    ({"tool_calls": ["add"]}, r"tool_calls\[0\] must be \{type: function"),
]


@pytest.mark.parametrize(("change", "reason"), BAD_ROWS)
def test_malformed_tool_calls_name_file_and_line(tmp_path: Path, change: dict, reason: str) -> None:
    bad = trace()
    bad[1] = {**bad[1], **change}
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": trace()}) + "\n" + json.dumps({"messages": bad}) + "\n")
    with pytest.raises(DataError, match=f"^{path}:2: .*{reason}"):
        load_sft_rows(path)


def test_a_tool_message_that_answers_nothing_names_file_and_line(tmp_path: Path) -> None:
    orphan = [trace()[0], trace()[2], trace()[3]]
    twice = [*trace()[:3], trace()[2], trace()[3]]
    wrong_id = [*trace()[:2], {**trace()[2], "tool_call_id": "nope"}, trace()[3]]
    for row, reason in [
        (orphan, r"messages\[1\] is a tool message that answers nothing"),
        (twice, r"messages\[3\] is a tool message that answers nothing"),
        (wrong_id, r"messages\[2\].tool_call_id 'nope' answers none of \['call00001'\]"),
    ]:
        path = tmp_path / "sft.jsonl"
        path.write_text(json.dumps({"messages": row}) + "\n")
        with pytest.raises(DataError, match=f"^{path}:1: {reason}"):
            load_sft_rows(path)


def test_good_tool_rows_keep_calls_results_and_tools(tmp_path: Path) -> None:
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": trace(), "tools": json.dumps(TOOLS)}) + "\n")
    (row,) = load_sft_rows(path)
    assert row["tools"] == TOOLS and row["messages"] == trace()
    none_content = trace()
    none_content[1] = {**none_content[1], "content": None}
    path.write_text(json.dumps({"messages": none_content, "tools": TOOLS}) + "\n")
    assert load_sft_rows(path)[0]["messages"][1]["content"] == ""


def _file(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("f", FIXTURES, ids=lambda f: f.name)
def test_tool_rows_under_a_template_without_tools_are_refused(tmp_path: Path, f) -> None:
    plain = {"messages": [trace()[0], trace()[3]]}
    path = _file(tmp_path, [plain, plain, {"messages": trace(), "tools": TOOLS}])
    with pytest.raises(DataError) as info:
        prepare(DataConfig(path=path, eval_fraction=0.0), fixture_tokenizer(f), seed=0)
    message = str(info.value)
    assert "\n" not in message and f"{path}:3 is a tool-use trace" in message
    assert "renders no tool calls" in message and "ingest.chat_template" in message


def test_tool_rows_under_a_tool_template_are_prepared(tmp_path: Path) -> None:
    path = _file(tmp_path, [{"messages": trace(), "tools": TOOLS}] * 4)
    data = prepare(DataConfig(path=path, eval_fraction=0.25), _tok("hermes"), seed=0)
    assert len(data.train) == 3 and len(data.eval) == 1 and data.train_rows[0]["tools"] == TOOLS
    assert data.train[0] == encode_chat(_tok("hermes"), trace(), 256, tools=TOOLS)


def test_rows_no_length_fits_say_the_max_seq_len_that_keeps_them(tmp_path: Path) -> None:
    """Tool schemas and a system prompt eat the budget: the refusal is the user's to fix, with
    numbers that hold. The max_seq_len it names for 90% and for all rows keeps exactly that many,
    one token less does not."""
    system = {"role": "system", "content": "You are a careful calculator. " * 4}
    rows = [
        {"messages": [system, {"role": "user", "content": "add " * i}, trace()[3]], "tools": TOOLS}
        for i in range(1, 11)
    ]
    path, tok = _file(tmp_path, rows), _tok("hermes")

    def kept(max_seq_len: int) -> int:
        cfg = DataConfig(path=path, eval_fraction=0.0, max_seq_len=max_seq_len)
        try:
            return len(prepare(cfg, tok, seed=0).train)
        except RowsTooLong:
            return 0

    with pytest.raises(RowsTooLong) as info:
        prepare(DataConfig(path=path, eval_fraction=0.0, max_seq_len=16), tok, seed=0)
    message = str(info.value)
    assert message.startswith("sft.data: none of the 10 training rows fits sft.data.max_seq_len")
    found = re.search(r"max_seq_len (\d+) would keep 90% of them, (\d+) all", message)
    assert found, message
    p90, every = int(found.group(1)), int(found.group(2))
    assert (kept(p90), kept(p90 - 1), kept(every), kept(every - 1)) == (9, 8, 10, 9)
    block = stage_failure_block(f"stage 'sft' failed\n--- end of the log ---\n{_line(message)}")
    assert "bug in posttrain" not in block.text() and "raise max_seq_len" in block.fix


def _line(message: str) -> str:
    return f"POSTTRAIN_ERROR stage sft failed: RowsTooLong: {message}"
