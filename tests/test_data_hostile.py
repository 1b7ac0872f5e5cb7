"""Hostile data files: every reader (SFT rows, preference pairs, prompts) stops with a DataError
naming the file and line, never with a crash later in tokenization or a collator, and never
holds an oversized line in memory whole."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posttrain.data.loading import (
    DEFAULT_MAX_LINE_BYTES,
    MAX_LINE_BYTES_ENV,
    DataError,
    load_sft_rows,
    read_rows,
)
from posttrain.data.preference import read_preference_rows
from posttrain.data.prompts import read_prompt_rows

GOOD = {
    "sft": {"prompt": "What is 1 + 1?", "completion": "2"},
    "preference": {"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"},
    "prompts": {"prompt": "What is 1 + 1?"},
}
READERS: dict[str, Callable[[Path], Any]] = {
    "sft": load_sft_rows,
    "preference": read_preference_rows,
    "prompts": read_prompt_rows,
}
MiB = 1 << 20


def _file(path: Path, reader: str, bad: bytes, before: int = 2) -> Path:
    """`before` good rows, then `bad` as line before+1, then one more good row."""
    good = json.dumps(GOOD[reader]).encode()
    path.write_bytes(b"\n".join([good] * before + [bad, good]) + b"\n")
    return path


BAD_LINES = {
    "not UTF-8": (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (invalid continuation byte at byte"),
    "invalid JSON": (b'{"prompt": "x",', "invalid JSON: Expecting property name"),
    "nested too deeply": (b"[" * 100_000 + b"]" * 100_000, "invalid JSON: nested too deeply"),
    "integer too long": (b'{"n": ' + b"9" * 5000 + b"}", "invalid JSON: Exceeds the limit"),
    "lone surrogate": (
        b'{"prompt": "a\\ud800b", "completion": "c", "chosen": "x", "rejected": "y"}',
        "unpaired UTF-16 surrogate escape",
    ),
    "not an object": (b'"just a string"', "row must be a JSON object, got str"),
    "wrong field type": (b'{"prompt": 7, "completion": 7, "chosen": 7, "rejected": 7}', "must be"),
}


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("bad", list(BAD_LINES))
def test_bad_line_names_file_and_line(tmp_path: Path, reader: str, bad: str) -> None:
    line, message = BAD_LINES[bad]
    path = _file(tmp_path / "rows.jsonl", reader, line)
    with pytest.raises(DataError) as exc:
        READERS[reader](path)
    assert str(exc.value).startswith(f"{path}:3: "), str(exc.value)[:300]
    assert message in str(exc.value)
    assert len(str(exc.value)) < 3000, "a huge row must not make a huge message"


def test_invalid_json_names_the_column_in_the_row(tmp_path: Path) -> None:
    """The column of a JSON error is counted in the row, as an editor shows it (the issue's
    row was reported at column 1 of the next line, its newline counted)."""
    row = '{"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "Lyon."'
    pad = " " * (106 - len(row))  # the row ends at column 106: the `}` it lacks is column 107
    unclosed = f"{row[:-1]}{pad}{row[-1]}".encode()
    path = _file(tmp_path / "pairs.jsonl", "preference", unclosed)
    with pytest.raises(DataError) as exc:
        read_preference_rows(path)
    assert str(exc.value) == (
        f"{path}:3: invalid JSON: Expecting ',' delimiter (column 107, the end of the line)"
    )
    # A missing comma inside the row: its own column, the row's end not mentioned.
    inner = b'{"prompt": "What is 1 + 1?" "chosen": "2", "rejected": "3"}'
    path = _file(tmp_path / "comma.jsonl", "preference", inner)
    with pytest.raises(DataError) as exc:
        read_preference_rows(path)
    assert str(exc.value) == f"{path}:3: invalid JSON: Expecting ',' delimiter (column 29)"
    whole = tmp_path / "rows.json"
    whole.write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "c" "x": 1}\n]\n')
    with pytest.raises(DataError) as exc:
        load_sft_rows(whole)
    assert str(exc.value) == f"{whole}:3: not valid JSON: Expecting ',' delimiter (column 18)"


@pytest.mark.parametrize("reader", list(READERS))
def test_empty_and_blank_files(tmp_path: Path, reader: str) -> None:
    for name, content in (("empty", b""), ("blank", b"\n  \n\t\n")):
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(content)
        with pytest.raises(DataError, match=rf"^{path}: no"):
            READERS[reader](path)


@pytest.mark.parametrize("reader", ["preference", "prompts"])  # SFT rows have no skip mode
def test_skip_mode_still_stops_on_unreadable_lines(tmp_path: Path, reader: str) -> None:
    path = _file(tmp_path / "rows.jsonl", reader, b"\xff\xfe")
    with pytest.raises(DataError, match=rf"^{path}:3: not valid UTF-8"):
        READERS[reader](path, "skip")


def test_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD["sft"]).encode() + b"\n")
    assert load_sft_rows(path)[0]["messages"][1]["content"] == "2"


def _stream_line(path: Path, reader: str, n_bytes: int, before: int = 1) -> None:
    """Good rows, then one JSON row of `n_bytes` bytes, written without building it in memory."""
    good = json.dumps(GOOD[reader]).encode()
    with open(path, "wb") as f:
        for _ in range(before):
            f.write(good + b"\n")
        head = b'{"prompt": "'
        f.write(head)
        block = b"a" * MiB
        left = n_bytes - len(head) - 2
        while left > 0:
            f.write(block[: min(left, MiB)])
            left -= MiB
        f.write(b'"}\n')
        f.write(good + b"\n")


@pytest.mark.parametrize("reader", list(READERS))
def test_oversized_line_is_refused_without_holding_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str
) -> None:
    monkeypatch.setenv(MAX_LINE_BYTES_ENV, str(1 * MiB))
    path = tmp_path / "big.jsonl"
    _stream_line(path, reader, 20 * MiB)
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as exc:
            READERS[reader](path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(exc.value).startswith(
        f"{path}:2: line of {20 * MiB + 1} bytes is over the {MiB}-byte limit"
    )
    assert MAX_LINE_BYTES_ENV in str(exc.value)
    # Reading one line whole would peak above 20 MiB (40 with its decoded copy).
    assert peak < 4 * MiB, f"peak {peak} bytes: the 20 MiB line was held in memory"


def test_a_line_at_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "edge.jsonl"
    _stream_line(path, "sft", 64 * 1024, before=0)
    assert len(read_rows(path, max_line_bytes=64 * 1024)) == 2
    with pytest.raises(DataError, match=r":1: line of 65537 bytes is over the 65535-byte limit"):
        read_rows(path, max_line_bytes=64 * 1024 - 1)


def test_a_300_mb_line_fails_fast_with_the_default_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    _stream_line(path, "sft", 300 * MiB)
    t0 = time.monotonic()
    with pytest.raises(DataError) as exc:
        load_sft_rows(path)
    elapsed = time.monotonic() - t0
    size = 300 * MiB + 1
    assert str(exc.value).startswith(
        f"{path}:2: line of {size} bytes is over the {DEFAULT_MAX_LINE_BYTES}-byte limit"
    )
    assert elapsed < 20, elapsed


def test_bad_limit_setting_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_LINE_BYTES_ENV, "lots")
    path = _file(tmp_path / "rows.jsonl", "sft", json.dumps(GOOD["sft"]).encode())
    with pytest.raises(DataError, match=f"{MAX_LINE_BYTES_ENV}='lots': expected a positive"):
        load_sft_rows(path)


def test_other_formats_fail_as_data_errors(tmp_path: Path) -> None:
    cases = {
        "rows.json": (b"\xff[]", "not valid JSON: UnicodeDecodeError"),
        "deep.json": (b"[" * 100_000, "not valid JSON: RecursionError"),
        "surrogate.json": (b'[{"prompt": "\\udc00", "completion": "x"}]', "surrogate"),
        "rows.parquet": (b"PAR1 this is not parquet", "not a readable Parquet file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(DataError, match=rf"^{path}: .*") as exc:
            load_sft_rows(path)
        assert message in str(exc.value), str(exc.value)[:300]
    folder = tmp_path / "not-a-dataset"
    folder.mkdir()
    (folder / "junk.txt").write_text("x")
    with pytest.raises(DataError, match=rf"^{folder}: not a saved dataset folder"):
        load_sft_rows(folder)
