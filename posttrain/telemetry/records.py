"""Reading a stage's metrics.jsonl: JSON only, no torch, so a flow process (which summarizes a
stage's health when it ends, failed or not) reads it without paying torch's import, seconds
that a run stopped by a signal would otherwise hold the devices for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (of one `kind`, if given). A torn last line — the process
    was killed while writing it — is dropped, so a resume after SIGKILL can read the file; an
    unreadable line before the last is corruption and raises, naming the line; a line that is
    JSON but not an object is no record and is skipped."""
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n}: not a JSON record ({exc.msg})") from None
    return [r for r in rows if isinstance(r, dict) and (kind is None or r.get("kind") == kind)]
