"""Read training rows from JSONL / JSON / Parquet / a saved `datasets` folder, checking each row.

Every bad row is reported as `<file>:<line>` (JSONL) or `<file> row <n>` with what is wrong, before
any training starts, instead of failing later deep inside a collator.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset, load_from_disk

ROLES = ("system", "user", "assistant")

# A JSONL line longer than this is refused before it is held in memory whole: one 300 MB line
# would otherwise be read, decoded and parsed (several times its size) before any check ran.
# An input-validation limit, not an input: it is read from the environment of the stage
# process, not from the recipe, so raising it re-fingerprints nothing.
MAX_LINE_BYTES_ENV = "POSTTRAIN_MAX_LINE_BYTES"
DEFAULT_MAX_LINE_BYTES = 16 << 20
_CHUNK = 1 << 16
# Error messages quote what they found; a huge value must not make a huge message.
_MAX_MESSAGE = 2000
# `\ud800`-style escapes are the only way JSON text yields a lone surrogate, which tokenizers
# reject deep inside encoding ("TextEncodeInput must be ..."): look closer only when present.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class DataError(ValueError):
    """Bad input data; the message names the file and line or row."""

    def __init__(self, message: str) -> None:
        if len(message) > _MAX_MESSAGE:
            message = f"{message[:_MAX_MESSAGE]}... ({len(message)} characters in all)"
        super().__init__(message)


def line_limit() -> int:
    """The JSONL line limit: $POSTTRAIN_MAX_LINE_BYTES, or 16 MiB."""
    raw = os.environ.get(MAX_LINE_BYTES_ENV)
    if raw is None:
        return DEFAULT_MAX_LINE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise DataError(f"{MAX_LINE_BYTES_ENV}={raw!r}: expected a positive number of bytes")
    return value


def _check_messages(msgs: Any, where: str) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise DataError(f"{where}: messages[{i}] must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: messages[{i}].role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise DataError(
                f"{where}: messages[{i}].content must be a string, got {type(content).__name__}"
            )
        # Optional reasoning on assistant turns: the chat template keeps or drops it.
        reasoning = m.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            raise DataError(
                f"{where}: messages[{i}].reasoning_content must be a string on an assistant "
                f"message, got {type(reasoning).__name__} on {role!r}"
            )
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        raise DataError(f"{where}: no non-empty assistant message, nothing to learn from")


def keep_message(m: dict[str, Any]) -> dict[str, str]:
    """role, content and (when given) reasoning_content of a checked message."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("reasoning_content") is not None:
        out["reasoning_content"] = m["reasoning_content"]
    return out


def check_sft_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one SFT row and return it in conversational form {"messages": [...]}.

    Accepted: {"messages": [{role, content}, ...]} or {"prompt": str, "completion": str}
    (the latter becomes a user turn and an assistant turn).
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        _check_messages(row["messages"], where)
        return {"messages": [keep_message(m) for m in row["messages"]]}
    if "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise DataError(
                    f"{where}: '{key}' must be a string, got {type(row.get(key)).__name__}"
                )
        if not row["completion"].strip():
            raise DataError(f"{where}: 'completion' is empty, nothing to learn from")
        return {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["completion"]},
            ]
        }
    raise DataError(
        f"{where}: expected 'messages' or 'prompt'/'completion', got keys {sorted(row)}"
    )


def _lines(path: Path, limit: int) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a file, refusing a line over `limit` bytes without ever
    holding more than `limit` bytes of it: its length is measured by reading on in chunks."""
    with open(path, "rb") as f:
        for lineno in range(1, 1 << 62):
            raw = f.readline(limit + 1)
            if not raw:
                return
            if len(raw) > limit and not raw.endswith(b"\n"):
                size = len(raw)
                del raw  # measured, not kept: only one chunk of the rest is held at a time
                while chunk := f.readline(_CHUNK):
                    size += len(chunk)
                    if chunk.endswith(b"\n"):
                        break
                raise DataError(
                    f"{path}:{lineno}: line of {size} bytes is over the {limit}-byte limit "
                    f"(a missing newline, or a row far larger than training can use; "
                    f"{MAX_LINE_BYTES_ENV} raises it)"
                )
            yield lineno, raw


def _has_surrogate(value: Any) -> bool:
    # Iterative: the value may nest as deeply as the JSON parser allowed.
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


def parse_json_line(raw: bytes, where: str) -> Any:
    """One JSONL line's value, or None for a blank line. Raises DataError naming `where` for
    bytes that are not UTF-8, text that is not JSON (or nests too deeply, or holds an integer
    too long to convert) and lone surrogates (`"\\ud800"`), which no tokenizer can encode."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark some editors write first
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal of more than 4300 digits
        raise DataError(f"{where}: invalid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_surrogate(value):
        raise DataError(
            f"{where}: a string holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
            "which is not text any tokenizer can encode"
        )
    return value


def _read_jsonl(path: Path, limit: int) -> list[tuple[str, Any]]:
    out = []
    for lineno, raw in _lines(path, limit):
        where = f"{path}:{lineno}"
        value = parse_json_line(raw, where)
        if value is not None:
            out.append((where, value))
    return out


def read_rows(path: str | Path, max_line_bytes: int | None = None) -> list[tuple[str, Any]]:
    """(location, raw row) pairs from a JSONL/JSON/Parquet file or a saved dataset folder.

    `max_line_bytes` (default `max_line_bytes()`) bounds one JSONL line. Whatever the file
    holds, the only exception is DataError naming the file (and line or row)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    if p.is_dir():
        try:
            ds = load_from_disk(str(p))
        except Exception as exc:  # the library's many ways of saying "not a saved dataset"
            raise DataError(
                f"{p}: not a saved dataset folder ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(ds, Dataset):
            raise DataError(f"{p}: holds a DatasetDict; point at one split's folder")
        rows = [(f"{p} row {i}", r) for i, r in enumerate(ds)]
    elif p.suffix == ".jsonl":
        rows = _read_jsonl(p, max_line_bytes or line_limit())
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_bytes().decode("utf-8").removeprefix("\ufeff"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deeply
            raise DataError(f"{p}: not valid JSON: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json data file must hold a list of rows (or use .jsonl)")
        if any(_has_surrogate(r) for r in data):
            raise DataError(f"{p}: a string holds an unpaired UTF-16 surrogate escape")
        rows = [(f"{p} row {i}", r) for i, r in enumerate(data)]
    elif p.suffix == ".parquet":
        try:
            ds = load_dataset("parquet", data_files=str(p), split="train")
        except Exception as exc:  # pyarrow's errors for a truncated or non-Parquet file
            raise DataError(
                f"{p}: not a readable Parquet file ({type(exc).__name__}: {exc})"
            ) from None
        rows = [(f"{p} row {i}", r) for i, r in enumerate(ds)]
    else:
        raise DataError(f"{p}: unknown data format (use .jsonl, .json, .parquet or a saved folder)")
    if not rows:
        raise DataError(f"{p}: no rows")
    return rows


def load_sft_rows(path: str | Path) -> list[dict[str, Any]]:
    """Validated conversational rows; raises DataError at the first bad row."""
    return [check_sft_row(row, where) for where, row in read_rows(path)]


def to_dataset(rows: list[dict[str, Any]]) -> Dataset:
    return Dataset.from_list(rows)
