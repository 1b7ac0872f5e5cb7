"""Kill at a random moment, re-run, repeat: the pipeline still ends bit-identical.

The tiny quickstart (ingest -> sft -> reward -> dpo -> evaluate -> export, every training stage
checkpointing every 3 steps) runs once uninterrupted. Then, in a second workspace, a seeded
loop starts `posttrain run` on the embedded Prefect (the default), waits a random time and
SIGKILLs it — either the CLI alone (an OOM kill: its stage and embedded server must go by
themselves) or every process of the run at once (a power cut) — and starts it again. The last
run goes to the end. Its export must equal the uninterrupted run's byte for byte, and no
process of any run may be left.

Every process a run starts inherits its PREFECT_HOME, which is private to this test: that is
how the test finds them all, whatever session or parent they ended up with.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.stage_helpers import ROOT, TINY, write_recipe

pytestmark = pytest.mark.slow

SEED = 1212
KILLS = 4
# Optimizer steps of each training stage, checkpointed every 3.
STEPS = {"sft": 24, "reward": 12, "dpo": 12}
EVERY = 3
RUN_TIMEOUT_S = 600

PAIRS = {
    "synthetic": {"n_examples": 96},
    "eval_fraction": 0.25,
    "max_seq_len": 64,
    "max_prompt_len": 40,
}
TRAIN = {"batch": {"micro_batch_size": 8, "grad_accum_steps": 1}, "checkpoint_every": EVERY}


def _recipe(folder: Path) -> Path:
    data = copy.deepcopy(TINY)
    data["run"]["name"] = "killloop"
    data["infra"]["threads_per_rank"] = 1  # deterministic and fair on a busy 2-core box
    data["ingest"]["from_config"]["pretrain_steps"] = 20
    data["sft"].update(max_steps=STEPS["sft"], checkpoint_every=EVERY)
    data["reward"] = {"data": PAIRS, "max_steps": STEPS["reward"], "min_accuracy": 0.0, **TRAIN}
    data["dpo"] = {"data": PAIRS, "max_steps": STEPS["dpo"], **TRAIN}
    data["evaluate"].update(max_eval_rows=8, num_prompts=1, win_rate_prompts=4)
    return write_recipe(folder, data)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTEST"))}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
    )
    return env


def _ours(home: Path) -> list[psutil.Process]:
    """Every live process carrying this test's PREFECT_HOME (CLI, server, stages, ranks)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("PREFECT_HOME") == str(home) and p.status() != "zombie":
                found.append(p)
        except psutil.Error:
            continue
    return found


def _start(recipe: Path, home: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(recipe)],
            cwd=ROOT,
            env=_env(home),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _export_files(ws: Path) -> dict[str, str]:
    """sha256 of every file of the exported model. The model card names the base's folder,
    which is in this workspace, and quotes the measured decode speed: it is compared without
    either."""
    (model,) = (ws / "artifacts" / "export").glob("*/model")
    out = {}
    for p in sorted(model.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "README.md":
                # measured speeds are no property of the model; every other line must match
                lines = data.replace(str(ws).encode(), b"<workspace>").splitlines()
                data = b"\n".join(line for line in lines if b"tok/s" not in line)
            out[str(p.relative_to(model))] = hashlib.sha256(data).hexdigest()
    return out


def _wait_gone(home: Path, limit_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + limit_s
    while (left := _ours(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _checkpointed(ws: Path, stage: str) -> int:
    """The newest complete checkpoint `stage` wrote in this workspace (0 before its first):
    a kill after it has something to resume from. (Its steps take milliseconds here, so
    waiting for a logged step and then a random while would mostly land after the stage.)"""
    done = [
        int(p.name.removeprefix("step_"))
        for p in (ws / "artifacts" / stage).glob("*/checkpoints/step_*")
        if not p.name.endswith(".tmp")
    ]
    return max(done, default=0)


def _kill_moments(rng: random.Random) -> list[tuple[str, int | float]]:
    """One kill at a random time (Prefect start-up, ingest, any stage), then kills right after
    random checkpoints of the training stages that leave steps to do, in pipeline order so
    every re-run gets further."""
    steps = [(stage, step) for stage, n in STEPS.items() for step in range(EVERY, n, EVERY)]
    picked = sorted(rng.sample(range(len(steps)), KILLS - 1))
    return [("time", rng.uniform(3.0, 20.0)), *(steps[i] for i in picked)]


def test_killed_at_random_moments_the_pipeline_ends_bit_identical(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    home = tmp_path / "prefect-home"
    home.mkdir()

    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    ref = _start(_recipe(ref_dir), home, tmp_path / "reference.log")
    assert ref.wait(RUN_TIMEOUT_S) == 0, (tmp_path / "reference.log").read_text()[-4000:]
    expected = _export_files(ref_dir / "ws")
    assert "model.safetensors" in expected

    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    recipe, ws = _recipe(run_dir), run_dir / "ws"
    log = tmp_path / "killed.log"
    events = []
    for i, (where, when) in enumerate(_kill_moments(rng)):
        everything = rng.random() < 0.5
        what = f"attempt {i}: SIGKILL {'every process' if everything else 'the CLI'}"
        what += f" at {when:.1f} s" if where == "time" else f" after {where} checkpoint {when}"
        with open(log, "a") as f:
            f.write(f"\n=== {what}\n")
        proc, t0 = _start(recipe, home, log), time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < RUN_TIMEOUT_S:
            if where == "time" and time.monotonic() - t0 >= when:
                break
            if where != "time" and _checkpointed(ws, where) >= when:
                time.sleep(rng.uniform(0.0, 0.02))  # mid-step, mid-next-checkpoint, ...
                break
            time.sleep(0.01)
        if proc.poll() is not None:
            events.append(f"{what}: the run had ended (rc {proc.returncode})")
            continue
        victims = [proc.pid]
        if everything:
            victims += [p.pid for p in _ours(home) if p.pid != proc.pid]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        # What the CLI left (its stage, the embedded server) must stop by itself, quickly.
        left = _wait_gone(home, 60)
        assert not left, f"{what}: still running 60 s after the kill: {left}"
        events.append(what)

    final = _start(recipe, home, log)
    rc = final.wait(RUN_TIMEOUT_S)
    text = log.read_text()
    assert rc == 0, "\n".join(events) + "\n" + text[-6000:]
    # The stages' own lines (the resume included) are in their logs, which every attempt appends
    # to, not on the CLI's terminal (flows.terminal).
    stage_logs = "".join(
        p.read_text(errors="replace") for p in ws.glob("artifacts/*/*/logs/stage.log")
    )
    assert "resumed from step_" in stage_logs, "no kill landed mid-training: " + "\n".join(events)
    got = _export_files(ws)
    assert got == expected, "\n".join(events)
    assert not _wait_gone(home, 30)
    print("\n".join(events))
