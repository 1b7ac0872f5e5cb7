"""Supervising one stage launch: reuse a complete artifact, else start the stage process under
the artifact's lock, watch it (timeout, hang) and check what it left.

Supervision means:
  - reuse: a complete, unaltered artifact with the stage's fingerprint is returned, not rebuilt;
  - logs: the child's stdout+stderr go line by line to the Prefect run logger and to
    `<out_dir>/logs/stage.log` (appended; logs/ is outside the manifest) (`flows.stage_output`);
  - progress: `<out_dir>/metrics.jsonl` is tailed into a Prefect progress artifact (same);
  - limits: the stage timeout is enforced, and on timeout, failure, cancel or any exception in
    this process the stage's whole process tree is terminated (`flows.stage_procs`);
  - hangs: ranks whose heartbeats all stop get their stacks dumped, then the stage is killed
    (`flows.stage_hang`).
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.stage_failures import StageFailed, StageTimeout, failure_headline
from flows.stage_hang import StageHung, dump_stacks, hang_message, hang_watch
from flows.stage_launch import HELD_ARTIFACT_LOCK, child_env, node_rank, stage_command
from flows.stage_output import MetricsTail, OutputPump, ProgressArtifact, run_logger
from flows.stage_procs import KILL_GRACE_S, kill_stage
from posttrain.artifacts import MANIFEST, ArtifactRef, ref_from_manifest, verify
from posttrain.locking import ArtifactLock, LockTimeout, describe_holder
from posttrain.planner import PlannedStage
from posttrain.recovery import earlier_attempt
from posttrain.telemetry.heartbeat import Hang, HangWatch


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
    token = HELD_ARTIFACT_LOCK.set(str(lock.path))
    try:
        outcome = _supervise(stage, spec_path, kill_grace_s)
    finally:
        HELD_ARTIFACT_LOCK.reset(token)
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
    watch = hang_watch(stage)
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
        metrics = MetricsTail(stage.out_dir / "metrics.jsonl", progress.update, stage=stage.name)
        try:
            timed_out, hang, stacks = _wait(proc, stage, watch, launch_id, log)
        finally:
            # Runs on success too: ranks or helpers the stage left behind must not outlive it.
            # On an exception here (KeyboardInterrupt, Prefect's TerminationSignal on cancel)
            # this is what stops the stage.
            kill_stage(proc, launch_id, kill_grace_s, log)
            pump.join(timeout=10)
            metrics.stop()

    tail = pump.tail_text()
    if hang is not None:
        raise StageHung(hang_message(stage, hang, stacks, log_path, tail), hang, stacks)
    if timed_out:
        raise StageTimeout(
            f"stage '{stage.name}' timed out after {stage.timeout_s:g} s "
            f"(infra.timeouts.{stage.name}) and was killed with its process group. "
            f"Log: {log_path}\n--- end of the log ---\n{tail}"
        )
    rc = proc.returncode
    if rc != 0:
        headline = failure_headline(stage, rc, list(pump.recent))
        raise StageFailed(f"{headline}. Log: {log_path}\n--- end of the log ---\n{tail}")
    ref = _completed_ref(stage, pump.artifact_json)
    progress.update(100.0, "done")
    return Outcome("ran", ref)


def _wait(
    proc: subprocess.Popen[str],
    stage: PlannedStage,
    watch: HangWatch | None,
    launch_id: str,
    log: logging.LoggerAdapter | logging.Logger,
) -> tuple[bool, Hang | None, list[Path]]:
    """Wait for the stage process to exit, its timeout to pass, or its ranks to hang (their
    stacks are dumped then). Returns (timed out, the hang, the stack files); kills nothing."""
    deadline = time.monotonic() + stage.timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            log.error("stage %s: timeout after %.0f s", stage.name, stage.timeout_s)
            return True, None, []
        if watch is not None and (hang := watch.poll()) is not None:
            log.error(
                "stage %s: no heartbeat for %.0f s (%s); dumping stacks",
                stage.name,
                hang.limit_s,
                hang.describe(),
            )
            return False, hang, dump_stacks(proc, launch_id, hang, stage.out_dir)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
    return False, None, []
