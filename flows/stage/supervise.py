"""Supervising one stage launch: under the artifact's lock, reuse a complete artifact, else
write the launch's spec and start the stage through its launcher (`flows.stage.launchers`: this
machine, Slurm or Kubernetes), watch it (timeout, hang) and check what it left.

The stage gets everything it needs in its spec (`spec.json`, with this launch's record), its
output goes to the Prefect logger and `logs/stage.log`, its metrics to a progress artifact; the
timeout counts from when it runs, not while it is queued; on timeout, failure, hang (stacks
dumped first), cancel or any exception here the launch is stopped on every node. It is the only
way a stage process starts: the flow's `stage` task and `posttrain launch` (on every node of a
multi-node stage: node 0's supervisor holds the lock and looks, other nodes join its launch).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from pydantic import BaseModel

from flows.stage.failures import StageFailed, StageTimeout, failure_headline
from flows.stage.hang import StageHung, hang_message, hang_watch
from flows.stage.launch import (
    REUSE_ONLY,
    DevicesNeeded,
    launch_env,
    launch_info,
    launch_labels,
    local_env,
    node_rank,
)
from flows.stage.launchers import launcher_for
from flows.stage.launchers.base import Launch, Launcher, LaunchError, LaunchRequest
from flows.stage.launchers.records import record_launch, stop_earlier_launch
from flows.stage.output import MetricsTail, OutputPump, ProgressArtifact, run_logger
from flows.stage.procs import KILL_GRACE_S
from posttrain.runtime.orphan import SupervisorBeat
from posttrain.runtime.recovery import ERROR_FILE, earlier_attempt
from posttrain.runtime.spec import PlannedStage, StageSpec, spec_path
from posttrain.store.artifacts import ArtifactRef
from posttrain.store.locking import ArtifactLock, LockTimeout, describe_holder, lock_path
from posttrain.store.status import Status, find_reusable, status
from posttrain.store.summary import ArtifactDamaged, Summary, read_summary
from posttrain.telemetry.heartbeat import Hang, HangWatch

# How often the supervisor looks at the launch, its heartbeats and its timeout. A local child's
# exit is seen at once (`Launch.wait`).
POLL_S = 0.5


class Outcome(BaseModel):
    """A stage that ran or was reused: its artifact and its summary, read here, once."""

    status: Literal["ran", "reused"]
    ref: ArtifactRef
    summary: Summary

    @classmethod
    def of(cls, stage: PlannedStage, status: Literal["ran", "reused"], ref: ArtifactRef) -> Outcome:
        """`ref` with its summary; a summary that does not read fails the stage."""
        try:
            return cls(status=status, ref=ref, summary=read_summary(ref.path))
        except ArtifactDamaged as exc:
            raise StageFailed(f"stage '{stage.name}': {exc}") from None


def supervise_stage(
    stage: PlannedStage, spec: StageSpec, kill_grace_s: float = KILL_GRACE_S
) -> Outcome:
    """Run one planned stage to completion, or reuse its artifact. The folder's lock is held
    from the one look to the completion check: a second run of the same stage waits for the
    first (within the stage's timeout), then reuses what it made."""
    log = run_logger()
    if node_rank() != 0:
        return _join(stage, spec, kill_grace_s)
    lock = ArtifactLock(stage.out_dir)

    def waiting(holder: dict[str, Any] | None) -> None:
        who = f"{describe_holder(holder)} holds {lock.path}"
        log.info(
            "stage %s: waiting for another run of the same stage to finish (%s)", stage.name, who
        )

    try:
        waited = lock.acquire(
            {"what": f"stage {stage.name} supervisor"}, on_wait=waiting, timeout_s=stage.timeout_s
        )
    except LockTimeout as exc:
        raise StageTimeout(f"stage '{stage.name}' was not started: {exc}") from None
    try:
        outcome = _under_lock(stage, spec, str(lock.path), kill_grace_s)
    finally:
        lock.release()
    if waited:
        log.info("stage %s: the other run is done; this one %s", stage.name, outcome.status)
    return outcome


def _join(stage: PlannedStage, spec: StageSpec, kill_grace_s: float) -> Outcome:
    """Another node's agent joins node 0's launch, whose supervisor holds the lock (perhaps on
    a file system this node does not share) and looks. The folder is shared: a read-only look
    says whether node 0 found the stage complete (an agent would wait for it in vain)."""
    if (ref := status(stage.out_dir, stage.fingerprint, hashes=True).ref) is not None:
        run_logger().info("stage %s: complete artifact found in %s", stage.name, stage.out_dir)
        return Outcome.of(stage, "reused", ref)
    return _launch(stage, spec, _engine(stage), str(lock_path(stage.out_dir)), kill_grace_s)


def _engine(stage: PlannedStage) -> Launcher | LaunchError:
    """The launcher that runs `stage`, or why it cannot be made (a client not installed)."""
    try:
        return launcher_for(stage)
    except LaunchError as exc:
        return exc


def _under_lock(stage: PlannedStage, spec: StageSpec, lock: str, kill_grace_s: float) -> Outcome:
    """Holding the lock: stop a job a dead flow left behind, look once, launch if not done."""
    log = run_logger()
    engine = _engine(stage)
    # A flow that died may have left its remote job running. It holds no lock now (we do), so
    # it is stopped before the look (it may have sealed the artifact meanwhile) and before a
    # new launch writes the same folder; the new one resumes.
    if not isinstance(engine, LaunchError):
        stop_earlier_launch(engine, stage, kill_grace_s, log)
    if (ref := find_reusable(stage.out_dir, stage.fingerprint, log)) is not None:
        log.info("stage %s: complete artifact found in %s, reusing it", stage.name, stage.out_dir)
        return Outcome.of(stage, "reused", ref)
    if REUSE_ONLY.get():
        raise DevicesNeeded(f"stage {stage.name} has no complete artifact in {stage.out_dir}")
    return _launch(stage, spec, engine, lock, kill_grace_s)


def _launch(
    stage: PlannedStage,
    spec: StageSpec,
    engine: Launcher | LaunchError,
    lock: str,
    kill_grace_s: float,
) -> Outcome:
    """Write this launch's spec (naming the `lock` node 0's supervisor holds), start the stage
    through `engine` and follow it to its end."""
    if isinstance(engine, LaunchError):
        raise StageFailed(f"stage '{stage.name}' could not be started: {engine}") from None
    log = run_logger()
    # Before this launch writes its own traces (launch line, heartbeats) over the old ones;
    # node 0's account (another node starts when node 0's may have begun).
    earlier = earlier_attempt(stage.out_dir) if node_rank() == 0 else None
    if earlier:
        log.warning("stage %s: %s", stage.name, earlier)
    launch = launch_info(stage, uuid.uuid4().hex, lock, earlier)
    spec = spec.model_copy(update={"launch": launch})
    if stage.launcher == "local":
        env = local_env(launch, visible_devices=stage.visible_devices)
    else:  # an engine's nodes get only what the launch needs, not this machine's environment
        env = launch_env(launch)
    rank = node_rank()  # each node started by hand has its own supervisor, and log
    log_path = stage.out_dir / "logs" / ("stage.log" if rank == 0 else f"stage-node{rank}.log")
    request = LaunchRequest(
        stage=stage,
        spec_path=spec.write(spec_path(stage.out_dir, rank)),
        launch_id=launch.id,
        env=env,
        log_dir=log_path.parent,
        labels=launch_labels(),
    )
    watch = hang_watch(stage, every_rank=engine.name != "local")
    with open(log_path, "a", encoding="utf-8") as log_file, SupervisorBeat.of(launch):
        try:
            started = engine.start(request, log)
        except LaunchError as exc:
            raise StageFailed(f"stage '{stage.name}' could not be started: {exc}") from None
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        log_file.write(f"=== {now} launch {launch.id}: {started.description}\n")
        log_file.flush()
        log.info("stage %s: %s", stage.name, started.description)
        record_launch(engine, started, request)
        return _follow(stage, started, watch, log_file, log_path, kill_grace_s)


def _completed_ref(stage: PlannedStage, artifact_json: str | None) -> ArtifactRef:
    """What a launch that exited 0 sealed: reusable (every byte checked), the planned
    fingerprint, the artifact its POSTTRAIN_ARTIFACT line names."""
    look = _sealed(stage)
    if look.ref is None:
        raise StageFailed(
            f"stage '{stage.name}' exited 0 but its artifact is incomplete: {look.why}"
        )
    said = ArtifactRef.model_validate_json(artifact_json) if artifact_json else look.ref
    if said.fingerprint != look.ref.fingerprint:
        raise StageFailed(
            f"stage '{stage.name}' wrote fingerprint {said.fingerprint}, expected {stage.fingerprint}"
        )
    return look.ref


def _sealed(stage: PlannedStage) -> Status:
    """The artifact's status after its launch exited 0. Another node's agent ends when its
    ranks pass the last barrier, maybe before node 0's rank 0 has sealed (hashing every file):
    it waits for the manifest as long as the hang watch lets a silent stage be."""
    deadline = time.monotonic() + (stage.hang_timeout_s or stage.timeout_s)
    look = status(stage.out_dir, stage.fingerprint, hashes=True)
    while node_rank() != 0 and look.state == "unsealed" and time.monotonic() < deadline:
        time.sleep(POLL_S)
        look = status(stage.out_dir, stage.fingerprint, hashes=True)
    return look


def _follow(
    stage: PlannedStage,
    launch: Launch,
    watch: HangWatch | None,
    log_file: TextIO,
    log_path: Path,
    kill_grace_s: float,
) -> Outcome:
    """Stream a launch's output, wait for its end, timeout or hang, stop what is left of it,
    and check what it made."""
    log = run_logger()
    progress = ProgressArtifact(stage.name)
    pump = OutputPump(launch.output(), log_file, log, stage.name)
    metrics = MetricsTail(stage.out_dir / "metrics.jsonl", progress.update, stage=stage.name)
    try:
        waited = _wait(launch, stage, watch, log)
    finally:
        # Runs on success too: ranks or helpers the stage left behind must not outlive it.
        # On an exception here (KeyboardInterrupt, Prefect's TerminationSignal on cancel)
        # this is what stops the stage, on every node.
        launch.stop(kill_grace_s, log)
        pump.join(timeout=10)
        metrics.stop()

    tail = pump.tail_text()
    if (hang := waited.hang) is not None:
        raise StageHung(
            hang_message(stage, hang, waited.stacks, log_path, tail), hang, waited.stacks
        )
    if waited.timeout == "queue":
        raise StageTimeout(
            f"stage '{stage.name}' waited {stage.infra['queue_timeout_s']:g} s without starting "
            f"({launch.description}: {waited.waiting or 'queued'}) and was cancelled "
            "(infra.queue_timeout_s)"
        )
    if waited.timeout == "run":
        raise StageTimeout(
            f"stage '{stage.name}' timed out after {stage.timeout_s:g} s "
            f"(infra.timeouts.{stage.name}) and was stopped ({launch.description}). "
            f"Log: {log_path}\n--- end of the log ---\n{tail}"
        )
    rc = launch.poll()
    assert rc is not None  # stop() returned: it has ended
    if rc != 0:
        engine = launch.engine_reason()
        if engine:
            # For the next run's account of this attempt (posttrain.runtime.recovery reads the
            # last line).
            with contextlib.suppress(OSError), open(stage.out_dir / ERROR_FILE, "a") as f:
                f.write(f"ended by {engine}\n")
        headline = failure_headline(stage, rc, list(pump.recent), engine)
        raise StageFailed(f"{headline}. Log: {log_path}\n--- end of the log ---\n{tail}")
    ref = _completed_ref(stage, pump.artifact_json)
    progress.update(100.0, "done")
    return Outcome.of(stage, "ran", ref)


@dataclass
class Waited:
    """How `_wait` ended: a timeout ("run" or "queue"), a hang, or the launch's end (neither)."""

    timeout: str | None = None
    hang: Hang | None = None
    stacks: list[Path] = field(default_factory=list)
    waiting: str | None = None  # the engine's last reason for queueing it


def _wait(
    launch: Launch,
    stage: PlannedStage,
    watch: HangWatch | None,
    log: logging.LoggerAdapter | logging.Logger,
) -> Waited:
    """Wait for the launch to end, a timeout to pass, or its ranks to hang (stacks dumped);
    kills nothing. Time queued is not the stage's: it has its own limit, queue_timeout_s."""
    start = time.monotonic()
    queue_limit = stage.infra.get("queue_timeout_s")
    deadline: float | None = None
    waiting: str | None = None
    while launch.wait(POLL_S) is None:
        if deadline is None:
            if launch.started():
                deadline = time.monotonic() + stage.timeout_s
                if waiting is not None:
                    log.info("stage %s: %s is running", stage.name, launch.description)
            elif (reason := launch.waiting_reason()) != waiting and reason:
                log.info("stage %s: %s waits: %s", stage.name, launch.description, reason)
                waiting = reason
            elif queue_limit is not None and time.monotonic() - start > queue_limit:
                log.error("stage %s: still queued after %.0f s", stage.name, queue_limit)
                return Waited("queue", waiting=waiting)
        elif time.monotonic() > deadline:
            log.error("stage %s: timeout after %.0f s", stage.name, stage.timeout_s)
            return Waited("run")
        if watch is not None and (hang := watch.poll()) is not None:
            silent = f"no heartbeat for {hang.limit_s:.0f} s ({hang.describe()})"
            log.error("stage %s: %s; dumping stacks", stage.name, silent)
            return Waited(hang=hang, stacks=launch.dump_stacks(hang, stage.out_dir))
    return Waited()
