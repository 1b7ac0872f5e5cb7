"""Tiny stage modules for supervisor and flow tests, written into a temp folder on PYTHONPATH.

They run through the real `posttrain.stages.common.stage_main` harness, so the supervisor is
tested against the same spec/manifest/exit-code contract as the real stages; the hanging one,
which no test lets finish, only hangs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

OK = """
import json
import os
import sys
import time

from posttrain.stages.common import stage_main

STAGE = {stage!r}


def run(ctx):
    started = time.time()
    # PT_OK_SLEEP_STAGES: which stages sleep (all when unset), so a test of two stages side by
    # side makes only those two last.
    sleepers = os.environ.get("PT_OK_SLEEP_STAGES")
    if sleepers is None or STAGE in sleepers.split(","):
        time.sleep(float(os.environ.get("PT_OK_SLEEP_S", "0")))
    with open(ctx.stage.out_dir / "metrics.jsonl", "a") as f:
        for step in range(1, 4):
            rec = {{"kind": "train", "step": step, "total_steps": 3, "loss": 2.0 / step,
                   "tokens_per_s": 1000.0, "mfu": 0.5}}
            f.write(json.dumps(rec) + "\\n")
    # Content depends on the inputs and parents, as a real stage's output would.
    (ctx.stage.out_dir / "result.json").write_text(json.dumps(
        {{"inputs": ctx.stage.inputs, "parents": sorted(p.fingerprint for p in ctx.parents.values())}}
    ))
    # When it ran (outside the manifest's hashed files: logs/), for tests of stages side by side.
    (ctx.stage.out_dir / "logs" / "span.json").write_text(json.dumps([started, time.time()]))
    if STAGE == "export":
        (ctx.stage.out_dir / "model").mkdir(exist_ok=True)
        (ctx.stage.out_dir / "model" / "weights.txt").write_text("merged")
    print(f"hello from {{STAGE}}", flush=True)
    return {{"headline": {{"loss": 0.667, "steps": 3}}, "parents": len(ctx.parents)}}


if __name__ == "__main__":
    stage_main(run, kind=STAGE)
"""

FAIL = """
from posttrain.stages.common import stage_main


def run(ctx):
    for i in range(40):
        print(f"progress line {{i}}", flush=True)
    raise ValueError("boom: the stage broke on purpose")


if __name__ == "__main__":
    stage_main(run, kind={stage!r})
"""

# Ignores SIGTERM (so the supervisor must escalate to SIGKILL) and leaves two grandchildren that
# inherit the ignored SIGTERM: one in its process group, one in a session of its own (as
# torchrun's ranks are). Its parent's PID, its own and theirs go to $PT_PIDS_FILE (suffixed with
# the global rank under torchrun) once they exist. It does so first thing, outside the stage
# harness: the tests of what stops a launch read only its process tree, and a process up in
# 0.2 s instead of 9 s (3.4 CPU-s of the harness's imports and host probes, at load 6) lets them
# wait less for it, torchrun's ranks included.
HANG = """
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _sleeper(new_session):
    cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
    return subprocess.Popen(cmd, start_new_session=new_session)


def hang():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kids = [_sleeper(False), _sleeper(True)]
    pids = [os.getppid(), os.getpid(), *(k.pid for k in kids)]
    path = Path(os.environ["PT_PIDS_FILE"] + os.environ.get("RANK", ""))
    path.with_suffix(".tmp").write_text(" ".join(map(str, pids)))
    path.with_suffix(".tmp").rename(path)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    hang()
"""


def on_child_path(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put `folder` first on PYTHONPATH for the rest of the test: the supervisor passes its
    environment on, so a stage child started from it imports the modules written there."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    )
    return folder


def write_stage_modules(folder: Path, stages: tuple[str, ...] = ("ingest",)) -> None:
    """Write `pt_ok_<stage>`, `pt_fail_<stage>` and `pt_hang_<stage>` modules into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        for kind, template in (("ok", OK), ("fail", FAIL), ("hang", HANG)):
            (folder / f"pt_{kind}_{stage}.py").write_text(template.format(stage=stage))


# A 2-rank stage whose rank 1 stops beating at step STUCK_AT: it passes that step's collective,
# then blocks in `wait_for_nothing_forever` before its beat, so its last beat is step
# STUCK_AT - 1, while rank 0 beats STUCK_AT and then waits in the next step's collective. Each
# rank writes "<parent pid> <pid>" to $PT_PIDS_FILE<rank> once it runs (the global rank: on
# two nodes both ranks are local rank 0, and their files share the workspace's folder).
STUCK = """
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from posttrain.stages.common import stage_main
from posttrain.telemetry import heartbeat

STUCK_AT = 3


def wait_for_nothing_forever():
    while True:
        time.sleep(0.5)


def run(ctx):
    path = Path(os.environ["PT_PIDS_FILE"] + os.environ.get("RANK", ""))
    path.with_suffix(".tmp").write_text(f"{{os.getppid()}} {{os.getpid()}}")
    path.with_suffix(".tmp").rename(path)
    heartbeat.beat(step=0, phase="train")
    for step in range(1, 1000):
        dist.all_reduce(torch.ones(1))  # every rank must reach it
        if ctx.rank == 1 and step == STUCK_AT:
            wait_for_nothing_forever()
        heartbeat.beat(step=step, phase="train")
        time.sleep(0.2)


if __name__ == "__main__":
    stage_main(run, kind={stage!r}, distributed=True)
"""

# A healthy but slow stage: a silent startup (phase "start") of $PT_STARTUP_S seconds, then beats
# every $PT_BEAT_S seconds for $PT_STEPS steps, then done.
SLOW_BEATS = """
import os
import time

from posttrain.stages.common import stage_main
from posttrain.telemetry import heartbeat


def run(ctx):
    time.sleep(float(os.environ["PT_STARTUP_S"]))
    for step in range(1, int(os.environ["PT_STEPS"]) + 1):
        time.sleep(float(os.environ["PT_BEAT_S"]))
        heartbeat.beat(step=step, phase="train")
    return {{"headline": {{"steps": step}}}}


if __name__ == "__main__":
    stage_main(run, kind={stage!r})
"""


def write_heartbeat_modules(folder: Path, stage: str = "sft") -> None:
    """Write `pt_stuck_<stage>` (2 ranks, rank 1 hangs) and `pt_slowbeats_<stage>`."""
    folder.mkdir(parents=True, exist_ok=True)
    for kind, template in (("stuck", STUCK), ("slowbeats", SLOW_BEATS)):
        (folder / f"pt_{kind}_{stage}.py").write_text(template.format(stage=stage))
