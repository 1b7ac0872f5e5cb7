"""The embedded Prefect server of `posttrain run`, tied to the life of the CLI process.

Prefect starts its temporary server (a uvicorn subprocess) from whatever thread first needs it
and stops it from an `atexit` hook, so a CLI killed without its exit hooks left it running,
orphaned, holding its SQLite database. Here the CLI starts that same server (the singleton
Prefect's clients use) from its main thread with a parent-death signal (Linux `prctl`), so it
ends when the CLI ends, however it ends; in a session of its own, so a terminal's SIGHUP or
SIGINT reaches only the CLI, which then ends the run, reports it and stops the server. It is
launched early (`launch_embedded_server`) and adopted later (`start_embedded_server(early)`):
its ~3-4 s boot overlaps the CLI's own imports. The command line and environment are Prefect's
(`uvicorn_command`; a test compares them with Prefect's own).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from posttrain.runtime.orphan import die_with

# Prefect's port range for its temporary server (SubprocessASGIServer._port_range).
PORT_RANGE = (8000, 9000)


def _wanted() -> bool:
    """Whether this process should start the embedded server itself: on Linux, from the main
    thread (the death signal follows the forking thread), and only when runs go to no server."""
    if not sys.platform.startswith("linux"):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    # The same test as Prefect's client (a profile may set the URL, not only the environment).
    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


def uvicorn_command(port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment Prefect 3.9's `SubprocessASGIServer` starts its server
    with, built without importing `prefect.server` (~2 s of imports)."""
    import prefect
    from prefect.settings import get_current_settings

    args = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent)]
    args += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--log-level", "error", "--lifespan", "on"]
    env = {
        **os.environ,
        # Prefect's: no UI, the ephemeral set of services, one app per process.
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        **get_current_settings().to_environment_variables(exclude_unset=True),
    }
    return args, env


def _tied_popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen` for the server: it dies with this process's main thread."""
    kwargs.setdefault("preexec_fn", die_with(os.getpid()))
    # Out of the terminal's process group: a hang-up or Ctrl-C reaches the whole foreground
    # group, and a server that died with it left the CLI unable to record the run's end,
    # retrying for minutes instead of exiting.
    kwargs.setdefault("start_new_session", True)
    return subprocess.Popen(args, **kwargs)


@dataclass
class EarlyServer:
    """The embedded server's process, launched and not yet waited for."""

    port: int
    process: subprocess.Popen[Any]

    def discard(self) -> None:
        """Stop it (the run ended before it was adopted)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _free_port() -> int:
    # Prefect's own choice (a random free port in its range); a port taken meanwhile makes
    # uvicorn exit with code 3, and Prefect's start() then starts another on a new port.
    for _ in range(20):
        port = random.randrange(*PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port for the embedded Prefect server")


def launch_embedded_server() -> EarlyServer | None:
    """Launch the embedded server's process now, to adopt with `start_embedded_server`; None
    when this process should not start it (`_wanted`)."""
    if not _wanted():
        return None
    port = _free_port()
    args, env = uvicorn_command(port)
    return EarlyServer(port, _tied_popen(args, env=env))


def start_embedded_server(early: EarlyServer | None = None) -> Any | None:
    """Start Prefect's embedded server tied to this process (adopting `early`'s process);
    returns it once healthy, None where `_wanted` says no."""
    if not _wanted():
        if early is not None:
            early.discard()
        return None
    import prefect.server.api.server as server_module

    class TiedServer(server_module.SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            nonlocal early
            if early is not None and self.port == early.port:
                adopted, early = early.process, None
                return adopted
            # Prefect's own command line and environment, with a death signal added: the
            # module's `subprocess` is swapped, for this call only, for one whose Popen adds it.
            real = server_module.subprocess
            shim = types.SimpleNamespace(**{**vars(real), "Popen": _tied_popen})
            server_module.subprocess = shim  # type: ignore[assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = real

    server = TiedServer()  # the port-less singleton every Prefect client will use
    if not isinstance(server, TiedServer):  # Prefect already started its own
        if early is not None:
            early.discard()
        return None
    if early is not None:
        server.port = early.port  # start() then runs the early process through the override
    try:
        server.start()
    finally:
        if early is not None:  # not adopted (start() failed before): not left running
            early.discard()
    return server


@contextlib.contextmanager
def embedded_run_settings() -> Iterator[None]:
    """Prefect settings for a flow run on the embedded server: no flow-run heartbeats, unless
    the user set their frequency (environment or profile).

    Heartbeats let a server's automations call a run crashed when its process vanished. The
    embedded server runs only the ephemeral set of services (no proactive triggers) and dies
    with the run's process, so no one can act on a missing heartbeat; what they cost is the
    join of their thread when the flow ends, up to 1 s (it sleeps in 1 s steps)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(set_defaults={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
