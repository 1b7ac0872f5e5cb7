"""One writer per artifact folder: an exclusive `flock` on `<out_dir>.lock`.

Two runs of the same recipe plan the same fingerprints, hence the same folders. Without a lock
both would train into one folder at once (interleaved checkpoints, metrics and weights, each
sealing the other's files in its manifest). With it, the second waits, then finds the first's
artifact complete and reuses it.

Who holds the lock, once per launch: the stage's supervisor (`flows.stage.supervise`), from
its one look at the folder to the completion check, telling the stage process it holds it in
`spec.json` (`launch.lock`); a stage process whose spec names no lock refuses to start.

The lock file sits beside the folder, not in it: everything in the folder is sealed by the
manifest. It is never deleted (removing a flock'ed file lets a third process lock a new inode
while the first still holds the old one). `flock` is released by the kernel when its holder
dies, so a killed run never leaves a stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

WAIT_LOG_EVERY_S = 60.0

log = logging.getLogger("posttrain.lock")


class LockTimeout(TimeoutError):
    """Another run held the artifact folder's lock longer than this run was willing to wait."""


def lock_path(out_dir: str | os.PathLike[str]) -> Path:
    out = Path(out_dir)
    return out.with_name(out.name + ".lock")


def describe_holder(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process"
    return (
        f"pid {holder.get('pid')} on {holder.get('host')} "
        f"({holder.get('what', 'a run')}, since {holder.get('since')})"
    )


def is_held(path: str | os.PathLike[str]) -> bool:
    """Whether a process holds the lock at `path` now. A shared, non-blocking `flock` on a
    read-only descriptor conflicts with the holder's exclusive one and writes nothing (taking
    the lock would overwrite the holder's record); closing the descriptor drops it at once."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _parse_record(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except ValueError:  # empty, or caught half-written
        return None
    return record if isinstance(record, dict) else None


def _write_record(fd: int, record: Mapping[str, Any]) -> None:
    # Rewritten in place (no rename: the lock is on this inode). Readers that catch it
    # half-written get None from `holder()` and poll again.
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


class FileLock:
    """Exclusive `flock` on one file, with an owner record (JSON) written into it. Not
    re-entrant: `flock` locks conflict between two opens of the file even within one process,
    which is what makes two threads of one process exclude each other too. The descriptor is
    not inherited by child processes (PEP 446), so only this process's death frees it."""

    # 0666 less the umask, like every other file: under umask 002 the group's runs can open
    # (O_RDWR) and lock it too; 0644 would lock them out of a shared workspace.
    MODE = 0o666

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self._record: dict[str, Any] = {}
        self.previous: dict[str, Any] | None = None
        self._updating = threading.Lock()

    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT, self.MODE)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self, owner: Mapping[str, Any]) -> bool:
        """Take the lock if it is free and record `owner` in it; never blocks."""
        assert self._fd is None, "already held"
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        # The record left by the previous holder, read under the lock: who had it last (a
        # holder that died left its record behind; `previous` names it).
        self.previous = _parse_record(os.pread(fd, 1 << 16, 0))
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **owner,
        }
        _write_record(fd, record)
        self._fd = fd
        self._record = record
        return True

    def update(self, **fields: Any) -> None:
        """Add `fields` to the owner record of the lock this object holds (from any thread: the
        flow launches stages side by side)."""
        assert self._fd is not None, "not held"
        with self._updating:
            self._record = {**self._record, **fields}
            _write_record(self._fd, self._record)

    def acquire(
        self,
        owner: Mapping[str, Any],
        on_wait: Callable[[dict[str, Any] | None], None] | None = None,
        timeout_s: float | None = None,
        poll_s: float = 0.25,
    ) -> bool:
        """Take the lock, waiting for the holder; `on_wait(holder)` is called when the wait
        starts and every WAIT_LOG_EVERY_S. Returns whether it had to wait. Raises LockTimeout
        after `timeout_s`. Polling (not a blocking flock) keeps the wait interruptible by the
        signals Prefect and Ctrl-C deliver."""
        start = time.monotonic()
        told = None
        while not self.try_acquire(owner):
            now = time.monotonic()
            if told is None or now - told >= WAIT_LOG_EVERY_S:
                if on_wait is not None:
                    on_wait(self.holder())
                told = now
            if timeout_s is not None and now - start > timeout_s:
                raise LockTimeout(
                    f"{self.path}: still held by {describe_holder(self.holder())} after "
                    f"{timeout_s:g} s"
                )
            time.sleep(poll_s)
        return told is not None

    def holder(self) -> dict[str, Any] | None:
        """The owner record of the last holder (the current one while it is held)."""
        try:
            return _parse_record(self.path.read_bytes())
        except OSError:
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class ArtifactLock(FileLock):
    """Exclusive lock of one artifact folder (`<out_dir>.lock`)."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        super().__init__(lock_path(out_dir))
