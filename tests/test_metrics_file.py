"""metrics.jsonl survives a kill mid-write: a torn last line is dropped on read and on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.telemetry.metrics import MetricsWriter
from posttrain.telemetry.records import read_metrics


def _records(path: Path, steps: int) -> None:
    w = MetricsWriter(path)
    w.write("start", total_steps=10)
    for s in range(1, steps + 1):
        w.write("train", step=s, loss=1.0 / s)
    w.close()


def test_torn_last_line_is_dropped_and_resume_rewrites_the_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _records(path, 5)
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # SIGKILL in the middle of a write
    assert [r["step"] for r in read_metrics(path, "train")] == [1, 2, 3, 4, 5]
    w = MetricsWriter(path, resume_step=4)  # resumed from the step-4 checkpoint
    w.write("train", step=5, loss=0.5)
    w.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x).get("step") for x in lines] == [None, 1, 2, 3, 4, 5]


def test_corruption_before_the_last_line_is_an_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    _records(path, 3)
    text = path.read_text().splitlines()
    text[2] = "garbage"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a JSON record"):
        read_metrics(path)


def test_a_line_that_is_not_an_object_is_no_record(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n[1, 2]\n"text"\n{"kind": "eval", "step": 1}\n')
    assert [r["kind"] for r in read_metrics(path)] == ["train", "eval"]
    assert read_metrics(path, "eval") == [{"kind": "eval", "step": 1}]
    assert read_metrics(tmp_path) == []  # a folder, not a file
