"""Free disk space before big writes, and one verdict for a full disk.

A full disk used to surface as a bare `OSError: [Errno 28] No space left on device` from deep in
torch.distributed.checkpoint or safetensors, with no path, and left the half-written folder
behind, still holding the space. Writers of checkpoints and exports check the free space first
(`ensure_free`) and, when the disk fills anyway (another process wrote meanwhile, the estimate
was short), remove what they half-wrote and raise `DiskFull`, which `stage_main` reports as a
verdict: path, bytes needed and free, and what to do.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import StageVerdict

# Headroom over an estimate: file headers, DCP metadata, JSON, filesystem blocks.
MARGIN = 0.10
SLACK_BYTES = 16 << 20
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
ADVICE = (
    "Free space on that disk, keep fewer checkpoints (the stage's keep_checkpoints), or point "
    "run.workspace at a larger disk; then re-run: a training stage resumes from its last "
    "complete checkpoint, and completed stages are reused."
)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


class DiskFull(StageVerdict):
    """Not enough free space for a write, found before it or by ENOSPC during it."""

    def __init__(
        self, what: str, path: Path, needed: int | None, free: int, note: str = ""
    ) -> None:
        self.path, self.needed, self.free = Path(path), needed, free
        need = f"needs about {human(needed)} ({needed} bytes), " if needed else "the disk filled, "
        super().__init__(
            f"not enough disk space for {what} in {path}: {need}{human(free)} ({free} bytes) "
            f"free{note}. {ADVICE}"
        )


def existing_ancestor(path: Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Free bytes for an unprivileged writer on the filesystem that holds (or will hold) `path`."""
    return shutil.disk_usage(existing_ancestor(path)).free


def required_bytes(expected: int) -> int:
    """What must be free before writing about `expected` bytes."""
    return int(expected * (1 + MARGIN)) + SLACK_BYTES


def ensure_free(path: Path, expected: int, what: str, note: str = "") -> None:
    """Raise DiskFull unless the filesystem of `path` has room for `expected` bytes plus margin."""
    needed, free = required_bytes(expected), free_bytes(path)
    if free < needed:
        raise DiskFull(what, path, needed, free, note)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested dict/list (a DTensor counts its global size: all ranks
    write their shards into one shared folder)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights as saved: each parameter and buffer once (tied weights share
    one storage), numel x element size of its dtype."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _causes(exc: BaseException | None) -> list[BaseException]:
    """`exc`, its chain, and the per-rank errors a DCP CheckpointException wraps."""
    out: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exc, trace)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return out


def full_disk_error(exc: BaseException | None) -> OSError | None:
    """The ENOSPC / EDQUOT OSError behind `exc`, if that is what it is."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e
    return None


def as_disk_full(exc: BaseException, what: str = "a write") -> DiskFull | None:
    """A DiskFull verdict for an ENOSPC anywhere in `exc` (path from the OSError when it has one)."""
    if isinstance(exc, DiskFull):
        return exc
    err = full_disk_error(exc)
    if err is None:
        return None
    path = Path(err.filename or os.getcwd())
    return DiskFull(what, path, None, free_bytes(path), f" now ({os.strerror(err.errno)})")
