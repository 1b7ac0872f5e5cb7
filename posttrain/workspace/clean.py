"""What `posttrain clean` may delete from a workspace, and why each thing is safe to delete.

Candidates, by category:
  - failed attempts: an artifact folder without a manifest (a stage that failed or was killed;
    `posttrain.runtime.recovery` tells which), or whose manifest no longer matches its files
    (sizes) or its folder's fingerprint (`posttrain.store.status`, without hashing);
  - damaged checkpoints: in a complete artifact, `checkpoints/step_N.tmp` (a save cut short),
    `step_N.damaged*` (set aside by a resume) and complete checkpoints that fail their
    integrity record (`posttrain.train.integrity`);
  - unreferenced artifacts: complete artifacts that no run record (`run.json`; with
    `keep_last`, only the newest runs count) and no champion names;
  - trash: what an interrupted `clean` left in `<workspace>/.trash`.
Never candidates: every artifact of a champion's lineage and of any pipeline's registry history,
every artifact of the newest completed run of each pipeline, a folder whose lock a process holds
(a stage running), one written in the last `quiet_s` seconds (a stage on another machine, or one
that outlived its run, before it notices), and anything reached through a symbolic link (the
walk never follows one, so nothing outside the workspace is ever counted or deleted). While a
run is running, no complete artifact is a candidate: it may be reusing one it has not recorded
yet. Deleting is `posttrain.workspace.trash`.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.runtime.recovery import earlier_attempt
from posttrain.store.locking import is_held, lock_path
from posttrain.store.status import status
from posttrain.train.integrity import check_hashes, check_meta, check_sizes, read_record
from posttrain.workspace.runs import RunInfo, list_runs

FAILED, DAMAGED = "failed attempt", "damaged checkpoint"
UNREFERENCED, TRASH = "unreferenced artifact", "trash"
TRASH_DIR = ".trash"
# A stage run by Slurm or Kubernetes notices its flow is gone after infra.supervisor_silence_s
# (120 s by default) and only then stops or takes over the lock: until then it writes unlocked.
QUIET_S = 180.0
# What stages compute for later runs to reuse, named by no run record (`posttrain.store.cache`):
# DPO's reference log-probs and a teacher's answers, each kept while an artifact it was computed
# from (its manifest's parents) is kept. Written without a lock, so an unfinished one is left
# alone while a run runs.
CACHES = ("ref_logps", "teacher_answers")
_STEP = re.compile(r"^step_\d+$")
_HALF = re.compile(r"^step_\d+\.(tmp|damaged.*)$")


@dataclass
class Candidate:
    category: str
    path: Path  # what is deleted
    artifact: Path  # the artifact folder whose lock guards it (the path itself for trash)
    bytes: int
    why: str


@dataclass
class CleanPlan:
    workspace: Path
    candidates: list[Candidate] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # "path: why" for what looked deletable

    def total(self, category: str | None = None) -> int:
        return sum(c.bytes for c in self.candidates if category in (None, c.category))


def disk_usage(folder: Path) -> tuple[int, float]:
    """(bytes deleting `folder` frees, newest modification time in it). Symbolic links are
    counted as links, never followed; a file with other hard links frees nothing."""
    total, newest = 0, 0.0
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if name in files and st.st_nlink == 1:
                total += st.st_blocks * 512
    return total, newest


def champion_lineages(workspace: Path) -> set[tuple[str, str]]:
    """(stage, fingerprint) of every artifact a registry names: each champion's lineage and
    every decided candidate's (a past champion may be promoted back), head-to-heads included.
    Never touched, not even their checkpoints."""
    keep: set[tuple[str, str]] = set()
    for path in sorted((workspace / "registry").glob("*.json")):
        try:
            reg = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for entry in [reg.get("champion") or {}, *reg.get("history", [])]:
            keep.update((str(s), str(fp)) for s, fp in (entry.get("lineage") or {}).items())
            h2h = entry.get("head_to_head") or {}
            if h2h.get("fingerprint"):
                keep.add(("head_to_head", str(h2h["fingerprint"])))
    return keep


def referenced(runs: list[RunInfo], keep_last: int | None) -> set[tuple[str, str]]:
    """(stage, fingerprint) of the artifacts the kept runs (the newest `keep_last`, or all)
    used or made, and always those of the newest completed run of each pipeline."""
    refs = {a for r in (runs if keep_last is None else runs[:keep_last]) for a in r.artifacts}
    newest: dict[str, RunInfo] = {}
    for run in runs:  # newest first
        if run.status == "completed":
            newest.setdefault(run.name, run)
    for run in newest.values():
        refs.update(run.artifacts)
    return refs


def _folders(folder: Path) -> list[Path]:
    """The sub-folders of `folder`, sorted; none through a symbolic link, at either level."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    return [p for p in sorted(folder.iterdir()) if p.is_dir() and not p.is_symlink()]


def damaged_checkpoints(artifact: Path) -> list[tuple[Path, str]]:
    """(checkpoint folder, what is wrong) for each damaged one in `artifact/checkpoints`."""
    found: list[tuple[Path, str]] = []
    for p in _folders(artifact / "checkpoints"):
        if _HALF.match(p.name):
            found.append((p, "half-written" if p.name.endswith(".tmp") else "set aside"))
        elif _STEP.match(p.name) and (problems := checkpoint_problems(p)):
            found.append((p, problems[0]))
    return found


def checkpoint_problems(step: Path) -> list[str]:
    """What a resume would reject the checkpoint for: an unreadable meta.json or integrity
    record, files missing or of another size or content than recorded at save."""
    problems = check_meta(step)
    try:
        files = read_record(step)
    except ValueError as exc:
        return [*problems, str(exc)]
    if files is not None:
        problems += check_sizes(step, files) or check_hashes(step, files, sorted(files))
    return problems


def plan_clean(
    workspace: str | os.PathLike[str], keep_last: int | None = None, quiet_s: float = QUIET_S
) -> CleanPlan:
    """Everything `clean` would delete (see the module docstring) and what it kept, and why.
    `keep_last`: only the newest N runs' records keep their artifacts (None: every run's)."""
    ws = Path(workspace).resolve()
    plan = CleanPlan(ws)
    runs = list_runs(ws)
    lineages, refs = champion_lineages(ws), referenced(runs, keep_last)
    running = [r.run_id for r in runs if r.status == "running"]
    kept_fps = {fp for _, fp in refs | lineages}
    for stage in _folders(ws / "artifacts"):
        for art in _folders(stage):
            key = (stage.name, art.name)
            if key in lineages:
                continue
            if stage.name not in CACHES:
                _look_at(plan, art, key in refs, running, quiet_s)
            elif (ref := status(art, art.name, hashes=False).ref) is not None:
                derived = any(p in kept_fps for p in ref.parents)
                _look_at(plan, art, derived, running, quiet_s, cache=True)
            elif running:
                plan.kept.append(
                    f"artifacts/{stage.name}/{art.name}: unfinished, run {running[0]} runs"
                )
            else:
                _look_at(plan, art, False, running, quiet_s, cache=True)
    trash = ws / TRASH_DIR
    for p in sorted(trash.iterdir()) if trash.is_dir() and not trash.is_symlink() else []:
        size, _ = disk_usage(p)
        plan.candidates.append(Candidate(TRASH, p, p, size, "left by an interrupted clean"))
    return plan


def _look_at(
    plan: CleanPlan,
    art: Path,
    referenced: bool,
    running: list[str],
    quiet_s: float,
    cache: bool = False,
) -> None:
    """Add `art` (or its damaged checkpoints) to the plan, or say in `plan.kept` why not."""
    rel = art.relative_to(plan.workspace)
    if is_held(lock_path(art)):
        plan.kept.append(f"{rel}: a process holds its lock (a stage is running)")
        return
    size, newest = disk_usage(art)
    # Sizes only: a stat per file of the whole workspace; the supervisor that would reuse one
    # hashes it, and deletion looks again under the lock (`posttrain.workspace.trash`). The
    # folder's name is its fingerprint (a cache entry's, its key).
    look = status(art, art.name, hashes=False)
    if not look.complete:
        if time.time() - newest < quiet_s:  # only an unfinished stage may still be writing
            ago = time.time() - newest
            plan.kept.append(f"{rel}: written {ago:.0f} s ago, may still be in use")
        elif look.state == "unsealed":
            why = earlier_attempt(art) or "no manifest: the stage never finished"
            plan.candidates.append(Candidate(FAILED, art, art, size, why))
        else:
            why = f"its manifest no longer matches its files ({look.why}): a run rebuilds it"
            plan.candidates.append(Candidate(FAILED, art, art, size, why))
        return
    if not referenced and running:
        plan.kept.append(f"{rel}: unreferenced, but run {running[0]} is running and may use it")
    elif not referenced:
        why = "complete, but no kept run record and no champion names it"
        if cache:
            why = "a cache computed from an artifact that is no longer kept"
        plan.candidates.append(Candidate(UNREFERENCED, art, art, size, why))
        return
    for step, why in damaged_checkpoints(art):
        plan.candidates.append(Candidate(DAMAGED, step, art, disk_usage(step)[0], why))
