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
import logging
import os
import shlex
import signal
import site
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.context import FlowRunContext, TaskRunContext

import posttrain
from flows.stage_output import (
    MetricsTail,
    OutputPump,
    ProgressArtifact,
    run_logger,
)
from flows.stage_procs import (
    FLOW_RUN_ENV_VAR,
    KILL_GRACE_S,
    LAUNCH_ENV_VAR,
    kill_stage,
    stage_processes,
)
from posttrain import hub
from posttrain.artifacts import MANIFEST, ArtifactRef, ref_from_manifest, verify
from posttrain.device_lock import HELD_ENV as DEVICE_LOCK_ENV
from posttrain.locking import LOCK_HELD_ENV, ArtifactLock, LockTimeout, describe_holder
from posttrain.orphan import launcher_env
from posttrain.planner import PlannedStage
from posttrain.recovery import EARLIER_ATTEMPT_ENV, earlier_attempt
from posttrain.telemetry.heartbeat import Hang, HangWatch, read_heartbeats, stack_file
from posttrain.telemetry.rank_exit import describe_beat, describe_exit, how_it_ended, root_causes

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
    # Line-buffered output, so the log and Prefect see lines as they happen.
    "PYTHONUNBUFFERED": "1",
    # tokenizers' thread pool warns and can deadlock after fork (DataLoader workers).
    "TOKENIZERS_PARALLELISM": "false",
}
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
    launch_id: str,
    base: dict[str, str] | None = None,
    earlier_attempt: str | None = None,
    visible_devices: str | None = None,
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
    if visible_devices is not None:  # one of several stages running side by side
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    # Offline exactly when the launcher is (posttrain.hub.offline): a hub id the plan resolved
    # online is downloaded by the stage that reads it.
    env["HF_HUB_OFFLINE"] = "1" if hub.offline() else "0"
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
            env=child_env(
                launch_id, earlier_attempt=earlier, visible_devices=stage.visible_devices
            ),
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
