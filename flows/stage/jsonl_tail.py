"""Reading the records appended to a JSON-lines file that another process is writing (a stage's
metrics.jsonl): the progress tail and the trackers' feed both follow it this way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlTail:
    """The complete records appended to `path` since the last `read`. A line still being
    written waits for the next read; a file that shrank (a restarted or resumed stage rewrote
    it) is read again from the start; a line that is not a JSON object is skipped."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = ""

    def read(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset, self._partial = 0, ""
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records
