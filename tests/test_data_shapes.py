"""Every common dataset shape reads as it is, and each shape's bad rows name file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.data.loading import DataError, load_sft_rows
from posttrain.data.preference import read_preference_rows
from posttrain.data.prompts import read_prompt_rows


def turn(role: str, text: str) -> dict:
    return {"role": role, "content": text}


SYS, USER, BOT = turn("system", "be brief"), turn("user", "2+2?"), turn("assistant", "4")

SFT_SHAPES = {
    "messages": ({"messages": [SYS, USER, BOT]}, [SYS, USER, BOT]),
    "prompt/completion strings": ({"prompt": "2+2?", "completion": "4"}, [USER, BOT]),
    "conversational prompt/completion": (
        {"prompt": [SYS, USER], "completion": [BOT]},
        [SYS, USER, BOT],
    ),
    "string prompt, message completion": ({"prompt": "2+2?", "completion": [BOT]}, [USER, BOT]),
    "ShareGPT human/gpt/system": (
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "2+2?"},
                {"from": "gpt", "value": "4"},
            ]
        },
        [SYS, USER, BOT],
    ),
    "ShareGPT user/assistant": (
        {"conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]},
        [USER, BOT],
    ),
    "ShareGPT with role/content": ({"conversations": [USER, BOT]}, [USER, BOT]),
    "Alpaca with input": (
        {"instruction": "Add.", "input": "2+2", "output": "4"},
        [turn("user", "Add.\n\n2+2"), BOT],
    ),
    "Alpaca empty input": (
        {"instruction": "2+2?", "input": "", "output": "4"},
        [USER, BOT],
    ),
    "Alpaca no input": ({"instruction": "2+2?", "output": "4"}, [USER, BOT]),
}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("shape", SFT_SHAPES)
def test_sft_shapes_read_as_they_are(tmp_path: Path, shape: str) -> None:
    row, messages = SFT_SHAPES[shape]
    assert load_sft_rows(_jsonl(tmp_path / "d.jsonl", [row])) == [{"messages": messages}]


def test_sft_shapes_from_parquet_with_absent_columns_as_none(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [
        {"instruction": "2+2?", "input": None, "output": "4"},
        {"instruction": "Add.", "input": "2+2", "output": "4"},
    ]
    Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    got = load_sft_rows(tmp_path / "d.parquet")
    assert [r["messages"][0]["content"] for r in got] == ["2+2?", "Add.\n\n2+2"]


SFT_ERRORS = {
    "conversations[1].from must be one of": {
        "conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]
    },
    "conversations[0].content must be a string, got int": {
        "conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]
    },
    "'conversations' must be a non-empty list": {"conversations": []},
    "Alpaca 'output' must be a string, got NoneType": {"instruction": "q"},
    "Alpaca 'input' must be a string, got list": {"instruction": "q", "input": [], "output": "a"},
    "prompt+completion[0].role must be one of": {
        "prompt": [turn("bot", "q")],
        "completion": [BOT],
    },
    "'completion' is empty": {"prompt": [USER], "completion": []},
    "'prompt'/'completion' row without 'completion'": {"prompt": [USER]},
    "no non-empty assistant message": {"prompt": [USER], "completion": [turn("user", "more")]},
    "'prompt' must be a string, got dict": {"prompt": {"q": 1}, "completion": "a"},
}


@pytest.mark.parametrize("problem", SFT_ERRORS)
def test_sft_shape_errors_name_file_and_line(tmp_path: Path, problem: str) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [SFT_SHAPES["messages"][0], SFT_ERRORS[problem]])
    with pytest.raises(DataError) as exc:
        load_sft_rows(path)
    assert str(exc.value).startswith(f"{path}:2: ") and problem in str(exc.value), exc.value


PREFERENCE_SHAPES = {
    "explicit prompt, strings": {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
    "explicit prompt, message lists": {
        "prompt": [SYS, USER],
        "chosen": [BOT],
        "rejected": [turn("assistant", "5")],
    },
    "implicit prompt (shared prefix)": {
        "chosen": [SYS, USER, BOT],
        "rejected": [SYS, USER, turn("assistant", "5")],
    },
}


@pytest.mark.parametrize("shape", PREFERENCE_SHAPES)
def test_preference_shapes_read_as_they_are(tmp_path: Path, shape: str) -> None:
    located, _ = read_preference_rows(_jsonl(tmp_path / "p.jsonl", [PREFERENCE_SHAPES[shape]]))
    rows = [row for _, row in located]
    prompt = [USER] if shape == "explicit prompt, strings" else [SYS, USER]
    assert rows == [{"prompt": prompt, "chosen": "4", "rejected": "5"}]


def test_implicit_prompt_error_names_file_and_line(tmp_path: Path) -> None:
    bad = {"chosen": [USER, BOT], "rejected": [turn("user", "other"), BOT]}
    path = _jsonl(tmp_path / "p.jsonl", [PREFERENCE_SHAPES["implicit prompt (shared prefix)"], bad])
    with pytest.raises(DataError) as exc:
        read_preference_rows(path)
    assert str(exc.value).startswith(f"{path}:2: chosen and rejected must differ only"), exc.value


@pytest.mark.parametrize(
    ("row", "prompt"),
    [
        ({"prompt": "2+2?"}, [USER]),
        ({"prompt": [SYS, USER]}, [SYS, USER]),
        ({"messages": [SYS, USER]}, [SYS, USER]),  # ends in a user turn: all of it
        ({"messages": [SYS, USER, BOT]}, [SYS, USER]),  # the reply is dropped
    ],
)
def test_prompt_only_shapes(tmp_path: Path, row: dict, prompt: list) -> None:
    located, _ = read_prompt_rows(_jsonl(tmp_path / "r.jsonl", [row]))
    ((where, got),) = located
    assert (where, got["messages"]) == (f"{tmp_path / 'r.jsonl'}:1", prompt)


def test_prompt_error_names_file_and_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "r.jsonl", [{"prompt": "ok"}, {"prompt": [SYS, BOT]}])
    with pytest.raises(DataError) as exc:
        read_prompt_rows(path)
    assert str(exc.value).startswith(f"{path}:2: "), exc.value
