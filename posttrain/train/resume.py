"""Resume from the newest *intact* checkpoint; never be blocked by a damaged one.

A damaged newest checkpoint (a truncated shard, flipped bytes, a deleted file, a broken
meta.json) used to fail every re-run with an opaque DCP `CheckpointException`, although an
intact older checkpoint sat beside it. Here each candidate, newest first, is:
  1. checked against its `integrity.json` (sizes by every rank; sha256 split across ranks),
     and its meta.json parsed; a checkpoint without a record (written by an earlier version) is
     "unverified" and goes straight to 2;
  2. loaded; a load that raises (DCP, torch.load) marks it damaged too.
Every rank reports its findings and all take the same decision from the union of them. A damaged
checkpoint is logged (naming it, the file and what is wrong) and, once the run has something to
resume or restart from, moved aside to `step_<N>.damaged` (kept for inspection: not deleted, not
counted by retention, never tried again). When none is intact, `infra.no_intact_checkpoint`
decides: `restart` from step 0 (a warning and a `resume` record in metrics.jsonl say so) or
`fail` with `NoIntactCheckpoint`, naming every damaged file and leaving the folders in place.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.distributed.agree import barrier, from_rank0, gather_all, rank, world
from posttrain.errors import NoIntactCheckpoint
from posttrain.train.checkpoint import (
    apply_checkpoint,
    complete_checkpoints,
    discard_checkpoint,
    read_checkpoint,
)
from posttrain.train.integrity import (
    check_hashes,
    check_meta,
    check_sizes,
    my_share,
    read_record,
)

log = logging.getLogger("posttrain.train")


@dataclass
class ResumePoint:
    """What `resume_newest_intact` found and did."""

    path: Path | None = None  # the checkpoint loaded; None: start from step 0
    meta: dict[str, Any] = field(default_factory=dict)
    verified: bool = False  # its files matched integrity.json (False: no record to check)
    rejected: list[dict[str, Any]] = field(default_factory=list)  # checkpoint, problems, moved_to
    check_s: float = 0.0  # time spent checking and loading

    @property
    def restarted(self) -> bool:
        """Checkpoints existed but none could be used."""
        return self.path is None and bool(self.rejected)

    def record(self) -> dict[str, Any] | None:
        """The `resume` metrics record, when there is something to say."""
        if not self.rejected and (self.path is None or self.verified):
            return None
        return {
            "checkpoint": self.path.name if self.path else None,
            "start_step": int(self.meta.get("step", 0)),
            "verified": self.verified,
            "restarted": self.restarted,
            "rejected": self.rejected,
            "check_s": round(self.check_s, 3),
        }


def inspect_checkpoint(path: Path) -> tuple[bool, list[str]]:
    """(has an integrity record, problems) of one checkpoint, the same on every rank: each rank
    checks the sizes of all files and the sha256 of its share, and the findings are merged."""
    problems: list[str] = []
    files = None
    try:
        files = read_record(path)
    except ValueError as exc:
        problems.append(str(exc))
    if rank() == 0:
        problems += check_meta(path)
    if files is not None:
        problems += check_sizes(path, files) if rank() == 0 else []
        problems += check_hashes(path, files, my_share(sorted(files), rank(), world()))
    found = gather_all(problems)
    recorded = all(gather_all(files is not None))
    return recorded, sorted({p for part in found for p in part})


def _try_load(path: Path, model: torch.nn.Module, optim: Any, sched: Any) -> tuple[dict, list]:
    """(meta, problems: one per rank that failed). Applied only when every rank read it whole,
    so the ranks never end up in different states."""
    staged, err = None, None
    try:
        staged = read_checkpoint(path, model, optim)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        err = f"could not be loaded on rank {rank()}: {_first_line(exc)}"
    errors = [e for e in gather_all(err) if e]
    if errors:
        if staged is not None:
            discard_checkpoint(staged, optim)
        return {}, errors
    assert staged is not None
    return apply_checkpoint(staged, model, optim, sched), []


def _first_line(exc: BaseException) -> str:
    """The root cause in one line (DCP wraps each rank's error with its whole traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _move_aside(path: Path) -> Path:
    target = path.with_name(path.name + ".damaged")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    path.rename(target)
    return target


def _sweep_partial_saves(root: Path) -> None:
    """Remove `step_<N>.tmp` folders a killed save left (the stage lock says none is running)."""
    for tmp in sorted(root.glob("step_*.tmp")) if root.exists() else []:
        log.warning("removing %s: a partial checkpoint left by an interrupted save", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def resume_newest_intact(
    root: Path,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    sched: Any,
    on_none: str = "restart",
    where: str = "",
) -> ResumePoint:
    """Load the newest intact checkpoint under `root` into model/optim/sched (see the module
    docstring). `on_none`: `infra.no_intact_checkpoint`. Collective: call on every rank."""
    t0 = time.perf_counter()
    if rank() == 0:
        _sweep_partial_saves(root)
    candidates = [Path(p) for p in from_rank0([str(p) for p in complete_checkpoints(root)])]
    out = ResumePoint()
    for path in reversed(candidates):
        recorded, problems = inspect_checkpoint(path)
        if not problems:
            out.meta, problems = _try_load(path, model, optim, sched)
        if not problems:
            out.path, out.verified = path, recorded
            break
        out.rejected.append({"checkpoint": path.name, "problems": problems})
        if rank() == 0:
            log.warning(
                "%scheckpoint %s is damaged, not resuming from it: %s",
                f"{where}: " if where else "",
                path,
                "; ".join(problems),
            )
    out.check_s = time.perf_counter() - t0
    if out.rejected and out.path is None and on_none == "fail":
        # One line: it ends up in the stage's POSTTRAIN_ERROR verdict line.
        damaged = "; ".join(f"{r['checkpoint']}: {', '.join(r['problems'])}" for r in out.rejected)
        raise NoIntactCheckpoint(
            f"{where + ': ' if where else ''}no intact checkpoint in {root} "
            f"(infra.no_intact_checkpoint is fail). Damaged: {damaged}. Restore those files, "
            "delete the damaged folders, or set infra.no_intact_checkpoint=restart to train "
            "from step 0."
        )
    if rank() == 0:
        for r in out.rejected:
            r["moved_to"] = _move_aside(root / r["checkpoint"]).name
            log.warning(
                "moved damaged checkpoint %s aside to %s (kept for inspection; delete it when "
                "done: retention does not)",
                r["checkpoint"],
                r["moved_to"],
            )
        if out.path is not None and not out.verified:
            log.warning(
                "resumed from %s unverified: it has no integrity record (written by an earlier "
                "version); it loaded, but its contents could not be checked",
                out.path.name,
            )
        if out.restarted:
            log.warning(
                "%sno intact checkpoint (%s all damaged): restarting from step 0 "
                "(infra.no_intact_checkpoint is restart)",
                f"{where}: " if where else "",
                ", ".join(r["checkpoint"] for r in out.rejected),
            )
    out.rejected = from_rank0(out.rejected)  # with rank 0's moved_to
    barrier()
    return out
