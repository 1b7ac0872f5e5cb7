"""Read training rows from JSONL / JSON / Parquet / a saved `datasets` folder, checking each row.

Every bad row is reported as `<file>:<line>` (JSONL) or `<file> row <n>` with what is wrong, before
any training starts, instead of failing later deep inside a collator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset, load_from_disk

ROLES = ("system", "user", "assistant")


class DataError(ValueError):
    """Bad input data; the message names the file and line or row."""


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
    if not any(m["role"] == "assistant" and m["content"].strip() for m in msgs):
        raise DataError(f"{where}: no non-empty assistant message, nothing to learn from")


def check_sft_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one SFT row and return it in conversational form {"messages": [...]}.

    Accepted: {"messages": [{role, content}, ...]} or {"prompt": str, "completion": str}
    (the latter becomes a user turn and an assistant turn).
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        _check_messages(row["messages"], where)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]]}
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


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
            if not text.strip():
                continue
            try:
                out.append((where, json.loads(text)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    return out


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """(location, raw row) pairs from a JSONL/JSON/Parquet file or a saved dataset folder."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    if p.is_dir():
        ds = load_from_disk(str(p))
        if not isinstance(ds, Dataset):
            raise DataError(f"{p}: holds a DatasetDict; point at one split's folder")
        rows = [(f"{p} row {i}", r) for i, r in enumerate(ds)]
    elif p.suffix == ".jsonl":
        rows = _read_jsonl(p)
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DataError(f"{p}: not valid JSON: {exc}") from None
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json data file must hold a list of rows (or use .jsonl)")
        rows = [(f"{p} row {i}", r) for i, r in enumerate(data)]
    elif p.suffix == ".parquet":
        ds = load_dataset("parquet", data_files=str(p), split="train")
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
