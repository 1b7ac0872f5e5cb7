"""The one-line account of an earlier, unfinished attempt of a stage
(posttrain.runtime.recovery)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from posttrain.runtime.recovery import checkpoint_steps, earlier_attempt


def _launch(out: Path, when: float) -> None:
    log = out / "logs" / "stage.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))
    with open(log, "a") as f:
        f.write(f"=== {stamp} launch abc: python -m posttrain.stages.sft --spec x\nsome output\n")


def _beat(out: Path, rank: int, step: int | None, phase: str, when: float) -> None:
    folder = out / "logs" / "heartbeat"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "pid": 4242 + rank, "seq": 9, "step": step, "phase": phase}
    (folder / f"rank{rank}.json").write_text(json.dumps({**record, "time": when}))


def _checkpoint(out: Path, step: int, complete: bool = True) -> None:
    name = f"step_{step:07d}" + ("" if complete else ".tmp")
    folder = out / "checkpoints" / name
    folder.mkdir(parents=True)
    if complete:
        (folder / "meta.json").write_text(json.dumps({"step": step}))


def test_nothing_started_or_done_says_nothing(tmp_path: Path) -> None:
    assert earlier_attempt(tmp_path / "missing") is None
    assert earlier_attempt(tmp_path) is None
    _launch(tmp_path, time.time())
    (tmp_path / "manifest.json").write_text("{}")
    assert earlier_attempt(tmp_path) is None  # complete: not an interrupted attempt


def test_killed_mid_training_names_step_checkpoint_and_lost_steps(tmp_path: Path) -> None:
    t = time.time() - 30
    _launch(tmp_path, t)
    _beat(tmp_path, 0, 14, "train", t + 20)
    _beat(tmp_path, 1, 13, "train", t + 19)
    for step in (6, 12):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 15, complete=False)
    text = earlier_attempt(tmp_path)
    assert text is not None
    assert text.startswith("an earlier attempt did not finish: killed without a word at step 14")
    assert "rank 0 pid 4242" in text
    assert time.strftime("%H:%M:%S", time.gmtime(t + 20)) in text
    assert "newest complete checkpoint: step 12, so 2 step(s) are redone" in text
    assert "step_0000015.tmp" in text
    assert checkpoint_steps(tmp_path) == ([6, 12], ["step_0000015.tmp"])


def test_a_failed_attempt_quotes_its_error_and_an_older_error_is_ignored(tmp_path: Path) -> None:
    err = tmp_path / "logs" / "error.txt"
    err.parent.mkdir(parents=True)
    err.write_text("Traceback (most recent call last):\n  ...\nValueError: bad row 7\n")
    old = time.time() - 3600
    os.utime(err, (old, old))
    _launch(tmp_path, time.time() - 60)  # launched after that error was written
    text = earlier_attempt(tmp_path)
    assert text is not None and "killed without a word before its first heartbeat" in text
    err.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    text = earlier_attempt(tmp_path)
    assert text is not None and "it failed (RuntimeError: boom) before its first heartbeat" in text


def test_no_checkpoint_means_every_step_is_redone(tmp_path: Path) -> None:
    _launch(tmp_path, time.time())
    _beat(tmp_path, 0, 5, "train", time.time())
    text = earlier_attempt(tmp_path)
    assert text is not None and "no complete checkpoint, so its 5 step(s) are redone" in text


def test_recovery_record_and_the_lines_the_cli_and_report_print() -> None:
    from flows.report.tables import StageRecord, markdown_report, recovery_lines
    from posttrain.runtime.recovery import recovery_record
    from posttrain.store.summary import Summary

    assert recovery_record(None, Summary(resumed_from_step=0)) is None
    rec = recovery_record(
        "an earlier attempt did not finish: killed without a word at step 14",
        Summary(resumed_from_step=12, rejected_checkpoints=["step_0000015: x.distcp truncated"]),
    )
    records = [
        StageRecord("ingest", "a" * 16, "reused", 0.1),
        StageRecord("sft", "b" * 16, "ran", 9.0, summary=Summary(recovery=rec)),
    ]
    (line,) = recovery_lines(records)
    assert line == (
        "sft: an earlier attempt did not finish: killed without a word at step 14; "
        "rejected damaged checkpoint step_0000015: x.distcp truncated; resumed from step 12"
    )
    report = markdown_report("r", "id", records)
    assert "## Recovered" in report and "resumed from step 12" in report
    assert "## Recovered" not in markdown_report("r", "id", records[:1])
