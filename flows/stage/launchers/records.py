"""`logs/launch.json`: which engine job a stage's newest launch is, so that a later run can
find it when the flow that submitted it died (a Slurm job or a Kubernetes Job outlives it)."""

from __future__ import annotations

import json
import time

from flows.stage.launchers.base import Launch, Launcher, LaunchRequest, Log
from posttrain.runtime.spec import PlannedStage
from posttrain.store.artifacts import atomic_write_text

RECORD = "launch.json"


def record_launch(launcher: Launcher, launch: Launch, request: LaunchRequest) -> None:
    record = {
        "launcher": launcher.name,
        "launch_id": request.launch_id,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "job": launch.record,
    }
    atomic_write_text(request.log_dir / RECORD, json.dumps(record, indent=2))


def stop_earlier_launch(launcher: Launcher, stage: PlannedStage, grace_s: float, log: Log) -> bool:
    """Stop the stage's previous launch if the engine still runs or queues it; returns whether
    there was one. Called under the artifact lock: a launch whose launcher held the lock would
    still hold it, so one still running now was left behind by a flow that died."""
    path = stage.out_dir / "logs" / RECORD
    try:
        record = json.loads(path.read_text())
        job = {str(k): str(v) for k, v in record["job"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # none, or unreadable: nothing we could find anyway
    if record.get("launcher") != launcher.name:
        return False
    earlier = launcher.find(job, log)
    if earlier is None:
        return False
    log.warning(
        "stage %s: %s from an earlier run (launch %s, started %s) is still %s, but the flow "
        "that followed it is gone: stopping it; this launch resumes from its newest checkpoint",
        stage.name,
        earlier.description,
        record.get("launch_id", "?"),
        record.get("started_at", "?"),
        "running" if earlier.started() else "queued",
    )
    earlier.stop(grace_s, log)
    return True
