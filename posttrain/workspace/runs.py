"""The runs of a workspace, newest first, from their `run.json` records
(`posttrain.workspace.run_status`).

What `posttrain runs` lists and what `posttrain clean` keeps the artifacts of. Reads one small
JSON file per run (and probes its lock): fast however large the artifacts are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.workspace.run_status import parse_stamp, read_run

# How many of the evaluate headline's metrics a listing shows: the ones the promotion gate
# compares, in the recipe's order, else the first ones; enough to tell runs apart in one line.
HEADLINE_METRICS = 4


@dataclass
class RunInfo:
    """One run as `posttrain runs` shows it."""

    run_id: str
    name: str
    status: str  # running | completed | failed | interrupted | unknown (no run.json)
    started: float | None  # UTC seconds
    duration_s: float | None
    duration_at_least: bool  # a killed run: it ran on after its last record
    headline: dict[str, Any]
    gate_metrics: list[str]
    promoted: bool | None
    error: str | None
    folder: Path
    # (stage, fingerprint) of every artifact the run used or made, its failed one included
    artifacts: list[tuple[str, str]] = field(default_factory=list)


def _info(folder: Path) -> RunInfo:
    record = read_run(folder)
    if record is None:  # a folder this version did not write, or one being created
        return RunInfo(folder.name, "-", "unknown", None, None, False, {}, [], None, None, folder)
    arts = [
        (str(a.get("stage")), str(a.get("fingerprint")))
        for a in record.get("artifacts") or []
        if isinstance(a, dict) and a.get("stage") and a.get("fingerprint")
    ]
    headline = record.get("headline")
    return RunInfo(
        run_id=str(record.get("run_id") or folder.name),
        name=str(record.get("name") or "-"),
        status=str(record.get("status")),
        started=parse_stamp(str(record.get("started_at"))),
        duration_s=record.get("duration_s"),
        duration_at_least=bool(record.get("duration_at_least")),
        headline=headline if isinstance(headline, dict) else {},
        gate_metrics=[str(m) for m in record.get("gate_metrics") or []],
        promoted=record.get("promoted"),
        error=record.get("error"),
        folder=folder,
        artifacts=arts,
    )


def list_runs(workspace: str | os.PathLike[str], limit: int | None = None) -> list[RunInfo]:
    """The workspace's runs, newest first (by start; the run id, which begins with the start
    time, breaks ties), at most `limit`."""
    root = Path(workspace) / "runs"
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    runs = [_info(p) for p in folders]
    runs.sort(key=lambda r: (r.started or 0.0, r.run_id), reverse=True)
    return runs if limit is None else runs[:limit]


def compact_headline(
    headline: dict[str, Any], first: list[str] | None = None, limit: int = HEADLINE_METRICS
) -> str:
    """`exact_match_tuned=0.27 tuned_loss=1.93`: up to `limit` numeric metrics, those named in
    `first` (the gate's) when the headline has any, else its first ones; 3 significant digits."""
    numeric = {
        k: v for k, v in headline.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    keys = [k for k in dict.fromkeys(first or []) if k in numeric] or list(numeric)
    return " ".join(f"{k}={numeric[k]:.3g}" for k in keys[:limit]) or "-"
