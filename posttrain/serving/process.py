"""A rollout server the stage starts (`rollout.server.command`), and everything that stops it.

The server must not outlive its stage, however the stage ends. It is started by the stage's
rank 0, from its main thread, under a keeper process (`posttrain.serving.keeper`):
- in a session of its own, so its whole process tree (vLLM's and SGLang's engine processes)
  is one process group to signal, and a terminal's SIGINT/SIGHUP reaches the stage, not it;
- with a parent-death signal (`posttrain.runtime.orphan.die_with`) on the keeper: SIGTERM when the
  stage process ends, even by SIGKILL or `os._exit` (an orphaned stage's exit), where no
  `finally` runs; the keeper then ends the whole group;
- with the stage's environment, launch tag included, so the flow's `kill_stage` (cancel,
  timeout, a stage that failed) and its flow-run sweep find it like any process of the stage;
- recorded in `logs/rollout-server.json` (PID and start time): a stage that starts again
  stops a server an earlier attempt left (`stop_leftover`) and says so.
On the stage's own way out (`stop`): SIGTERM to the group, SIGKILL after a grace period.
Its output goes to `logs/rollout-server.log`, whose last line errors quote.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from posttrain.runtime.orphan import die_with, process_start

STOP_GRACE_S = 15.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def fill_command(command: str | list[str], host: str, port: int, model: str) -> list[str]:
    """The argv of `rollout.server.command` with its placeholders filled in, its program found
    on PATH or beside this interpreter (a virtual environment's `bin/`, not activated when a
    flow starts the stage by the interpreter's path)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    argv = [a.format(host=host, port=port, model=model) for a in argv]
    if not argv:
        raise ValueError("rollout.server.command is empty")
    path = os.pathsep.join(filter(None, [os.environ.get("PATH"), str(Path(sys.executable).parent)]))
    program = shutil.which(argv[0], path=path)
    if program is None:
        raise ValueError(
            f"rollout.server.command: {argv[0]!r} is not on PATH nor beside {sys.executable}"
        )
    return [program, *argv[1:]]


def last_line(log_path: Path, tail_bytes: int = 8192) -> str | None:
    """The last non-blank line of a log file (colour codes and progress bars' carriage
    returns dropped), or None."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [_ANSI.sub("", x.split("\r")[-1]).strip() for x in tail.splitlines()]
    lines = [x for x in lines if x]
    return lines[-1] if lines else None


class ServerProcess:
    """A running server's process (the leader of its own process group)."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, record: Path) -> None:
        self.proc, self.log_path, self.record = proc, log_path, record

    @classmethod
    def start(
        cls, argv: list[str], env: dict[str, str], log_path: Path, record: Path
    ) -> ServerProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"== rollout server: {shlex.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "posttrain.serving.keeper", *argv],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=die_with(os.getpid()),
            )
        with open(log_path, "ab") as log:  # which process group it is, for whoever looks
            log.write(f"== process group {proc.pid}\n".encode())
        server = cls(proc, log_path, record)
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(
            json.dumps({"pid": proc.pid, "start": process_start(proc.pid), "argv": argv})
        )
        os.replace(tmp, record)
        return server

    def exit_reason(self) -> str | None:
        """How the server's process ended, or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"its process was killed by {signal.Signals(-code).name}"
        return f"its process exited with code {code}"

    def last_said(self) -> str | None:
        """The last line of its log, and how it ended if it did. Asked when a request failed:
        a server that was killed may take a moment to be seen dead after its socket closed."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2)
        line = last_line(self.log_path)
        why = self.exit_reason()
        return f"{line} ({why})" if why and line else (line or why)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s`; forget its record."""
        _stop_group(self.proc.pid, grace_s, self.proc.poll)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.record.unlink(missing_ok=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # Members that are zombies (exited, not yet reaped) count as gone.
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def _stop_group(pgid: int, grace_s: float, reap: object = None) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if callable(reap):
                reap()  # our own child: reap it, or it stays a zombie in the group
            if not _group_alive(pgid):
                return
            time.sleep(0.1)


def stop_leftover(record: Path) -> str | None:
    """Stop the server an earlier attempt of the stage recorded, if it still runs (the same PID
    and start time: a PID can be reused) -> what was done, for the log, or None."""
    try:
        info = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    record.unlink(missing_ok=True)
    pid = int(info.get("pid", 0))
    try:
        alive = abs(process_start(pid) - float(info["start"])) < 0.05
    except (psutil.Error, KeyError, ValueError):
        alive = False
    if not alive:
        return None
    _stop_group(pid, STOP_GRACE_S)
    return f"stopped the rollout server an earlier attempt left running (pid {pid})"
