"""A run's own account of itself: `<workspace>/runs/<run-id>/run.json`, kept from start to end.

The run folder's other files (report, lineage) are written when the run ends, so a run killed
outright (SIGKILL, the OOM killer, a lost machine) used to leave nothing at all. `run.json` is
written when the run starts (status `running`), rewritten as each stage ends (the artifacts it
used or made so far) and once more at the end (`completed`, `failed` or `interrupted`, with the
evaluate headline and the promotion outcome).

Whether a `running` run still runs is told by `run.lock` beside it: the run's process holds an
exclusive `flock` on it for its whole life, and the kernel drops that lock when the process
dies, however it dies. A `running` record whose lock nobody holds is a run that was
`interrupted` without a word; no PID or clock comparison is needed.
"""

from __future__ import annotations

import calendar
import contextlib
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from posttrain import jsonsafe
from posttrain.store.artifacts import atomic_write_text
from posttrain.store.locking import FileLock, is_held

RUN_FILE = "run.json"
RUN_LOCK = "run.lock"
STATUSES = ("running", "completed", "failed", "interrupted")


def utc_stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def parse_stamp(stamp: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None


class RunJournal:
    """Writes one run's `run.json` and holds its `run.lock` while the run lives. Used as a
    context manager around the run: leaving it writes the final record, `failed` on an
    exception, `interrupted` on KeyboardInterrupt, SIGTERM and the like (a BaseException that
    is not an Exception), else `completed`."""

    def __init__(self, workspace: str | os.PathLike[str], run_id: str, name: str) -> None:
        self.folder = Path(workspace) / "runs" / run_id
        self.lock = FileLock(self.folder / RUN_LOCK)
        self.started = time.time()
        self.record: dict[str, Any] = {
            "run_id": run_id,
            "name": name,
            "status": "running",
            "started_at": utc_stamp(self.started),
            "ended_at": None,
            "duration_s": None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "headline": {},
            "promoted": None,
            "gate_metrics": [],
            "error": None,
            "artifacts": [],
        }

    def _write(self) -> None:
        atomic_write_text(self.folder / RUN_FILE, jsonsafe.dumps(self.record, indent=2))

    def __enter__(self) -> RunJournal:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lock.try_acquire({"what": f"run {self.record['run_id']}"})
        self._write()
        return self

    def stages(self, artifacts: list[dict[str, Any]]) -> None:
        """Record the artifacts the run used or made so far ({stage, fingerprint, status})."""
        self.record["artifacts"] = artifacts
        self._write()

    def outcome(
        self, headline: dict[str, Any], promoted: bool | None, gate_metrics: list[str]
    ) -> None:
        """What the final record says besides the status: the evaluate headline, the gate's
        verdict (None: no gate) and the metrics it compares (the ones a listing shows)."""
        self.record.update(headline=headline, promoted=promoted, gate_metrics=gate_metrics)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        ended = time.time()
        status = "completed"
        if exc is not None:
            status = "failed" if isinstance(exc, Exception) else "interrupted"
            what = (str(exc) or type(exc).__name__).splitlines()[0][:300]
            # Ctrl-C, SIGTERM, a hang-up: Prefect's signal exceptions carry no message.
            self.record["error"] = what if status == "failed" else f"stopped ({what})"
        self.record.update(
            status=status,
            ended_at=utc_stamp(ended),
            duration_s=round(ended - self.started, 1),
        )
        try:
            self._write()
        finally:
            self.lock.release()


def read_run(folder: Path) -> dict[str, Any] | None:
    """The run's record with its status as of now (a `running` one nobody holds the lock of is
    `interrupted`, its duration up to its last write, `duration_at_least`); None when the folder has no readable
    `run.json`."""
    try:
        record = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if record.get("status") == "running":
        started = parse_stamp(str(record.get("started_at")))
        if is_held(folder / RUN_LOCK):
            record["duration_s"] = None if started is None else round(time.time() - started, 1)
        else:
            record["status"] = "interrupted"
            with contextlib.suppress(OSError):
                last = (folder / RUN_FILE).stat().st_mtime
                record["duration_s"] = None if started is None else round(last - started, 1)
                record["duration_at_least"] = True  # it ran on after its last write
            record["error"] = "the run's process ended without a final record (killed?)"
    return record
