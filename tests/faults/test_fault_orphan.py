"""A dead orchestrator: `posttrain run` SIGKILLed (the OOM killer, a lost pod) while a real SFT
stage trains. Per `infra.orphan`:
  - stop: the stage process stops itself within ORPHAN_BOUND_S, leaving complete checkpoints
    and no manifest; the next run resumes from the newest checkpoint;
  - finish: the stage trains to the end and seals its artifact (taking the artifact lock over
    from its dead launcher); the next run reuses it.
Real stages on the tiny recipe, real CLI processes on the embedded Prefect; the ingest, which
no test here interrupts, is built once (tests/stage_helpers.run_shared) and reused by the runs.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from posttrain.store.artifacts import verify
from posttrain.train.checkpoint import complete_checkpoints
from tests.faults.fault_runs import (
    Run,
    alive,
    kill_all,
    run_env,
    stop_runs,
    wait_file,
    wait_gone,
    write_slow_stage,
)
from tests.stage_helpers import TINY, planned_dir, run_shared, write_recipe

pytestmark = pytest.mark.slow

ORPHAN_BOUND_S = 15.0  # measured: see docs/reliability.md, "Faults"
FINISH_BOUND_S = 240.0
# The stop case's orphan ends within about 1 s (10-20 steps) of its kill, the finish case's run
# is killed within ~0.5 s of its resume: 40-60 steps (~3 s) are left for its orphan to train.
# Every step more is CPU the orphan spends while the test waits for it to seal.
FINISH_MAX_STEPS = 80


def _recipe(folder: Path, max_steps: int, shared_parents: Path) -> Path:
    """The tiny recipe, its ingest already complete in the workspace."""
    data = {**TINY, "run": {**TINY["run"], "name": "fault-orphan"}}
    data["ingest"] = {
        **TINY["ingest"],
        "from_config": {**TINY["ingest"]["from_config"], "pretrain_steps": 5},
    }
    data["sft"] = {**TINY["sft"], "max_steps": max_steps, "checkpoint_every": 10}
    recipe = write_recipe(folder, data)
    run_shared("ingest", recipe, shared_parents)
    return recipe


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("fault-orphan-prefect")


def _stage_procs(run: Run, stage: str) -> list[psutil.Process]:
    found = []
    for p in run.descendants():
        try:
            if f"posttrain.stages.{stage}" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _wait_text(path: Path, needle: str, run: Run, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and needle in path.read_text(errors="replace")):
        assert run.proc.poll() is None or time.monotonic() < deadline, run.text()[-6000:]
        assert time.monotonic() < deadline, f"no {needle!r} in {path} within {timeout} s"
        time.sleep(0.2)


def _kill_mid_stage(run: Run, sft_dir: Path) -> tuple[list[psutil.Process], float]:
    """Wait for the first complete checkpoint of sft, then SIGKILL the CLI; returns the stage
    processes found before the kill and the time of the kill."""
    deadline = time.monotonic() + 300
    while not complete_checkpoints(sft_dir / "checkpoints"):
        assert run.proc.poll() is None, run.text()[-6000:]
        assert time.monotonic() < deadline, "no sft checkpoint within 300 s"
        time.sleep(0.2)
    procs = _stage_procs(run, "sft")
    assert procs, run.text()[-3000:]
    run.embedded_server = run.server()  # type: ignore[attr-defined]
    t_kill = time.monotonic()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(timeout=10)
    return procs, t_kill


def _kill_resumed(run: Run, sft_dir: Path, kept: str) -> tuple[list[psutil.Process], float]:
    """Wait for run's sft stage to resume from checkpoint `kept`, then SIGKILL the CLI; returns
    the stage processes found before the kill and the time of the kill."""
    # The stage's own lines are in its log, not on the CLI's terminal (flows.terminal).
    run.wait_for("Task run 'sft'", timeout=300)
    _wait_text(sft_dir / "logs" / "stage.log", f"resumed from {kept}", run, 300)
    procs = _stage_procs(run, "sft")
    assert procs, run.text()[-3000:]
    t_kill = time.monotonic()
    run.proc.send_signal(signal.SIGKILL)
    run.proc.wait(timeout=10)
    return procs, t_kill


def test_orphan_stop_then_finish_on_one_stage(
    tmp_path: Path, home: Path, shared_parents: Path
) -> None:
    """One sft stage meets both policies (`infra.orphan` is outside the fingerprint): run A's
    orphan stops (the default), run B resumes the stage and is killed too, B's orphan (finish)
    seals the artifact, and run C reuses it. B is both the stop case's next run and the finish
    case's killed one: a CLI start, its server and stage, and ten steps fewer than a run each."""
    recipe = _recipe(tmp_path, FINISH_MAX_STEPS, shared_parents)
    sft_dir = planned_dir("sft", recipe)
    env = run_env(home, tmp_path / "locks")
    runs: list[Run] = []
    try:
        a = Run(recipe, env, log=tmp_path / "a.out")
        runs.append(a)
        procs, t_kill = _kill_mid_stage(a, sft_dir)
        detect = wait_gone(procs, ORPHAN_BOUND_S)
        print(f"\norphan (stop): stage process gone {detect:.1f} s after the CLI's SIGKILL")
        # The embedded Prefect server dies with its CLI, even one killed outright.
        assert a.embedded_server is not None
        wait_gone([a.embedded_server], 10)
        log = (sft_dir / "logs" / "stage.log").read_text()
        assert "its supervisor (pid" in log and "infra.orphan=stop: stopping now" in log
        assert not (sft_dir / "manifest.json").exists()
        kept = complete_checkpoints(sft_dir / "checkpoints")
        assert kept

        # The next run resumes; killed in turn, its orphan (finish) trains to the end.
        b = Run(recipe, env, "infra.orphan=finish", log=tmp_path / "b.out")
        runs.append(b)
        procs, t_kill = _kill_resumed(b, sft_dir, kept[-1].name)
        # The next run starts at once: it must wait for the orphan (it holds the lock now).
        # Up to sft: what it reuses is the check, a stage after it would start for nothing.
        until = ("run", "--until", "sft")
        c = Run(recipe, env, "infra.orphan=finish", log=tmp_path / "c.out", command=until)
        runs.append(c)
        wait_gone(procs, FINISH_BOUND_S)
        print(f"\norphan (finish): stage done {time.monotonic() - t_kill:.1f} s after the kill")
        ok, why = verify(sft_dir)
        assert ok, why
        log = (sft_dir / "logs" / "stage.log").read_text()
        assert "infra.orphan=finish: finishing the stage" in log
        c.wait_for("stage sft: complete artifact found", timeout=300)
        assert not any(alive(p) for p in procs)
        rc, out = c.finish(timeout=120)
        assert rc == 0, out[-3000:]
    finally:
        stop_runs(runs)


def test_orphan_stop_under_torchrun_stops_every_rank_and_the_agent(tmp_path: Path) -> None:
    """`posttrain launch` (no Prefect) runs a 2-rank stand-in stage under torchrun; SIGKILL the
    launcher: both ranks and the torchrun agent must be gone within the bound."""
    mods = tmp_path / "mods"
    module = write_slow_stage(mods, "ingest")
    pids = tmp_path / "rank.pid"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "run": {"name": "fault-torchrun", "workspace": str(tmp_path / "ws")},
                "infra": {"device": "cpu", "precision": "fp32", "devices_per_node": 2},
                "ingest": {"source": "from_config"},
                "sft": {"data": {"synthetic": {"n_examples": 20}}},
            }
        )
    )
    env = run_env(
        tmp_path / "home",
        tmp_path / "locks",
        mods,
        PT_STAGE_MODULES=f"ingest={module}",
        PT_STAGE_DISTRIBUTED="1",
        PT_PIDS_FILE=str(pids),
    )
    launcher = Run(recipe, env, command=("launch", "ingest"), log=tmp_path / "launch.out")
    try:
        for rank in (0, 1):
            wait_file(Path(f"{pids}{rank}"), timeout=120, run=launcher)
        procs = launcher.descendants()  # the torchrun agent and its two ranks
        assert len(procs) >= 3, [p.cmdline() for p in procs]
        t_kill = time.monotonic()
        launcher.proc.send_signal(signal.SIGKILL)
        launcher.proc.wait(timeout=10)
        wait_gone(procs, ORPHAN_BOUND_S)
        print(f"\norphan (stop, torchrun): agent and ranks gone {time.monotonic() - t_kill:.1f} s")
    finally:
        launcher.stop()
        kill_all(launcher.descendants())
