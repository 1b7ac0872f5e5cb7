"""Real `posttrain run` processes for the fault tests: start one, watch its output, find its
processes (the embedded Prefect server, the stage processes), signal it, time what follows.

Every run gets the same private PREFECT_HOME within a test module (seeded with a database
migrated once per session: prefect_server.seed_home), a private device-lock directory, and a
workspace of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from prefect_server import seed_home

ROOT = Path(__file__).resolve().parents[2]

# `python -m flows.cli` with the stage registry pointed at stand-in modules (PT_STAGE_MODULES:
# "ingest=pt_slow_ingest,..."), so a stage can be made slow without torch; everything else is
# the real CLI in a real process. Without PT_STAGE_MODULES it is exactly `python -m flows.cli`.
CLI_WRAPPER = """
import dataclasses, os, sys
import posttrain.plan.planner as pipeline
mods = dict(kv.split("=") for kv in os.environ.get("PT_STAGE_MODULES", "").split(",") if kv)
ranks = os.environ.get("PT_STAGE_DISTRIBUTED") == "1"  # several processes under torchrun
pipeline.KINDS = {
    name: dataclasses.replace(s, module=mods[name], distributed=ranks) if name in mods else s
    for name, s in pipeline.KINDS.items()
}
from flows.cli import main
sys.exit(main(sys.argv[1:]))
"""

# A stage that beats and sleeps for $PT_SLOW_S seconds, writing "<pid>" to $PT_PIDS_FILE
# (suffixed with the local rank under torchrun) once it runs.
SLOW_STAGE = """
import os
import time
from pathlib import Path

from posttrain.stages.common import stage_main
from posttrain.telemetry import heartbeat


def run(ctx):
    path = Path(os.environ["PT_PIDS_FILE"] + os.environ.get("LOCAL_RANK", ""))
    path.with_suffix(".tmp").write_text(str(os.getpid()))
    path.with_suffix(".tmp").rename(path)
    for step in range(int(float(os.environ.get("PT_SLOW_S", "600")))):
        heartbeat.beat(step=step, phase="train")
        time.sleep(1)
    return {{"headline": {{"steps": step}}}}


if __name__ == "__main__":
    stage_main(run, kind={stage!r})
"""


def write_slow_stage(folder: Path, stage: str = "ingest") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"pt_slow_{stage}.py").write_text(SLOW_STAGE.format(stage=stage))
    return f"pt_slow_{stage}"


def run_env(home: Path, lock_dir: Path, extra_path: Path | None = None, **extra: str) -> dict:
    env = dict(os.environ)
    for k in ("PREFECT_API_URL", "PREFECT_PROFILES_PATH"):
        env.pop(k, None)
    paths = [str(ROOT), *([str(extra_path)] if extra_path else []), env.get("PYTHONPATH", "")]
    env.update(
        PREFECT_HOME=str(seed_home(home)),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        POSTTRAIN_DEVICE_LOCK_DIR=str(lock_dir),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        **extra,
    )
    return env


class Run:
    """One `posttrain run` process (or another `command`, e.g. ("launch", "ingest")); its
    merged output is collected line by line."""

    def __init__(
        self,
        recipe: Path,
        env: dict,
        *overrides: str,
        log: Path | None = None,
        command: tuple[str, ...] = ("run",),
    ):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLI_WRAPPER, *command, str(recipe), *overrides],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,  # a SIGHUP/SIGINT meant for it reaches only it
        )
        self.lines: list[tuple[float, str]] = []
        self.log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            if self.log is not None:
                with open(self.log, "a") as f:
                    f.write(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, needle: str, timeout: float = 240) -> float:
        """Monotonic time of the first output line containing `needle`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if needle in line:
                    return t
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                for t, line in list(self.lines):
                    if needle in line:
                        return t
                raise AssertionError(
                    f"run exited {self.proc.returncode} before {needle!r}:\n{self.text()[-6000:]}"
                )
            time.sleep(0.1)
        raise AssertionError(f"no {needle!r} within {timeout} s:\n{self.text()[-6000:]}")

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        """Wait for the run to end; its exit code and whole output. Stopped past `timeout`."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        self._reader.join(timeout=10)
        return rc, self.text() + "\n"

    def server(self) -> psutil.Process | None:
        """The embedded Prefect server (a uvicorn child of this run)."""
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "uvicorn" in " ".join(p.cmdline()):
                        return p
        return None

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.pid).children(recursive=True)
        return []

    def stop(self, grace: float = 20) -> None:
        """End the run and everything it started (the test's own cleanup)."""
        procs = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        kill_all(procs)
        self._reader.join(timeout=5)


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: list[psutil.Process], timeout: float) -> float:
    """Seconds until every process in `procs` is gone; AssertionError after `timeout`."""
    t0 = time.monotonic()
    while any(alive(p) for p in procs):
        if time.monotonic() - t0 > timeout:
            left = [(p.pid, p.cmdline()) for p in procs if alive(p)]
            raise AssertionError(f"still alive after {timeout} s: {left}")
        time.sleep(0.1)
    return time.monotonic() - t0


def kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if alive(p):
                p.kill()


def stop_runs(runs: list[Run]) -> None:
    """Stop each run, then kill whatever any of them left behind (a test's `finally`)."""
    for run in runs:
        run.stop()
    kill_all([p for r in runs for p in r.descendants()])


def wait_file(path: Path, timeout: float = 240, run: Run | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"run exited {run.proc.returncode}:\n{run.text()[-6000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not written within {timeout} s")
        time.sleep(0.1)
