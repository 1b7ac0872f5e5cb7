"""What an earlier, unfinished attempt of a stage left behind, told in one line.

A stage folder without a manifest is not done. When it holds traces of a launch (logs/stage.log,
heartbeats, checkpoints), an earlier attempt started and did not finish: it failed, or it was
killed (SIGKILL, the OOM killer, a lost supervisor, a power cut) without a word. The next launch
says so before it starts, so a person reading the run sees what happened and what it costs:

    sft: an earlier attempt did not finish: killed without a word at step 14 (phase train,
    last heartbeat 2026-12-01 07:41:02 UTC, rank 0 pid 4242); newest complete checkpoint:
    step 12, so 2 steps are redone; a half-written checkpoint (step_0000015.tmp) is discarded

Reads files only (no torch, no Prefect): the stage's supervisor calls it before a launch and
hands the line to the stage in its spec (`launch.earlier_attempt`).
"""

from __future__ import annotations

import calendar
import re
import time
from pathlib import Path

from posttrain.store.status import status
from posttrain.store.summary import Recovery, Summary
from posttrain.telemetry.heartbeat import read_heartbeats

LAUNCH_LOG = Path("logs") / "stage.log"
ERROR_FILE = Path("logs") / "error.txt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def checkpoint_steps(out_dir: Path) -> tuple[list[int], list[str]]:
    """(steps of the checkpoints whose meta.json exists, oldest first; names of `.tmp` folders
    an interrupted save left). Completeness only: integrity is the stage's to check."""
    root = Path(out_dir) / "checkpoints"
    done, partial = [], []
    if root.is_dir():
        for p in root.iterdir():
            if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").is_file():
                done.append(int(m.group(1)))
            elif _TMP_DIR.match(p.name):
                partial.append(p.name)
    return sorted(done), sorted(partial)


def _last_error(out_dir: Path, after: float) -> str | None:
    """The last line of logs/error.txt when it was written after `after` (this attempt's)."""
    path = Path(out_dir) / ERROR_FILE
    try:
        if path.stat().st_mtime < after:
            return None
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


def _last_launch(out_dir: Path) -> float | None:
    """When the newest launch was logged (the launch log's `=== <UTC time> launch` lines)."""
    path = Path(out_dir) / LAUNCH_LOG
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - (256 << 10)))  # the tail is enough: launches are rare
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    stamps = re.findall(r"^=== (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) launch ", text, re.MULTILINE)
    if not stamps:
        return None
    return float(calendar.timegm(time.strptime(stamps[-1], "%Y-%m-%dT%H:%M:%SZ")))


def earlier_attempt(out_dir: Path) -> str | None:
    """One line on the unfinished attempt `out_dir` holds, or None (nothing started, or done)."""
    out_dir = Path(out_dir)
    if status(out_dir, out_dir.name, hashes=False).state != "unsealed":
        return None
    launched = _last_launch(out_dir)
    beats = read_heartbeats(out_dir)
    done, partial = checkpoint_steps(out_dir)
    if launched is None and not beats and not done:
        return None
    parts = []
    last = max(beats.values(), key=lambda r: r.get("time", 0.0), default=None)
    error = _last_error(out_dir, launched or 0.0)
    how = f"it failed ({error})" if error else "killed without a word"
    if last is not None:
        step = last.get("step")
        where = "before its first step" if step is None else f"at step {step}"
        parts.append(
            f"{how} {where} (phase {last.get('phase')}, last heartbeat "
            f"{_utc(float(last.get('time', 0.0)))}, rank {last.get('rank')} pid {last.get('pid')})"
        )
    elif launched is not None:
        parts.append(f"{how} before its first heartbeat (launched {_utc(launched)})")
    else:
        parts.append("it left checkpoints but no launch record")
    if done:
        newest = done[-1]
        lost = ""
        if last is not None and isinstance(last.get("step"), int) and last["step"] >= newest:
            lost = f", so {last['step'] - newest} step(s) are redone"
        parts.append(f"newest complete checkpoint: step {newest}{lost}")
    elif last is not None and last.get("step"):
        parts.append(f"no complete checkpoint, so its {last['step']} step(s) are redone")
    if partial:
        parts.append(f"a half-written checkpoint ({', '.join(partial)}) is discarded")
    return "an earlier attempt did not finish: " + "; ".join(parts)


def recovery_record(account: str | None, summary: Summary) -> Recovery | None:
    """summary.recovery of a stage: the earlier attempt's account, the step this launch
    resumed from and the checkpoints it rejected as damaged; None for a clean start."""
    record = {
        "earlier_attempt": account,
        "resumed_from_step": summary.resumed_from_step,
        "rejected_checkpoints": summary.rejected_checkpoints,
    }
    # Only what happened is set: the manifest keeps the fields set (Summary.sealed).
    happened = {k: v for k, v in record.items() if v}
    return Recovery(**happened) if happened else None
