"""The embedded Prefect server of `posttrain run`, tied to the life of the CLI process.

Without PREFECT_API_URL, Prefect starts a temporary server (a uvicorn subprocess,
`SubprocessASGIServer`) the first time a client needs one, from whatever thread asks, and stops
it from an `atexit` hook. A CLI that dies without running its exit hooks (SIGKILL, the OOM
killer, SIGHUP before posttrain handled it) left the server running, orphaned, holding its
SQLite database.

Here the CLI starts that same server itself, from its main thread, before Prefect would: it is
the singleton Prefect's clients then use (same settings, same PREFECT_HOME database). Its
process is given a parent-death signal (Linux `prctl(PR_SET_PDEATHSIG, SIGTERM)`), which the
kernel delivers when the thread that forked it ends: the main thread, so when the CLI process
ends, however it ends. It runs in a session of its own, so the signals a terminal sends to its
whole foreground group (SIGHUP when it closes, SIGINT on Ctrl-C) reach only the CLI, which then
ends the run, reports it to the server and stops the server. The start-up cost is the same as Prefect's own start (it is Prefect's
own start, done earlier); the `prctl` call costs microseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def die_with(parent: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn`: the child gets `sig` when its parent's forking thread ends."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def start_embedded_server() -> Any | None:
    """Start Prefect's embedded server now, tied to this process; None when runs go to a
    server (PREFECT_API_URL), when not on Linux, or when not called from the main thread
    (the death signal follows the forking thread)."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    # The same test as Prefect's client (a profile may set the URL, not only the environment).
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    import prefect.server.api.server as server_module

    class TiedServer(server_module.SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect's own command line and environment, with a death signal added: the
            # module's `subprocess` is swapped, for this call only, for one whose Popen adds it.
            parent, real = os.getpid(), server_module.subprocess

            def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
                kwargs.setdefault("preexec_fn", die_with(parent))
                # Out of the terminal's process group: a hang-up or Ctrl-C reaches the whole
                # foreground group, and a server that died with it left the CLI unable to
                # record the run's end, retrying for minutes instead of exiting.
                kwargs.setdefault("start_new_session", True)
                return real.Popen(*args, **kwargs)

            shim = types.SimpleNamespace(**{**vars(real), "Popen": popen})
            server_module.subprocess = shim  # type: ignore[assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = real

    server = TiedServer()  # the port-less singleton every Prefect client will use
    if not isinstance(server, TiedServer):  # Prefect already started its own
        return None
    server.start()
    return server
