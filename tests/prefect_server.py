"""A real `prefect server start` for tests: 127.0.0.1, a free port, its own PREFECT_HOME.

Started once per test session by the `prefect_server` fixture (conftest.py), health-checked
before use, and stopped by PID (SIGTERM to its process group, SIGKILL after a grace period), so
no server outlives the tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(home: Path, port: int) -> dict[str, str]:
    """The environment of the server and of every client process that talks to it."""
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_UI_URL=f"http://127.0.0.1:{port}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # Runs scheduled by the server, cancellations noticed by runners, automations fired by
        # events: each service polls; the defaults (10-60 s) would make the tests wait.
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_RUNNER_POLL_FREQUENCY="2",
        PREFECT_RESULTS_LOCAL_STORAGE_PATH=str(home / "results"),
    )
    env.pop("PREFECT_PROFILES_PATH", None)
    return env


_MIGRATED_DB: list[Path] = []


def seed_home(home: Path) -> Path:
    """`home` as a PREFECT_HOME whose database is already migrated: a copy of one database
    migrated once per test session. A fresh home costs the first server on it, embedded or
    real, ~20 s of migrations (a one-task flow: 33 s on a fresh home, 14 s on a copy, 2 busy
    cores); a copy keeps each test's database its own. Left alone when it has a database."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "prefect.db").exists():
        shutil.copyfile(_migrated_db(), home / "prefect.db")
    return home


def _migrated_db() -> Path:
    if not _MIGRATED_DB:
        folder = Path(tempfile.mkdtemp(prefix="posttrain-prefect-db-"))
        atexit.register(shutil.rmtree, folder, True)
        env = {k: v for k, v in server_env(folder, 0).items() if k != "PREFECT_API_URL"}
        subprocess.run(
            [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
            env=env,
            check=True,
            capture_output=True,
            timeout=STARTUP_TIMEOUT_S,
        )
        _MIGRATED_DB.append(folder / "prefect.db")
    return _MIGRATED_DB[0]


@dataclass
class PrefectServer:
    proc: subprocess.Popen[bytes]
    port: int
    home: Path
    env: dict[str, str]
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.env["PREFECT_API_URL"]

    @property
    def ui_url(self) -> str:
        return self.env["PREFECT_UI_URL"]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 40) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own group: uvicorn and service workers
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_server(home: Path, port: int | None = None, seed: bool = True) -> PrefectServer:
    """Start the server and wait until /api/health answers (~22 s on a fresh database here, so
    `home` is seeded with a migrated one unless `seed` is false: then the server migrates its
    own). `port` and `home` of a stopped server restart it: same URL, same database."""
    if seed:
        seed_home(home)
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = server_env(home, port)
    log_path = home / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    server = PrefectServer(proc, port, home, env, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"prefect server did not become healthy:\n{server.log_tail()}")
        time.sleep(0.5)
    return server


# --- `posttrain serve` and waiting, shared by the server and fault tests -------------------------


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 1.0) -> Any:
    """Poll `check` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def start_serve(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """`posttrain serve ARGS` against the server of `env`, in a session of its own (so
    `stop_group` reaches everything it started), its output in `log_path`."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", *args],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM `proc`'s process group, SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def serving(proc: subprocess.Popen[bytes], log_path: Path, check: Callable[[], Any]) -> Any:
    """One poll of `check` while `posttrain serve` must be alive (its log tail when it died);
    a server call that fails counts as not yet."""
    assert proc.poll() is None, log_path.read_text()[-3000:]
    try:
        return check()
    except Exception:
        return None


def cancel_from_ui(client: Any, flow_run_id: Any) -> Any:
    """Cancel a flow run as the UI's button does (state Cancelling through the API) and return
    the run once it reached a final state; asserts that state is Cancelled."""
    from prefect.states import Cancelling

    client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    final = wait_for(
        "the cancelled run",
        lambda: (r := client.read_flow_run(flow_run_id)).state.is_final() and r,
        120,
    )
    assert final.state.name == "Cancelled", final.state
    return final
