"""One run per device set per machine: an exclusive `flock` on a host-wide lock file.

The kernel frees a `flock` when its holder dies, however it dies (SIGKILL, OOM killer, a crash,
a closed terminal), so a dead run can never keep the devices. The orchestration layer
(flows/devices.py) takes this lock BEFORE its Prefect concurrency slot: once a run holds it, no
live run on this machine holds the devices, and any slot still occupied is a dead run's.

The lock files live in one directory per machine, shared by every user and every Prefect home
(two runs on one machine use the same devices whatever server they report to):
`$POSTTRAIN_DEVICE_LOCK_DIR`, default `/tmp/posttrain-device-locks`, created world-writable
with the sticky bit (1777, as /tmp itself) and files 0666, so another user's run can take the
lock after yours, and nobody can delete a lock file someone else holds.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from posttrain.store.locking import FileLock

DIR_ENV = "POSTTRAIN_DEVICE_LOCK_DIR"
DEFAULT_DIR = "/tmp/posttrain-device-locks"


def lock_dir() -> Path:
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR)


class DeviceLock(FileLock):
    """The host-wide lock of one device set (`name`: e.g. posttrain-devices-<host>-cpu)."""

    def __init__(self, name: str) -> None:
        super().__init__(lock_dir() / f"{name}.lock")

    def _open(self) -> int:
        folder = self.path.parent
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(PermissionError):  # made by another user meanwhile
                folder.chmod(0o1777)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, self.MODE)
        # The umask strips the group/other bits at creation; another user must be able to open
        # the file for writing to take the lock after us.
        if os.fstat(fd).st_uid == os.getuid() and stat.S_IMODE(os.fstat(fd).st_mode) != self.MODE:
            with contextlib.suppress(PermissionError):
                os.fchmod(fd, self.MODE)
        return fd
