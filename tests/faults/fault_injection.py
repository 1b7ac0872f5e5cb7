"""Real faults for the tests in tests/faults: damage files the way disks and people do, and fill a
real (small tmpfs) filesystem.

`small_disk` mounts a tmpfs of a few MiB when this process may (root, `mount -t tmpfs` allowed)
and unmounts it after; a ballast file fills it to a chosen free size, so the code under test
meets a real ENOSPC from the kernel. Where mounting is not allowed the tests that need it skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut a file to `keep` of its size (a copy or a write that stopped half-way)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def flip_bytes(path: Path, n: int = 8) -> None:
    """Invert `n` bytes in the middle of a file (bit rot: the size stays the same)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    for i in range(mid, min(mid + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def largest_shard(ckpt: Path) -> Path:
    return max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)


class SmallDisk:
    """A mounted tmpfs; `fill(leave)` leaves about `leave` bytes free, `free_up()` undoes it."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount
        self.ballast = mount / f".ballast-{uuid.uuid4().hex[:8]}"

    def free(self) -> int:
        return shutil.disk_usage(self.mount).free

    def fill(self, leave: int = 0) -> None:
        """Write ballast until about `leave` bytes are free (0: completely full)."""
        chunk = b"\0" * (1 << 20)
        with open(self.ballast, "ab") as f:
            while (room := self.free() - leave) > 0:
                try:
                    f.write(chunk[: min(len(chunk), room)])
                    f.flush()
                except OSError:  # full
                    break

    def free_up(self) -> None:
        """Delete every ballast file, this process's and any a stage process wrote."""
        for ballast in self.mount.glob(".ballast-*"):
            ballast.unlink(missing_ok=True)


def can_mount_tmpfs(probe: Path) -> bool:
    """Root and a sandbox that allows `mount` (POSTTRAIN_TEST_NO_TMPFS=1 forces the fallback)."""
    if os.geteuid() != 0 or os.environ.get("POSTTRAIN_TEST_NO_TMPFS") == "1":
        return False
    probe.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)]).returncode
    if ok != 0:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


def skip_without_tmpfs(reason: str) -> None:
    """Skip a test that needs a real tmpfs where none can be mounted, or fail it where the run
    demands one (POSTTRAIN_REQUIRE_TMPFS=1, set by `scripts/dev.sh` as root), so CI never skips
    it silently."""
    if os.environ.get("POSTTRAIN_REQUIRE_TMPFS") == "1":
        pytest.fail(f"{reason} [POSTTRAIN_REQUIRE_TMPFS=1]", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def small_disk(mount: Path, size_mib: int) -> Iterator[SmallDisk]:
    """A real tmpfs of `size_mib` MiB at `mount` (created), unmounted afterwards."""
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "tmpfs", str(mount)],
        check=True,
    )
    try:
        yield SmallDisk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


class InjectedDisk(SmallDisk):
    """Fallback where no tmpfs can be mounted: a plain folder whose free space is what the test
    says (the one OS query, `shutil.disk_usage`, answers for it) and whose DCP stream writes
    fail with a real OSError(ENOSPC) once it is full. Only the lowest-level calls are replaced."""

    def __init__(self, mount: Path, monkeypatch) -> None:
        super().__init__(mount)
        self._mp = monkeypatch
        self.full_at: int | None = None
        real = shutil.disk_usage

        def disk_usage(path):
            usage = real(path)
            inside = str(Path(path).absolute()).startswith(str(mount.absolute()))
            if inside and self.full_at is not None:
                return usage._replace(free=self.full_at)
            return usage

        monkeypatch.setattr(shutil, "disk_usage", disk_usage)

    def free(self) -> int:
        return self.full_at if self.full_at is not None else shutil.disk_usage(self.mount).free

    def fill(self, leave: int = 0) -> None:
        self.full_at = leave

    def free_up(self) -> None:
        self.full_at = None


@contextlib.contextmanager
def disk_filled_when_dcp_writes(disk: SmallDisk, folder: str = "") -> Iterator[None]:
    """Fill `disk` the moment DCP opens a file for writing (in a folder whose path contains
    `folder`): the free-space check before the save passes, the save itself meets ENOSPC (as
    when another job fills the disk)."""
    import errno

    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    class _Full:
        def __init__(self, stream, path) -> None:
            self._s, self._path = stream, path

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))

        def __getattr__(self, name):
            return getattr(self._s, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if ("w" in mode or "a" in mode) and folder in str(path):
            disk.fill(0)
        with real(self, path, mode) as stream:
            injected = isinstance(disk, InjectedDisk) and disk.full_at == 0 and folder in str(path)
            yield _Full(stream, path) if injected else stream

    filesystem.FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = real


@contextlib.contextmanager
def disk_for_test(mount: Path, size_mib: int, monkeypatch) -> Iterator[SmallDisk]:
    """A real tmpfs when this process may mount one, else the injected fallback."""
    if can_mount_tmpfs(mount.with_name(mount.name + "-probe")):
        with small_disk(mount, size_mib) as disk:
            yield disk
    else:
        mount.mkdir(parents=True, exist_ok=True)
        yield InjectedDisk(mount, monkeypatch)
