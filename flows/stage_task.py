"""One generic Prefect task that launches a planned stage as a child process and supervises it.

Why a child process: a stage imports torch, may run under torchrun with several ranks, and may
need to be killed; the flow process stays light and outlives it. Supervision means:
  - reuse: a complete, unaltered artifact with the stage's fingerprint is returned, not rebuilt;
  - logs: the child's stdout+stderr go line by line to the Prefect run logger and to
    `<out_dir>/logs/stage.log` (appended; logs/ is outside the manifest);
  - progress: `<out_dir>/metrics.jsonl` is tailed into a Prefect progress artifact;
  - limits: the stage timeout is enforced, and on timeout, failure, cancel or any exception in
    this process the stage's whole process tree is terminated. Prefect's cancel only kills the
    flow process, and torchrun starts each worker in a session of its own, so killing our child's
    process group is not enough: every process carrying this launch's marker is killed too;
  - hangs: a training stage whose ranks' heartbeats all stop for `infra.hang_timeout_s` gets its
    ranks' Python stacks dumped (SIGUSR1 -> faulthandler) into logs/stacks-rank<k>.txt, is killed,
    and fails with `StageHung` naming the rank that is behind.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import shlex
import signal
import site
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
from prefect import Task, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import CachePolicy
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

import posttrain
from posttrain.artifacts import MANIFEST, ArtifactRef, ref_from_manifest, verify
from posttrain.device_lock import HELD_ENV as DEVICE_LOCK_ENV
from posttrain.locking import LOCK_HELD_ENV, ArtifactLock, LockTimeout, describe_holder
from posttrain.orphan import launcher_env
from posttrain.pipeline import PlannedStage
from posttrain.recovery import EARLIER_ATTEMPT_ENV, earlier_attempt
from posttrain.telemetry.heartbeat import Hang, HangWatch, read_heartbeats, stack_file
from posttrain.telemetry.rank_exit import describe_beat, describe_exit, how_it_ended, root_causes

ARTIFACT_MARKER = "POSTTRAIN_ARTIFACT "
# Every process of one launch inherits this variable, so stray ranks can be found and killed
# even after their parent died or when they run in a session of their own.
LAUNCH_ENV_VAR = "POSTTRAIN_LAUNCH_ID"
# ...and this one, the flow run's id: when the flow process itself is killed (a cancel that runs
# out of grace, a crash), the flow's hooks find the run's stage processes by it.
FLOW_RUN_ENV_VAR = "POSTTRAIN_FLOW_RUN_ID"
# The artifact lock this thread's `supervise_stage` holds, passed to the stage process it starts
# (LOCK_HELD_ENV) so the process does not wait for its own launcher. A context variable, not
# os.environ: several stages may be supervised at once from threads of one process.
_HELD_LOCK: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "posttrain_held_lock", default=None
)
# The device lock file (posttrain.device_lock) the flow holds, passed to its stage processes so
# an orphaned stage that goes on (infra.orphan=finish) can take the devices over.
HELD_DEVICE_LOCK: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "posttrain_device_lock", default=None
)
CHILD_ENV = {
    # Stages read local folders only; a stray hub id would otherwise cost ~47 s of retries.
    "HF_HUB_OFFLINE": "1",
    # Line-buffered output, so the log and Prefect see lines as they happen.
    "PYTHONUNBUFFERED": "1",
    # tokenizers' thread pool warns and can deadlock after fork (DataLoader workers).
    "TOKENIZERS_PARALLELISM": "false",
}
TAIL_LINES = 30
# Lines kept to find torchrun's failure summary in (it follows the ranks' tracebacks).
SUMMARY_LINES = 400
KILL_GRACE_S = 10.0
PROGRESS_INTERVAL_S = 2.0
# How long the ranks get to write their stacks after SIGUSR1 (faulthandler writes from the
# signal handler itself, so this is normally a few milliseconds).
STACK_DUMP_WAIT_S = 5.0
STACK_EXCERPT_LINES = 40


class StageFailed(RuntimeError):
    """A stage process exited non-zero, was killed, or left an incomplete artifact."""


class StageTimeout(StageFailed):
    """A stage ran past its `infra.timeouts.<stage>` limit and was killed."""


class StageHung(StageFailed):
    """No rank of a training stage beat its heartbeat for `infra.hang_timeout_s`; its stacks
    were dumped and it was killed."""

    def __init__(self, message: str, hang: Hang, stack_files: list[Path]):
        super().__init__(message)
        self.hang = hang
        self.stack_files = stack_files


# --- command and environment -------------------------------------------------------------------


NODE_RANK_ENV = "POSTTRAIN_NODE_RANK"


def node_rank(env: dict[str, str] | None = None) -> int:
    """This machine's node rank for multi-node stages (POSTTRAIN_NODE_RANK, default 0)."""
    value = (os.environ if env is None else env).get(NODE_RANK_ENV, "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{NODE_RANK_ENV} must be an integer, got {value!r}") from None


def stage_command(
    module: str,
    spec_path: Path | str,
    nprocs: int,
    python: str = sys.executable,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "posttrain",
) -> list[str]:
    """The command line that runs one stage on this node.

    One process: `python -m <module>`. Several on one node: `torchrun --standalone`. Several
    nodes: every node runs `torchrun --nnodes N --node-rank K` and they meet at the c10d
    rendezvous on `rdzv_endpoint` (hosted by the agent whose endpoint host is local, normally
    node rank 0) under `rdzv_id` (the stage fingerprint: every node derives the same one).
    """
    stage_args = ["-m", module, "--spec", str(spec_path)]
    if nnodes <= 1 and nprocs <= 1:
        return [python, *stage_args]
    launcher = [python, "-m", "torch.distributed.run"]
    if nnodes <= 1:
        return [*launcher, "--standalone", "--nproc-per-node", str(nprocs), *stage_args]
    if not rdzv_endpoint:
        raise ValueError("a multi-node stage needs a rendezvous endpoint (infra.rdzv_endpoint)")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
    return [
        *launcher,
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nprocs),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        rdzv_id,
        *stage_args,
    ]


def child_env(
    launch_id: str, base: dict[str, str] | None = None, earlier_attempt: str | None = None
) -> dict[str, str]:
    """The stage's environment: ours, plus the fixed settings and the launch marker.

    `earlier_attempt`: the launcher's account of an unfinished earlier attempt of this stage
    (`posttrain.recovery`), for the stage's summary: the launcher reads it before it clears
    the old heartbeats, which the stage then can no longer see.

    The folder holding the `posttrain` package goes on PYTHONPATH so `python -m posttrain...`
    works from any working directory when the project is used from a checkout.
    """
    env = dict(os.environ if base is None else base)
    env.update(CHILD_ENV)
    env[LAUNCH_ENV_VAR] = launch_id
    env.pop(EARLIER_ATTEMPT_ENV, None)
    if earlier_attempt:
        env[EARLIER_ATTEMPT_ENV] = earlier_attempt
    env.pop(LOCK_HELD_ENV, None)
    if held := _HELD_LOCK.get():
        env[LOCK_HELD_ENV] = held
    env.pop(DEVICE_LOCK_ENV, None)
    if device_lock := HELD_DEVICE_LOCK.get():
        env[DEVICE_LOCK_ENV] = device_lock
    # Who launched the stage, so it notices when its launcher is gone (posttrain.orphan).
    env.update(launcher_env())
    flow_run_id = current_flow_run_id()
    if flow_run_id:
        env[FLOW_RUN_ENV_VAR] = flow_run_id
    root = str(Path(posttrain.__file__).resolve().parent.parent)
    if root not in site.getsitepackages():
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def current_flow_run_id() -> str | None:
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None


# --- killing a stage's processes ---------------------------------------------------------------


def _alive(p: psutil.Process) -> bool:
    try:
        # Orphans here may be re-parented to a PID 1 that never reaps: a zombie is dead.
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stage_processes(proc: subprocess.Popen[str], launch_id: str) -> list[psutil.Process]:
    """The stage process, its descendants, and any other process carrying the launch marker."""
    found: dict[int, psutil.Process] = {}
    # Only while our child is unreaped is its PID surely still ours (not reused).
    if proc.poll() is None:
        with contextlib.suppress(psutil.Error):
            leader = psutil.Process(proc.pid)
            for p in [leader, *leader.children(recursive=True)]:
                found[p.pid] = p
    for p in processes_with_env(LAUNCH_ENV_VAR, launch_id):
        found.setdefault(p.pid, p)
    return [p for p in found.values() if _alive(p)]


def processes_with_env(var: str, value: str) -> list[psutil.Process]:
    """Live processes (other than this one) whose environment has `var=value`."""
    me, found = os.getpid(), []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(var) == value and _alive(p):
                found.append(p)
        except psutil.Error:
            continue  # gone, a zombie, or not ours to read
    return found


def kill_flow_run_processes(flow_run_id: str, grace_s: float = KILL_GRACE_S) -> int:
    """SIGTERM, then SIGKILL after `grace_s`, every stage process of a flow run; returns how
    many were found. The backstop for a flow process that died before its tasks cleaned up."""
    procs = processes_with_env(FLOW_RUN_ENV_VAR, flow_run_id)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in procs):
            time.sleep(0.1)
        if not any(_alive(p) for p in procs):
            break
    return len(procs)


def _in_group(p: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(p.pid) == pgid
    except OSError:
        return False


def _signal_all(
    proc: subprocess.Popen[str], procs: list[psutil.Process], sig: signal.Signals
) -> None:
    """Signal the stage's process group (which catches processes spawned since `procs` was
    listed) and each of `procs` (which catches those in sessions of their own)."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    # Signal the group only while it surely is ours: our child is unreaped, or a member is
    # known. An empty group's id could be reused by an unrelated process.
    if proc.poll() is None or any(_in_group(p, pgid) for p in procs):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def kill_stage(
    proc: subprocess.Popen[str],
    launch_id: str,
    grace_s: float,
    log: logging.LoggerAdapter | logging.Logger,
) -> None:
    """SIGTERM the stage's process group and every process of the launch; SIGKILL what is
    still alive after `grace_s` (torchrun forwards SIGTERM to its ranks and needs a moment).

    Every process of the launch inherits the marker, so finding none (and our child reaped)
    means there is nothing left to kill.
    """
    procs = stage_processes(proc, launch_id)
    if not procs and proc.poll() is not None:
        return
    log.warning("stage: terminating %d process(es)", len(procs))
    _signal_all(proc, procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(p) for p in procs):
            break
        time.sleep(0.1)
    # Processes may have started during the grace period (a rank being spawned): look again.
    survivors = [p for p in {*procs, *stage_processes(proc, launch_id)} if _alive(p)]
    if survivors or proc.poll() is None:
        log.warning("stage: killing %d process(es) still alive after SIGTERM", len(survivors))
        _signal_all(proc, survivors, signal.SIGKILL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        log.error("stage process %d did not exit after SIGKILL", proc.pid)


# --- logs and progress -------------------------------------------------------------------------


def run_logger() -> logging.LoggerAdapter | logging.Logger:
    """Prefect's run logger inside a task; a plain logger when called outside Prefect (tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("posttrain.flows")


def _start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    # Prefect's run context and settings live in contextvars, which a new thread does not
    # inherit: run the thread inside a copy so logs and artifacts land on this task run.
    ctx = contextvars.copy_context()
    t = threading.Thread(target=ctx.run, args=(target,), name=name, daemon=True)
    t.start()
    return t


class OutputPump:
    """Copies the child's merged stdout/stderr to the log file and the run logger, keeps the
    last lines for error messages and catches the POSTTRAIN_ARTIFACT line."""

    def __init__(
        self,
        stream: IO[str],
        log_file: IO[str],
        log: logging.LoggerAdapter | logging.Logger,
        stage: str,
    ):
        self.stream, self.log_file, self.log, self.stage = stream, log_file, log, stage
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.recent: deque[str] = deque(maxlen=SUMMARY_LINES)
        self.artifact_json: str | None = None
        self.thread = _start_thread(self._run, f"{stage}-output")

    def _run(self) -> None:
        for raw in self.stream:
            line = raw.rstrip("\n")
            self.tail.append(line)
            self.recent.append(line)
            if line.startswith(ARTIFACT_MARKER):
                self.artifact_json = line[len(ARTIFACT_MARKER) :]
            try:
                self.log_file.write(line + "\n")
                self.log_file.flush()
                self.log.info("[%s] %s", self.stage, line)
            except Exception:
                # Keep draining whatever happens (disk full, logging down): a child writing
                # into a full pipe nobody reads would block until its timeout.
                pass

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def tail_text(self) -> str:
        return "\n".join(self.tail)


def progress_from_record(record: dict[str, Any]) -> tuple[float, str] | None:
    """(percent, description) from one metrics.jsonl line; None unless it is a training step."""
    if record.get("kind") != "train":
        return None
    step, total = record.get("step"), record.get("total_steps")
    if not isinstance(step, int | float) or not isinstance(total, int | float) or total <= 0:
        return None
    parts = [f"step {step:g}/{total:g}"]
    for key, fmt in (
        ("loss", "loss {:.4g}"),
        ("tokens_per_s", "{:,.0f} tok/s"),
        ("mfu", "MFU {:.1%}"),
    ):
        value = record.get(key)
        if isinstance(value, int | float):
            parts.append(fmt.format(value))
    return min(100.0, max(0.0, 100.0 * step / total)), " · ".join(parts)


class MetricsTail:
    """Follows metrics.jsonl and reports training progress every `interval_s` seconds."""

    def __init__(
        self,
        path: Path,
        report: Callable[[float, str], None],
        interval_s: float = PROGRESS_INTERVAL_S,
    ):
        self.path, self.report, self.interval_s = path, report, interval_s
        self._offset = 0
        self._partial = ""
        self._last: tuple[float, str] | None = None
        self._stop = threading.Event()
        self.thread = _start_thread(self._run, f"{path.parent.name}-metrics")

    def poll(self) -> None:
        """Read the lines appended since the last poll; report the newest training step."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self._offset:  # rewritten (a restarted stage): start over
            self._offset, self._partial = 0, ""
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self._offset)
            chunk = f.read()
            self._offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # a line still being written
        latest = None
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                latest = progress_from_record(record) or latest
        if latest is not None and latest != self._last:
            self._last = latest
            self.report(*latest)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_poll()

    def _safe_poll(self) -> None:
        try:
            self.poll()
        except Exception as exc:  # progress is decoration: never let it fail the stage
            logging.getLogger("posttrain.flows").debug("progress update failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self._safe_poll()  # the last steps written before exit


class ProgressArtifact:
    """A Prefect progress artifact for one stage run; does nothing outside a task run."""

    def __init__(self, stage: str):
        self.stage = stage
        self.id = None
        if TaskRunContext.get() is None:
            return
        try:
            self.id = create_progress_artifact(
                0.0, key=f"{artifact_key(stage)}-progress", description=f"{stage}: starting"
            )
        except Exception as exc:  # progress is decoration: never fail a stage over it
            run_logger().warning("no progress artifact for %s: %s", stage, exc)

    def update(self, percent: float, description: str) -> None:
        if self.id is None:
            return
        try:
            # No retries: while the server is away a retried update would hold the caller (the
            # supervisor, for the last one) for a minute or more; the next update comes anyway.
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
                update_progress_artifact(
                    self.id, percent, description=f"{self.stage}: {description}"
                )
        except Exception as exc:
            logging.getLogger("posttrain.flows").debug("progress update failed: %s", exc)


def artifact_key(text: str) -> str:
    """Prefect artifact keys allow only lowercase letters, digits and dashes."""
    key = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in key.split("-") if part) or "stage"


def dump_stacks(
    proc: subprocess.Popen[str],
    launch_id: str,
    hang: Hang,
    out_dir: Path,
    wait_s: float = STACK_DUMP_WAIT_S,
) -> list[Path]:
    """SIGUSR1 to every rank that announced its PID in a beat and is still a process of this
    launch, then wait until their stack files stop growing. Only those: they registered
    faulthandler, while SIGUSR1 kills a process that did not (torchrun's agent, a helper).
    Returns the stack files of the ranks signalled."""
    ours = {p.pid: p for p in stage_processes(proc, launch_id)}
    files = []
    for r in hang.ranks:
        if r.pid in ours:
            with contextlib.suppress(psutil.Error):
                ours[r.pid].send_signal(signal.SIGUSR1)
                files.append(stack_file(out_dir, r.rank))
    deadline = time.monotonic() + wait_s
    sizes: list[int] = []
    while files and time.monotonic() < deadline:
        time.sleep(0.2)
        now = [f.stat().st_size if f.exists() else 0 for f in files]
        if all(now) and now == sizes:
            break
        sizes = now
    return files


def _hang_message(
    stage: PlannedStage, hang: Hang, files: list[Path], log_path: Path, tail: str
) -> str:
    behind = hang.behind
    where = (
        "stopped before beating"
        if behind.silent_s is None
        else (
            f"is behind: last beat at step {behind.step} (phase {behind.phase}), "
            f"{behind.silent_s:.0f} s ago"
        )
    )
    text = (
        f"stage '{stage.name}' hung: no rank's heartbeat advanced for {hang.limit_s:g} s "
        f"(infra.hang_timeout_s {stage.hang_timeout_s:g}); rank {behind.rank} {where}. "
        f"Ranks: {hang.describe()}. The stage was killed with its process group. "
    )
    if files:
        text += "Python stacks (SIGUSR1): " + ", ".join(str(f) for f in files) + "."
        mine = stack_file(stage.out_dir, behind.rank)
        if mine in files and mine.exists():
            lines = mine.read_text(errors="replace").splitlines()[:STACK_EXCERPT_LINES]
            text += f"\n--- rank {behind.rank}'s stacks ---\n" + "\n".join(lines)
    else:
        text += "No rank process was left to dump its stacks."
    return f"{text}\nLog: {log_path}\n--- end of the log ---\n{tail}"


def _failure_headline(stage: PlannedStage, rc: int, recent: list[str]) -> str:
    """What ended a failed launch, in one line. Under torchrun the launcher's own exit code (1)
    says nothing: name the rank its failure summary blames first, how that rank ended and where
    its last heartbeat was. A single process is rank 0 itself."""
    beats = read_heartbeats(stage.out_dir)
    causes = root_causes(recent)
    if causes:
        first = "; ".join(describe_exit(c, beats) for c in causes)
        return f"stage '{stage.name}' failed: {first}. The launcher stopped the other ranks"
    text = f"stage '{stage.name}' {how_it_ended(rc)}"
    if stage.nprocs <= 1 and stage.nnodes <= 1 and 0 in beats:
        text += f"; its last heartbeat: {describe_beat(beats[0])}"
    elif beats:
        text += "; last heartbeats: " + ", ".join(
            f"rank {k}: {describe_beat(b)}" for k, b in sorted(beats.items())
        )
    return text


# --- the launcher ------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: str  # "ran" or "reused"
    ref: ArtifactRef

    def to_dict(self) -> dict[str, Any]:
        # JSON-serialisable: this is what Prefect persists as the cached result.
        return {"status": self.status, "ref": self.ref.model_dump(mode="json")}


def _drop_stale_manifest(
    out_dir: Path, why: str, log: logging.LoggerAdapter | logging.Logger
) -> None:
    # An altered artifact must not look complete while (or if) the re-run is in progress:
    # "no manifest means not done". The stage's other files, checkpoints included, stay.
    manifest = out_dir / MANIFEST
    if manifest.exists():
        log.warning(
            "artifact in %s is not valid (%s): removing its manifest and re-running", out_dir, why
        )
        manifest.unlink()


def _completed_ref(stage: PlannedStage, artifact_json: str | None) -> ArtifactRef:
    ref = (
        ArtifactRef.model_validate_json(artifact_json)
        if artifact_json
        else ref_from_manifest(stage.out_dir)
    )
    ok, why = verify(stage.out_dir)
    if not ok:
        raise StageFailed(f"stage '{stage.name}' exited 0 but its artifact is incomplete: {why}")
    if ref.fingerprint != stage.fingerprint:
        raise StageFailed(
            f"stage '{stage.name}' wrote fingerprint {ref.fingerprint}, expected {stage.fingerprint}"
        )
    return ref


def supervise_stage(
    stage: PlannedStage, spec_path: Path | str, kill_grace_s: float = KILL_GRACE_S
) -> Outcome:
    """Run one planned stage to completion (or reuse its artifact) and return its ref.

    The artifact folder's lock (`posttrain.locking`) is held from the first look at the folder
    to the completion check, so a second run of the same stage (same fingerprint) waits for
    the first, logging that it does, then reuses what it made; the wait counts against the
    stage's timeout.
    """
    log = run_logger()
    if node_rank() != 0:
        # Another node's agent joins node 0's launch; the lock is node 0's to hold.
        return _supervise(stage, spec_path, kill_grace_s)
    lock = ArtifactLock(stage.out_dir)

    def waiting(holder: dict[str, Any] | None) -> None:
        log.info(
            "stage %s: waiting for another run of the same stage to finish (%s holds %s)",
            stage.name,
            describe_holder(holder),
            lock.path,
        )

    try:
        waited = lock.acquire(
            {"what": f"stage {stage.name} launcher"}, on_wait=waiting, timeout_s=stage.timeout_s
        )
    except LockTimeout as exc:
        raise StageTimeout(f"stage '{stage.name}' was not started: {exc}") from None
    token = _HELD_LOCK.set(str(lock.path))
    try:
        outcome = _supervise(stage, spec_path, kill_grace_s)
    finally:
        _HELD_LOCK.reset(token)
        lock.release()
    if waited:
        log.info("stage %s: the other run is done; this one %s", stage.name, outcome.status)
    return outcome


def _supervise(stage: PlannedStage, spec_path: Path | str, kill_grace_s: float) -> Outcome:
    """`supervise_stage` under the lock: reuse, or launch, watch and check the stage."""
    log = run_logger()
    ok, why = verify(stage.out_dir)
    if ok:
        log.info("stage %s: complete artifact found in %s, reusing it", stage.name, stage.out_dir)
        return Outcome("reused", ref_from_manifest(stage.out_dir))
    _drop_stale_manifest(stage.out_dir, why, log)
    # Before this launch writes its own traces (launch line, heartbeats) over the old ones.
    earlier = earlier_attempt(stage.out_dir)
    if earlier:
        log.warning("stage %s: %s", stage.name, earlier)

    cmd = stage_command(
        stage.module,
        spec_path,
        stage.nprocs,
        nnodes=stage.nnodes,
        node_rank=node_rank(),
        rdzv_endpoint=stage.rdzv_endpoint,
        rdzv_id=stage.fingerprint,
    )
    launch_id = uuid.uuid4().hex
    log_path = stage.out_dir / "logs" / "stage.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    progress = ProgressArtifact(stage.name)
    log.info("stage %s: %s", stage.name, shlex.join(cmd))
    timed_out = False
    watch = hang = None
    stacks: list[Path] = []
    if stage.hang_timeout_s:
        # Ranks of other nodes beat there; only this node's can be expected here.
        local = tuple(range(stage.nprocs)) if stage.nnodes <= 1 else ()
        watch = HangWatch(stage.out_dir, stage.hang_timeout_s, stage.hang_startup_s, local)
        watch.clear()  # an earlier launch's beats must not count as this one's
    with open(log_path, "a", encoding="utf-8") as log_file:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log_file.write(f"=== {started} launch {launch_id}: {shlex.join(cmd)}\n")
        log_file.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(launch_id, earlier_attempt=earlier),
            start_new_session=True,  # its own process group, so killpg reaches every rank
            text=True,
            errors="replace",
            bufsize=1,
        )
        pump = OutputPump(proc.stdout, log_file, log, stage.name)  # type: ignore[arg-type]
        metrics = MetricsTail(stage.out_dir / "metrics.jsonl", progress.update)
        deadline = time.monotonic() + stage.timeout_s
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    log.error("stage %s: timeout after %.0f s", stage.name, stage.timeout_s)
                    break
                if watch is not None and (hang := watch.poll()) is not None:
                    log.error(
                        "stage %s: no heartbeat for %.0f s (%s); dumping stacks",
                        stage.name,
                        hang.limit_s,
                        hang.describe(),
                    )
                    stacks = dump_stacks(proc, launch_id, hang, stage.out_dir)
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.5)
        finally:
            # Runs on success too: ranks or helpers the stage left behind must not outlive it.
            # On an exception here (KeyboardInterrupt, Prefect's TerminationSignal on cancel)
            # this is what stops the stage.
            kill_stage(proc, launch_id, kill_grace_s, log)
            pump.join(timeout=10)
            metrics.stop()

    tail = pump.tail_text()
    if hang is not None:
        raise StageHung(_hang_message(stage, hang, stacks, log_path, tail), hang, stacks)
    if timed_out:
        raise StageTimeout(
            f"stage '{stage.name}' timed out after {stage.timeout_s:g} s "
            f"(infra.timeouts.{stage.name}) and was killed with its process group. "
            f"Log: {log_path}\n--- end of the log ---\n{tail}"
        )
    rc = proc.returncode
    if rc != 0:
        headline = _failure_headline(stage, rc, list(pump.recent))
        raise StageFailed(f"{headline}. Log: {log_path}\n--- end of the log ---\n{tail}")
    ref = _completed_ref(stage, pump.artifact_json)
    progress.update(100.0, "done")
    return Outcome("ran", ref)


# --- the Prefect task --------------------------------------------------------------------------


@dataclass
class StageFingerprintPolicy(CachePolicy):
    """Cache key = stage name + fingerprint, so an unchanged stage hits across flow runs.

    Prefect's DEFAULT policy hashes the flow-run id in, so it never hits across runs.
    """

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        stage = inputs.get("stage")
        if not isinstance(stage, PlannedStage):
            return None
        return f"posttrain-{stage.name}-{stage.fingerprint}"


@task(
    name="run-stage",
    task_run_name="{stage.name}",
    cache_policy=StageFingerprintPolicy(),
    persist_result=True,
    result_serializer="json",
)
def run_stage(
    stage: PlannedStage, spec_path: Path, kill_grace_s: float = KILL_GRACE_S
) -> dict[str, Any]:
    """Launch and supervise one stage. Returns `{"status": "ran"|"reused", "ref": {...}}`."""
    return supervise_stage(stage, spec_path, kill_grace_s).to_dict()


def results_dir(workspace: str | os.PathLike[str]) -> Path:
    """Prefect results and cache records live in the workspace, next to the artifacts they
    point at, not in ~/.prefect/storage (shared by every run and test on the machine)."""
    return Path(workspace) / ".prefect" / "results"


def stage_task_for(workspace: str | os.PathLike[str]) -> Task[..., dict[str, Any]]:
    """`run_stage` with its results stored inside `workspace`.

    A Path, not a `LocalFileSystem` block: Prefect refuses unsaved blocks as task result
    storage, and saving one per workspace would litter the server with blocks. Prefect turns
    the path into a local file system itself.
    """
    return run_stage.with_options(result_storage=results_dir(workspace))
