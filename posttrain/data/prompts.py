"""Prompts for online RL: read or generate, validate, split, and encode for generation.

Accepted rows:
  {"prompt": str}                         one user turn
  {"prompt": [messages]}                  must end with a user turn (preference files work as is)
  {"messages": [messages]}                the prompt is everything before the last assistant turn,
                                          or the whole list when it ends with a user turn
A row's other fields are its columns (`answer`, `task`, ...), handed to reward functions as
keyword arguments; a `messages` row that ends with an assistant turn and has no `answer` gets that
turn as its `answer` (SFT data doubles as prompts with references). `data.columns` renames source
fields first (GSM8K: `{question: prompt}`; its `answer` keeps the `#### 72` the math verifier
reads). A bad row raises `PreferenceDataError` naming `<file>:<line>` and the problem
(`on_invalid: skip` counts it by reason instead).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.data.calculator import calculator_sft_rows
from posttrain.data.chat import check_system_role, render
from posttrain.data.code_tasks import code_prompts
from posttrain.data.guess import guess_prompts
from posttrain.data.loading import DataSource
from posttrain.data.pref_prepare import Located, read_and_split
from posttrain.data.preference import (
    Messages,
    _fail,
    _messages,
    check_prompt_end,
    keep_prompt_tail,
    prompt_messages,
    read_checked_rows,
)
from posttrain.data.synthetic import SYSTEM_PROMPT, quickstart_triples
from posttrain.sections.shared import PromptDataConfig


def check_prompt_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one prompt row -> {"messages": prompt messages (ending with a user turn),
    "columns": its other fields}."""
    if not isinstance(row, dict):
        _fail(where, "wrong_type", f"row must be a JSON object, got {type(row).__name__}")
    columns = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    if row.get("prompt") is not None:
        msgs = prompt_messages(row["prompt"], where)
    elif row.get("messages") is not None:
        msgs = _messages(row["messages"], "messages", where)
        last_reply = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if last_reply and last_reply[-1] == len(msgs) - 1:
            if row.get("answer") is None:
                columns["answer"] = msgs[-1]["content"]
            msgs = msgs[: last_reply[-1]]
    else:
        _fail(where, "missing_field", f"expected 'prompt' or 'messages', got keys {sorted(row)}")
    check_prompt_end(msgs, where)
    return {"messages": msgs, "columns": columns}


def read_prompt_rows(
    path: str | Path | DataSource, on_invalid: str = "error"
) -> tuple[Located, dict[str, int]]:
    """(location, prompt messages) pairs and {reason: rows dropped}; see `check_prompt_row` and
    `read_checked_rows`."""
    return read_checked_rows(path, check_prompt_row, on_invalid, "prompt")


def quickstart_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """n quickstart prompts (the SFT/preference tasks) with their checkable answers (columns
    `answer`, `task`); every third has a system turn."""
    out = []
    for i, (task, prompt, right, _wrong) in enumerate(quickstart_triples(n, seed)):
        sys_turn = [{"role": "system", "content": SYSTEM_PROMPT}] if i % 3 == 0 else []
        msgs = sys_turn + [{"role": "user", "content": prompt}]
        out.append({"messages": msgs, "columns": {"answer": right, "task": task}})
    return out


def calculator_prompts(n: int, seed: int) -> list[dict[str, Any]]:
    """n calculator prompts: a trace's system turn and question, its `answer` (and `task`)
    kept. No `tools` column: the stage's `rollout.tools` are what an episode may call."""
    return [
        {"messages": r["messages"][:2], "columns": {"answer": r["answer"], "task": r["task"]}}
        for r in calculator_sft_rows(n, seed)
    ]


# `data.synthetic.task` -> its prompt generator: (n, seed) -> rows.
PROMPT_TASKS: dict[str, Callable[[int, int], list[dict[str, Any]]]] = {
    "quickstart": quickstart_prompts,
    "calculator": calculator_prompts,
    "guess": guess_prompts,
    "code": code_prompts,
}


def encode_prompt(tokenizer: Any, msgs: Messages, max_prompt_len: int) -> list[int]:
    """Generation input: the templated prompt with the assistant header, cut to its tail; the
    same ids a preference pair's prompt part has."""
    return keep_prompt_tail(tokenizer, prompt_ids(tokenizer, msgs), max_prompt_len)


def prompt_ids(tokenizer: Any, msgs: Messages) -> list[int]:
    """Every token of the templated prompt with the assistant header, before any cut."""
    text = render(tokenizer, msgs, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class PromptData:
    # {"messages": [...], "ids": [int], "columns": {name: value}, "where": "<file>:<line>"}
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    stats: dict[str, int] = field(default_factory=dict)


def prepare_prompts(cfg: PromptDataConfig, tokenizer: Any, seed: int) -> PromptData:
    task = cfg.synthetic.task if cfg.synthetic is not None else "quickstart"
    train, held, dropped = read_and_split(cfg, seed, read_prompt_rows, PROMPT_TASKS[task])
    check_system_role(tokenizer, [(w, r["messages"]) for w, r in train + held])

    def enc(located: Located) -> list[dict[str, Any]]:
        out = []
        for w, r in located:
            ids = encode_prompt(tokenizer, r["messages"], cfg.max_prompt_len)
            out.append({"messages": r["messages"], "ids": ids, "columns": r["columns"], "where": w})
        return out

    data = PromptData(enc(train), enc(held))
    data.stats = {f"dropped_{k}": v for k, v in dropped.items()} | {
        "train_prompts": len(data.train),
        "eval_prompts": len(data.eval),
        "prompts_at_max_len": sum(len(r["ids"]) >= cfg.max_prompt_len for r in data.train),
    }
    return data
