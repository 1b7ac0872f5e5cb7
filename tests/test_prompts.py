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


def _msgs(row: dict) -> list:
    return check_prompt_row(row, "x")["messages"]


def test_prompt_formats() -> None:
    assert _msgs({"prompt": "hi"}) == [{"role": "user", "content": "hi"}]
    assert _msgs({"prompt": [USER], "chosen": "a", "rejected": "b"}) == [USER]
    # messages: the prompt is everything before the last assistant turn
    assert _msgs({"messages": [USER, REPLY]}) == [USER]
    assert _msgs({"messages": [USER, REPLY, USER]}) == [USER, REPLY, USER]


def test_other_fields_are_columns_and_a_final_reply_is_the_answer() -> None:
    row = check_prompt_row({"prompt": "What is 2 + 3?", "answer": "5", "level": 1}, "x")
    assert row["columns"] == {"answer": "5", "level": 1}
    # SFT rows double as prompts with references: the reply they end with is the answer ...
    assert check_prompt_row({"messages": [USER, REPLY]}, "x")["columns"] == {"answer": "5"}
    # ... unless the row has its own.
    given = check_prompt_row({"messages": [USER, REPLY], "answer": "five"}, "x")
    assert given["columns"] == {"answer": "five"}
    assert check_prompt_row({"messages": [USER, REPLY, USER]}, "x")["columns"] == {}


def test_gsm8k_rows_through_a_column_map(tmp_path: Path) -> None:
    from posttrain.data.loading import DataSource

    path = tmp_path / "gsm8k.jsonl"
    row = {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"}
    path.write_text(json.dumps(row) + "\n")
    located, _ = read_prompt_rows(DataSource(str(path), columns={"question": "prompt"}))
    ((where, got),) = located
    assert where == f"{path}:1"
    assert got["messages"] == [{"role": "user", "content": row["question"]}]
    assert got["columns"] == {"answer": "3 + 4 = 7\n#### 7"}


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


def test_synthetic_prompt_tasks_keep_their_checkable_columns() -> None:
    from chat_template_fixtures import base_tokenizer, with_chat_tokens

    from posttrain.data.calculator import calculator_sft_rows
    from posttrain.data.prompts import prepare_prompts
    from posttrain.models.chatml import CHATML_TOOLS_TEMPLATE
    from posttrain.models.tiny import IM_END
    from posttrain.sections.shared import PromptDataConfig

    tok = with_chat_tokens(base_tokenizer(), CHATML_TOOLS_TEMPLATE, (), None, IM_END)
    cfg = PromptDataConfig(synthetic={"task": "calculator", "n_examples": 20, "seed": 7})
    data = prepare_prompts(cfg, tok, seed=0)
    rows = {r["messages"][1]["content"]: r for r in data.train + data.eval}
    assert len(rows) == 20 and len(data.eval) == 2  # eval_fraction 0.1
    for trace in calculator_sft_rows(20, 7):
        got = rows[trace["messages"][1]["content"]]
        # The system turn and the question; the answer kept; no tools (the stage's rollout.tools).
        assert got["messages"] == trace["messages"][:2]
        assert got["columns"] == {"answer": trace["answer"], "task": "calculator"}
    guess = prepare_prompts(PromptDataConfig(synthetic={"task": "guess", "n_examples": 40}), tok, 0)
    targets = [r["columns"]["target"] for r in guess.train + guess.eval]
    assert all(isinstance(t, int) and 10 <= t <= 25 for t in targets) and len(set(targets)) > 5
    assert guess.train[0]["messages"][-1]["role"] == "user"


def test_preference_data_takes_no_task() -> None:
    from pydantic import ValidationError

    from posttrain.sections.shared import PreferenceDataConfig

    # Pairs are generated for the quickstart only: a task there would be silently ignored.
    with pytest.raises(ValidationError, match="task"):
        PreferenceDataConfig(synthetic={"task": "calculator"})
