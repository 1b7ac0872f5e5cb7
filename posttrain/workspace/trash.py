"""Deleting what `posttrain.workspace.clean` planned, so that a killed `clean` harms nothing.

Each candidate is first renamed, whole, into `<workspace>/.trash/` (one `rename`: atomic on one
file system), then deleted there. A run looks only at `artifacts/<stage>/<fingerprint>/` and
trusts a folder whose manifest verifies (`posttrain.store.status`); the rename
takes the folder away in one step, so a `clean` killed at any moment leaves either the whole
artifact where it was or nothing there, never a folder with a manifest and half its files. The
next `clean` empties what a killed one left in the trash.

The rename happens under the artifact's lock (`posttrain.store.locking.ArtifactLock`, taken without
waiting): a stage that started since the plan was made holds it, and its folder is skipped;
a stage that starts after the rename finds no folder and builds it anew. Under the lock the
candidate is looked at again (a failed attempt may have been completed since).
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.store.locking import ArtifactLock
from posttrain.store.status import status
from posttrain.workspace.clean import FAILED, TRASH, TRASH_DIR, UNREFERENCED, Candidate, CleanPlan
from posttrain.workspace.runs import list_runs


@dataclass
class Outcome:
    freed: int = 0
    deleted: list[Candidate] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "path: why"


def _still_candidate(c: Candidate, workspace: Path) -> str | None:
    """Why `c` must now be left alone, looked at again under its lock; None when it may go."""
    if not c.path.exists() or c.path.is_symlink():
        return "gone since the plan was made"
    # Sizes only, as the plan looked: hashing here would read every byte being deleted.
    complete = status(c.artifact, c.artifact.name, hashes=False).complete
    if c.category == FAILED and complete:
        return "its stage completed since the plan was made"
    if c.category == UNREFERENCED:
        # A run looks at an artifact under its lock, which this process now holds, and takes
        # its run.lock before it looks at any: one that may reuse this folder is running now.
        if running := [r.run_id for r in list_runs(workspace) if r.status == "running"]:
            return f"run {running[0]} started since the plan was made and may use it"
        if not complete:
            return "no longer complete"
    return None


def _inside(path: Path, workspace: Path) -> bool:
    return path.resolve().is_relative_to(workspace) and not path.is_symlink()


def delete(plan: CleanPlan) -> Outcome:
    """Delete the plan's candidates (module docstring); what was freed, deleted and skipped."""
    out = Outcome()
    trash = plan.workspace / TRASH_DIR
    trash.mkdir(exist_ok=True)
    for i, c in enumerate(plan.candidates):
        rel = c.path.relative_to(plan.workspace)
        if not _inside(c.path, plan.workspace):  # the plan never walks a link; checked again
            out.skipped.append(f"{rel}: outside the workspace")
            continue
        gone = c.path
        if c.category != TRASH:
            dest = trash / f"{os.getpid()}-{i}-{c.path.name}"
            gone = _move_to_trash(c, dest, plan.workspace, out)
        if gone is not None:
            shutil.rmtree(gone, ignore_errors=True)
            out.freed += c.bytes
            out.deleted.append(c)
    if not any(trash.iterdir()):
        trash.rmdir()
    return out


def _move_to_trash(c: Candidate, dest: Path, workspace: Path, out: Outcome) -> Path | None:
    rel = c.path.relative_to(workspace)
    lock = ArtifactLock(c.artifact)
    if not lock.try_acquire({"what": "posttrain clean"}):
        out.skipped.append(f"{rel}: a stage took it since the plan was made")
        return None
    try:
        if why := _still_candidate(c, workspace):
            out.skipped.append(f"{rel}: {why}")
            return None
        try:
            os.rename(c.path, dest)
        except OSError as exc:
            reason = "on another file system" if exc.errno == errno.EXDEV else exc.strerror
            out.skipped.append(f"{rel}: not moved to {TRASH_DIR} ({reason})")
            return None
        return dest
    finally:
        lock.release()
