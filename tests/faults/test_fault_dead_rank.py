"""A dead rank: SIGKILL one worker of a real 2-rank FSDP2 (gloo) SFT stage mid-training.

The supervisor must fail the stage within `infra.pg_timeout_s` plus a few seconds, name the rank,
its signal and its last heartbeat, leave no process of the launch behind, and a re-run must resume
from the last checkpoint. The rank is found, and killed, through its heartbeat file's pid.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import threading
import time
from typing import Any

import psutil
import pytest

from flows.stage.failures import StageFailed
from flows.stage.procs import tagged_processes
from flows.stage.task import stage_task
from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan, spec_for
from posttrain.runtime.spec import LAUNCH_TAG_ENV
from posttrain.store.artifacts import ref_from_manifest, verify
from posttrain.telemetry.heartbeat import read_heartbeats
from posttrain.train.checkpoint import complete_checkpoints
from tests.stage_helpers import TINY, run_inprocess, write_recipe

PG_TIMEOUT_S = 30
KILL_AT_STEP = 5


@pytest.fixture(scope="module")
def sft_stage(tmp_path_factory: pytest.TempPathFactory):
    data = copy.deepcopy(TINY)
    data["infra"].update(devices_per_node=2, threads_per_rank=1, pg_timeout_s=PG_TIMEOUT_S)
    # Trained only to be trained on: a few steps do. sft's steps after KILL_AT_STEP are margin
    # for the kill (the loop below sees the beat within a step or two) and the re-run's work.
    data["ingest"]["from_config"]["pretrain_steps"] = 5
    data["sft"].update(max_steps=15, checkpoint_every=3)
    data["sft"]["batch"]["micro_batch_size"] = 4
    path = write_recipe(tmp_path_factory.mktemp("deadrank"), data)
    run_inprocess("ingest", path)
    recipe = load_recipe(path)
    stages = {s.name: s for s in plan(recipe).stages}
    sft = stages["sft"]
    assert sft.nprocs == 2
    spec = spec_for(sft, recipe, {"ingest": ref_from_manifest(stages["ingest"].out_dir)})
    return sft, spec


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _launch_processes() -> dict[int, str]:
    """This test process's descendants that carry a launch tag: pid -> tag."""
    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if launch := p.environ().get(LAUNCH_TAG_ENV):
                found[p.pid] = launch
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_killed_rank_is_named_nothing_is_left_and_the_rerun_resumes(sft_stage) -> None:
    stage, spec = sft_stage
    result: dict[str, Any] = {}

    def supervise() -> None:
        try:
            result["outcome"] = stage_task.fn(stage, spec, kill_grace_s=5.0)
        except StageFailed as exc:
            result["error"] = exc
        result["ended"] = time.monotonic()

    runner = threading.Thread(target=supervise)
    runner.start()
    seen: dict[int, str] = {}
    killed_at = victim = None
    deadline = time.monotonic() + 300
    while runner.is_alive():
        assert time.monotonic() < deadline, "the stage neither trained nor failed"
        seen |= _launch_processes()
        beat = read_heartbeats(stage.out_dir).get(1)
        if (
            killed_at is None
            and beat
            and (beat.get("step") or 0) >= KILL_AT_STEP
            and complete_checkpoints(stage.out_dir / "checkpoints")
        ):
            victim = beat
            os.kill(beat["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
        time.sleep(0.05)
    runner.join()
    assert killed_at is not None, f"rank 1 never reached step {KILL_AT_STEP}: {result}"
    detect_s = result["ended"] - killed_at
    print(f"dead rank detected (kill -> StageFailed) in {detect_s:.2f} s")
    assert detect_s < PG_TIMEOUT_S + 5

    msg = str(result.get("error"))
    headline = msg.split("\n", 1)[0]
    pattern = (
        rf"stage 'sft' failed: rank 1 \(pid {victim['pid']}\) was killed by SIGKILL; "
        rf"its last heartbeat: step (\d+), phase (\w+), (\d+) s before\."
    )
    print(headline)
    m = re.match(pattern, headline)
    assert m, headline
    assert int(m.group(1)) >= victim["step"] and int(m.group(3)) <= detect_s + 2
    assert "Signal 9 (SIGKILL) received by PID" in msg  # torchrun's summary is in the tail

    # Nothing of the launch is left: torchrun's agent and the surviving rank are gone.
    launches = set(seen.values())
    assert len(launches) == 1 and len(seen) >= 3, seen  # agent + 2 ranks
    end = time.monotonic() + 10
    while time.monotonic() < end and not all(_dead(p) for p in seen):
        time.sleep(0.1)
    assert [p for p in seen if not _dead(p)] == []
    tag = launches.pop()
    assert tagged_processes(lambda t: t == tag) == []

    # The re-run resumes from the newest checkpoint and completes.
    newest = complete_checkpoints(stage.out_dir / "checkpoints")[-1].name
    outcome = stage_task.fn(stage, spec, kill_grace_s=5.0)
    assert outcome.status == "ran"
    assert verify(stage.out_dir)[0]
    log = (stage.out_dir / "logs" / "stage.log").read_text()
    assert f"resumed from {newest}" in log
