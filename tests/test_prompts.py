"""Prompt rows for online RL: accepted formats, errors naming file and line, skip mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.data.loading import DataError
from posttrain.data.preference import PreferenceDataError
from posttrain.data.prompts import check_prompt_row, read_prompt_rows

USER = {"role": "user", "content": "What is 2 + 3?"}
REPLY = {"role": "assistant", "content": "5"}


def test_prompt_formats() -> None:
    assert check_prompt_row({"prompt": "hi"}, "x") == [{"role": "user", "content": "hi"}]
    assert check_prompt_row({"prompt": [USER], "chosen": "a", "rejected": "b"}, "x") == [USER]
    # messages: the prompt is everything before the last assistant turn
    assert check_prompt_row({"messages": [USER, REPLY]}, "x") == [USER]
    assert check_prompt_row({"messages": [USER, REPLY, USER]}, "x") == [USER, REPLY, USER]


@pytest.mark.parametrize(
    ("row", "reason", "text"),
    [
        ({"text": "hi"}, "missing_field", "expected 'prompt' or 'messages'"),
        ({"prompt": 3}, "wrong_type", "'prompt' must be a string or a list"),
        ({"prompt": [REPLY]}, "no_user_turn", "no non-empty user turn"),
        ({"prompt": [USER, REPLY]}, "prompt_end_not_user", "must end with a user turn"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "wrong_type", "role must be one of"),
    ],
)
def test_bad_prompt_rows(row: dict, reason: str, text: str) -> None:
    with pytest.raises(PreferenceDataError, match=text) as exc:
        check_prompt_row(row, "f.jsonl:7")
    assert exc.value.reason == reason and str(exc.value).startswith("f.jsonl:7: ")


def test_read_names_the_line_or_skips_and_counts(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "a"}, {"prompt": 3}, {"messages": [USER, REPLY]}, {"nope": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(PreferenceDataError, match=rf"{path}:2: 'prompt' must be"):
        read_prompt_rows(path)
    located, dropped = read_prompt_rows(path, "skip")
    assert [w for w, _ in located] == [f"{path}:1", f"{path}:3"]
    assert dropped == {"wrong_type": 1, "missing_field": 1}
    path.write_text(json.dumps({"nope": 1}) + "\n")
    with pytest.raises(DataError, match="no valid prompt row"):
        read_prompt_rows(path, "skip")
