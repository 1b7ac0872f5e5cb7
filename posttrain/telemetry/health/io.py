"""Bytes this rank's process read from storage, per second.

`read_bytes` of the process's I/O counters (Linux: /proc/<pid>/io) counts what reached the block
layer, not page-cache hits: a data loader starving the step shows up here as a rate far below
what the step consumes, or a flat line while the step waits. Counts this process only: loader
worker processes, if any, read on their own accounts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psutil


def _process_read_bytes() -> int:
    return int(psutil.Process().io_counters().read_bytes)


class IoSource:
    """`status`: "present" or "absent: <why>" (a platform without per-process I/O counters)."""

    def __init__(
        self,
        read_bytes: Callable[[], int] = _process_read_bytes,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.read_bytes, self.clock = read_bytes, clock
        self._prev: tuple[float, int] | None = None
        try:
            read_bytes()
            self.status = "present"
        except (AttributeError, NotImplementedError, psutil.Error, OSError) as exc:
            # psutil has no io_counters on macOS (AttributeError); /proc/<pid>/io may be denied
            self.status = f"absent: no per-process I/O counters ({type(exc).__name__}: {exc})"

    def close(self) -> None:
        pass

    def sample(self) -> dict[str, Any] | None:
        """{read_bytes_per_s (from the second sample on), read_bytes_total}, None when absent."""
        if self.status != "present":
            return None
        now, total = self.clock(), self.read_bytes()
        out: dict[str, Any] = {"read_bytes_total": total}
        prev, self._prev = self._prev, (now, total)
        if prev is not None and now > prev[0] and total >= prev[1]:
            out["read_bytes_per_s"] = (total - prev[1]) / (now - prev[0])
        return out
