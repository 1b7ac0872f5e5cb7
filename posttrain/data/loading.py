"""Read training rows from JSONL / JSON / Parquet / a saved `datasets` folder, checking each row.

Every bad row is reported as `<file>:<line>` (JSONL) or `<file> row <n>` with what is wrong, before
any training starts, instead of failing later deep inside a collator.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from itertools import islice
from pathlib import Path
from typing import Any

from posttrain import hub
from posttrain.data.errors import DataError
from posttrain.data.tool_rows import (
    check_tool_answers,
    check_tool_calls,
    check_tools_column,
    clean_tool_fields,
)
from posttrain.errors import RecipeVerdict

ROLES = ("system", "user", "assistant")
# SFT conversations may be tool-use traces (posttrain.data.tool_rows); preference rows may not.
SFT_ROLES = (*ROLES, "tool")

# A JSONL line longer than this is refused before it is held in memory whole: one 300 MB line
# would otherwise be read, decoded and parsed (several times its size) before any check ran.
# An input-validation limit, not an input: it is read from the environment of the stage
# process, not from the recipe, so raising it re-fingerprints nothing.
MAX_LINE_BYTES_ENV = "POSTTRAIN_MAX_LINE_BYTES"
DEFAULT_MAX_LINE_BYTES = 16 << 20
_CHUNK = 1 << 16
# `\ud800`-style escapes are the only way JSON text yields a lone surrogate, which tokenizers
# reject deep inside encoding ("TextEncodeInput must be ..."): look closer only when present.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def clean_message(m: dict[str, Any]) -> dict[str, Any]:
    """The keys of a checked message that training keeps (source rows carry more): role,
    content and, when given, reasoning_content (the chat template keeps or drops it) and the
    tool fields (tool_calls; a tool message's name, tool_call_id). A tool-call turn's None
    content becomes "": templates concatenate content, and None would fail or print."""
    out = {"role": m["role"], "content": m["content"] or ""}
    if m.get("reasoning_content") is not None:
        out["reasoning_content"] = m["reasoning_content"]
    return out | clean_tool_fields(m)


def _check_message(m: Any, where: str, at: str) -> None:
    """One message of a conversation (`at`: its path in the row, `messages[3]`)."""
    if not isinstance(m, dict):
        raise DataError(f"{where}: {at} must be an object, got {type(m).__name__}")
    role, content = m.get("role"), m.get("content")
    if role not in SFT_ROLES:
        raise DataError(f"{where}: {at}.role must be one of {SFT_ROLES}, got {role!r}")
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise DataError(f"{where}: {at} has tool_calls but is a {role!r} message")
        check_tool_calls(calls, where, at)
    if not isinstance(content, str) and not (content is None and calls is not None):
        raise DataError(f"{where}: {at}.content must be a string, got {type(content).__name__}")
    # Optional reasoning on assistant turns: the chat template keeps or drops it.
    reasoning = m.get("reasoning_content")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise DataError(
            f"{where}: {at}.reasoning_content must be a string on an assistant "
            f"message, got {type(reasoning).__name__} on {role!r}"
        )


def _check_messages(msgs: Any, where: str, field: str = "messages") -> list[dict[str, Any]]:
    """A checked, cleaned copy of a conversation that has something to learn from (an
    assistant turn with text or tool calls)."""
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: '{field}' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(msgs):
        _check_message(m, where, f"{field}[{i}]")
    check_tool_answers(msgs, where, field)
    if not any(
        m["role"] == "assistant" and ((m["content"] or "").strip() or m.get("tool_calls"))
        for m in msgs
    ):
        raise DataError(f"{where}: no non-empty assistant message, nothing to learn from")
    return [clean_message(m) for m in msgs]


# ShareGPT speaker names -> our roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _turns(value: Any, field: str, where: str, role: str) -> list[dict[str, Any]]:
    """A prompt or completion: a string is one `role` turn, a list is messages as they are."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise DataError(
        f"{where}: '{field}' must be a string, got {type(value).__name__} (a list of messages "
        "is accepted too)"
    )


def _from_prompt_completion(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    for key in ("prompt", "completion"):
        if row.get(key) is None:
            raise DataError(f"{where}: 'prompt'/'completion' row without '{key}'")
    completion = _turns(row["completion"], "completion", where, "assistant")
    if not any(isinstance(m, dict) and str(m.get("content") or "").strip() for m in completion):
        raise DataError(f"{where}: 'completion' is empty, nothing to learn from")
    return _turns(row["prompt"], "prompt", where, "user") + completion


def _from_sharegpt(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise DataError(f"{where}: conversations[{i}] must be an object")
        if "from" not in t and "role" in t:  # some ShareGPT files use role/content
            out.append(t)
            continue
        speaker = t.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(
                f"{where}: conversations[{i}].from must be one of {tuple(SHAREGPT_ROLES)}, "
                f"got {speaker!r}"
            )
        out.append({"role": SHAREGPT_ROLES[speaker], "content": t.get("value")})
    return out


def _from_alpaca(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    instruction, extra, output = row.get("instruction"), row.get("input"), row.get("output")
    for key, value in (("instruction", instruction), ("output", output)):
        if not isinstance(value, str):
            raise DataError(f"{where}: Alpaca '{key}' must be a string, got {type(value).__name__}")
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{where}: Alpaca 'input' must be a string, got {type(extra).__name__}")
    # The usual Alpaca rendering: the input, when there is one, follows the instruction.
    user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


# (key that marks the shape, its name in errors, what message errors call the converted list,
# converter to a message list), in the order they are tried: a row is read by the first whose
# key it has (not None: Parquet fills absent columns with None).
SFT_SHAPES = (
    ("messages", "'messages'", "messages", lambda row, where: row["messages"]),
    ("conversations", "ShareGPT 'conversations'", "conversations", _from_sharegpt),
    ("instruction", "Alpaca 'instruction'/'input'/'output'", "alpaca", _from_alpaca),
    ("prompt", "'prompt'/'completion'", "prompt+completion", _from_prompt_completion),
    ("completion", "'prompt'/'completion'", "prompt+completion", _from_prompt_completion),
)


def check_sft_row(row: Any, where: str) -> dict[str, Any]:
    """Validate one SFT row and return it in conversational form {"messages": [...]}.

    Accepted shapes: {"messages": [{role, content}, ...]}; {"prompt", "completion"} as strings
    (a user turn and an assistant turn) or message lists (conversational: prompt + completion);
    ShareGPT {"conversations": [{from: human|gpt|system|user|assistant, value}]}; Alpaca
    {"instruction", "input" (optional, may be empty), "output"}. Conversations may be tool-use
    traces (assistant `tool_calls`, `tool` messages) and a row may carry `tools`, the schemas
    its template is given (`posttrain.data.tool_rows`).
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    for key, _name, field, convert in SFT_SHAPES:
        if row.get(key) is not None:
            out = {"messages": _check_messages(convert(row, where), where, field)}
            if row.get("tools") is not None:  # the schemas the template is given (tools=)
                out["tools"] = check_tools_column(row["tools"], where)
            return out
    shapes = "; ".join(dict.fromkeys(name for _, name, _, _ in SFT_SHAPES))
    raise DataError(f"{where}: expected one of {shapes}; got keys {sorted(row)}")


def _lines(path: Path, limit: int) -> Iterator[tuple[int, bytes | DataError]]:
    """(line number, raw line) of a file; a line over `limit` bytes comes as a DataError in its
    place, measured without ever holding more than `limit` bytes of it (the rest is read on in
    chunks), and the lines after it follow."""
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
                too_long = DataError(
                    f"{path}:{lineno}: line of {size} bytes is over the {limit}-byte limit "
                    f"(a missing newline, or a row far larger than training can use; "
                    f"{MAX_LINE_BYTES_ENV} raises it)"
                )
                yield lineno, too_long
                continue
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


def _json_problem(exc: json.JSONDecodeError, end: str = "line") -> str:
    """`Expecting ',' delimiter (column 107, the end of the line)`: the column as an editor
    counts it (1-based), and whether the text stopped before the value was complete."""
    at_end = exc.pos >= len(exc.doc.rstrip())
    return f"{exc.msg} (column {exc.colno}{f', the end of the {end}' if at_end else ''})"


def parse_json_line(raw: bytes, where: str) -> Any:
    """One JSONL line's value, or None for a blank line. Raises DataError naming `where` for
    bytes that are not UTF-8, text that is not JSON (or nests too deeply, or holds an integer
    too long to convert) and lone surrogates (`"\\ud800"`), which no tokenizer can encode."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    # The line's own newline goes: an error at the end of the row (a missing closing bracket)
    # would otherwise be placed at column 1 of the line after it.
    text = text.removeprefix("\ufeff").rstrip("\r\n")  # BOM: some editors write one first
    if not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON: {_json_problem(exc)}") from None
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


def jsonl_rows(path: Path, limit: int) -> Iterator[tuple[str, Any]]:
    """(`<file>:<line>`, value) of every non-blank line; a bad line (over `limit` bytes, not
    UTF-8, not JSON) comes with a DataError as its value, and the lines after it follow."""
    for lineno, raw in _lines(path, limit):
        where = f"{path}:{lineno}"
        if isinstance(raw, DataError):
            yield where, raw
            continue
        try:
            value = parse_json_line(raw, where)
        except DataError as exc:
            yield where, exc
            continue
        if value is not None:
            yield where, value


def _read_jsonl(path: Path, limit: int, head: int | None = None) -> list[tuple[str, Any]]:
    out = []
    for where, value in islice(jsonl_rows(path, limit), head):
        if isinstance(value, DataError):
            raise value
        out.append((where, value))
    return out


@dataclass
class DataSource:
    """Where rows come from: a local file/folder, or a hub dataset id with split, revision and
    subset (config name); `columns` renames source columns to ours (both kinds)."""

    path: str
    split: str = "train"
    revision: str = "main"
    subset: str | None = None
    columns: dict[str, str] = dataclass_field(default_factory=dict)


def data_source(cfg: Any, attr: str = "path") -> DataSource | None:
    """The DataSource of a data section's `path` or `eval_path` (None when unset)."""
    value = getattr(cfg, attr)
    if value is None:
        return None
    split = cfg.split if attr == "path" else cfg.eval_split
    return DataSource(str(value), split, cfg.revision, cfg.subset, dict(cfg.columns))


def seeded_split(rows: list[Any], seed: int, eval_fraction: float) -> tuple[list, list]:
    """(train, held-out) by a seeded shuffle: the same in every process and every run with the
    same seed. A RecipeVerdict on the section's `data.eval_fraction` when nothing is left to
    train on."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * eval_fraction)) if eval_fraction > 0 else 0
    if len(rows) - n_eval < 1:
        raise RecipeVerdict(
            "data.eval_fraction",
            f"{eval_fraction} holds out {n_eval} of the {len(rows)} rows, which leaves nothing "
            "to train on; give more rows, or hold out fewer (or give data.eval_path)",
        )
    held = set(order[:n_eval])
    train = [r for i, r in enumerate(rows) if i not in held]
    return train, [r for i, r in enumerate(rows) if i in held]


def rename_columns(row: Any, columns: dict[str, str], where: str) -> Any:
    """`row` with source columns renamed to ours (`{question: prompt}`); a renamed column
    replaces a column of the target name. A mapped column missing from the row is an error."""
    if not columns or not isinstance(row, dict):
        return row
    missing = [k for k in columns if k not in row]
    if missing:
        raise DataError(
            f"{where}: columns {missing} (to rename per `columns: {columns}`) not in the row; "
            f"it has {sorted(row)}"
        )
    out = {k: v for k, v in row.items() if k not in columns and k not in columns.values()}
    out.update({new: row[old] for old, new in columns.items()})
    return out


def _datasets() -> Any:
    """The `datasets` library, imported on first use: its import (pandas, pyarrow) is ~1.3 s of
    CPU in every stage process, and JSONL and JSON files, the common case, never need it."""
    import datasets

    return datasets


def _read_hub(src: DataSource) -> list[tuple[str, Any]]:
    """Rows of one split of a hub dataset, from its snapshot in the huggingface_hub cache
    (downloaded first only when online; `posttrain.hub`), read by `datasets.load_dataset`."""
    try:
        snap = hub.snapshot(src.path, src.revision, "dataset")
    except hub.HubError as exc:
        raise DataError(str(exc)) from None
    return _hub_rows(src, snap.folder, snap.commit_sha)


def _hub_rows(src: DataSource, folder: Path, commit: str) -> list[tuple[str, Any]]:
    """Rows of `src`'s split from its snapshot `folder` (at `commit`)."""
    label = f"{src.path}[{src.split}]"
    try:
        ds = _datasets().load_dataset(str(folder), name=src.subset, split=src.split)
    except Exception as exc:  # unknown split or subset, unreadable files
        raise DataError(
            f"{label} (subset {src.subset!r}, commit {commit}, {folder}): "
            f"cannot load it ({type(exc).__name__}: {exc})"
        ) from None
    rows = [(f"{label} row {i}", r) for i, r in enumerate(ds)]
    if not rows:
        raise DataError(f"{label}: no rows")
    return rows


def read_rows(
    path: str | Path | DataSource, max_line_bytes: int | None = None, head: int | None = None
) -> list[tuple[str, Any]]:
    """(location, raw row) pairs from a JSONL/JSON/Parquet file, a saved dataset folder or a
    hub dataset id (a DataSource: its split, revision and subset; `org/name[split] row N`), with
    the source's column renames applied.

    `max_line_bytes` (default `max_line_bytes()`) bounds one JSONL line. `head`: the first rows
    only (`posttrain validate` reads 5; a JSONL file is read no further). Whatever the file
    holds, the only exception is DataError naming the file (and line or row)."""
    src = path if isinstance(path, DataSource) else DataSource(str(path))
    if hub.is_hub_id(src.path):
        rows = _read_hub(src)[:head]
    else:
        rows = _read_local(src.path, max_line_bytes, head)
    return [(where, rename_columns(row, src.columns, where)) for where, row in rows]


def scan_rows(src: DataSource) -> Iterator[tuple[str, Any]]:
    """(location, raw row) of every row `read_rows` reads from `src`, read on past bad rows: a
    bad row (a JSONL line that is not JSON, a row missing a column `src.columns` renames) comes
    with a DataError as its value. A source that cannot be read at all (missing, not Parquet, a
    hub dataset the local cache does not hold: `scan_rows` never downloads) raises DataError;
    `posttrain validate --full` reads with it."""
    if hub.is_hub_id(src.path):
        folder = hub.cached_snapshot(src.path, src.revision, "dataset")
        if folder is None:
            raise DataNotCached(f"{src.path}@{src.revision}: not in the local hub cache")
        rows: Iterator[tuple[str, Any]] = iter(_hub_rows(src, folder, folder.name))
    elif Path(src.path).suffix == ".jsonl" and Path(src.path).is_file():
        rows = jsonl_rows(Path(src.path), line_limit())
    else:
        rows = iter(_read_local(src.path, None, None))
    for where, row in rows:
        if not isinstance(row, DataError):
            try:
                row = rename_columns(row, src.columns, where)
            except DataError as exc:
                row = exc
        yield where, row


class DataNotCached(DataError):
    """A hub dataset the local cache does not hold: read when its stage runs."""


class DataFileMissing(DataError):
    """A data path that names nothing: the recipe's field is what to correct, not a row."""


def _read_local(path: str, max_line_bytes: int | None, head: int | None) -> list[tuple[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise DataFileMissing(f"{p} does not exist")
    if p.is_dir():
        try:
            ds = _datasets().load_from_disk(str(p))
        except Exception as exc:  # the library's many ways of saying "not a saved dataset"
            raise DataError(
                f"{p}: not a saved dataset folder ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(ds, _datasets().Dataset):
            raise DataError(f"{p}: holds a DatasetDict; point at one split's folder")
        rows = [(f"{p} row {i}", r) for i, r in enumerate(islice(ds, head))]
    elif p.suffix == ".jsonl":
        rows = _read_jsonl(p, max_line_bytes or line_limit(), head)
    elif p.suffix == ".json":
        try:
            data = json.loads(p.read_bytes().decode("utf-8").removeprefix("\ufeff"))
        except json.JSONDecodeError as exc:
            problem = _json_problem(exc, "file")
            raise DataError(f"{p}:{exc.lineno}: not valid JSON: {problem}") from None
        except (ValueError, RecursionError) as exc:  # not UTF-8, nested too deeply
            raise DataError(f"{p}: not valid JSON: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json data file must hold a list of rows (or use .jsonl)")
        if any(_has_surrogate(r) for r in data):
            raise DataError(f"{p}: a string holds an unpaired UTF-16 surrogate escape")
        rows = [(f"{p} row {i}", r) for i, r in enumerate(data[:head])]
    elif p.suffix == ".parquet":
        try:
            ds = _datasets().load_dataset("parquet", data_files=str(p), split="train")
        except Exception as exc:  # pyarrow's errors for a truncated or non-Parquet file
            raise DataError(
                f"{p}: not a readable Parquet file ({type(exc).__name__}: {exc})"
            ) from None
        rows = [(f"{p} row {i}", r) for i, r in enumerate(islice(ds, head))]
    else:
        raise DataError(f"{p}: unknown data format (use .jsonl, .json, .parquet or a saved folder)")
    if not rows:
        raise DataError(f"{p}: no rows")
    return rows


def load_sft_rows(path: str | Path | DataSource) -> list[dict[str, Any]]:
    """Validated conversational rows; raises DataError at the first bad row."""
    return [check_sft_row(row, where) for where, row in read_rows(path)]
