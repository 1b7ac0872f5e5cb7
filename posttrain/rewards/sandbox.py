"""Running untrusted programs (model-written code) for rewards: one process per call, bounded in
CPU seconds, memory, processes, file size, wall time and output, inside a bubblewrap sandbox.

`run(argv, files, stdin, limits, sandbox)`:
  argv     the command inside the sandbox, e.g. ["python3", "main.py"] (a command per language)
  files    {relative name: text} written into the sandbox's private working folder first
  stdin    the program's standard input
  limits   `Limits`
  sandbox  "bwrap": bubblewrap (no network, a read-only system, a private writable tmp as the
           working folder, nothing of the workspace, home or recipe folder, a clean environment);
           "none": the same limits without isolation (an explicit recipe choice, warned about)
-> `RunResult`: how it ended (`status`), exit code, stdout/stderr (truncated at
   `limits.output_bytes`) and wall seconds. Never raises for what the program does: a crash,
   a timeout or a sandbox that could not start is a status, scored as a failure by the caller.

`unavailable()` says why bubblewrap cannot run here (None when it can), for `validate`.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Status = Literal["ok", "error", "timeout", "sandbox_failure"]


@dataclass(frozen=True)
class Limits:
    """Per run. `wall_s` kills the whole process tree; `cpu_s`, `memory_mb` (address space),
    `processes`, `file_mb` are rlimits; `output_bytes` bounds what is kept of each stream."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    processes: int = 64
    file_mb: int = 16
    output_bytes: int = 65536


@dataclass(frozen=True)
class RunResult:
    status: Status  # ok: exit 0; error: nonzero exit or killed by a limit; timeout: wall_s hit
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False  # output past limits.output_bytes was dropped


def unavailable() -> str | None:
    """Why the bubblewrap sandbox cannot run on this host (not installed, no user namespaces,
    ...) and what to install; None when a trial run succeeds."""
    raise NotImplementedError


def run(
    argv: list[str],
    files: dict[str, str],
    stdin: str,
    limits: Limits,
    sandbox: Literal["bwrap", "none"] = "bwrap",
) -> RunResult:
    if sandbox != "none":
        raise NotImplementedError("the bwrap sandbox lands with the sandbox helper's branch")
    with tempfile.TemporaryDirectory(prefix="posttrain-run-") as work:
        for name, text in files.items():
            path = Path(work, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return _run_process(argv, work, stdin, limits)


# A clean environment: nothing of the caller's (tokens, paths) reaches the program.
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"}


def _rlimits(limits: Limits) -> None:
    """In the child before exec: the rlimits of `limits` (minimal `sandbox: none` version)."""
    mb = 1024 * 1024
    for which, value in (
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_FSIZE, limits.file_mb * mb),
    ):
        resource.setrlimit(which, (value, value))


def _run_process(argv: list[str], cwd: str, stdin: str, limits: Limits) -> RunResult:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=_ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: the wall timeout kills the tree
            preexec_fn=lambda: _rlimits(limits),
        )
    except OSError as exc:
        return RunResult("sandbox_failure", None, "", str(exc), time.monotonic() - start)
    timed_out = False
    try:
        out, err = proc.communicate(stdin.encode(), timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    cap = limits.output_bytes
    truncated = len(out) > cap or len(err) > cap
    status: Status = "timeout" if timed_out else ("ok" if proc.returncode == 0 else "error")
    return RunResult(
        status,
        proc.returncode,
        out[:cap].decode(errors="replace"),
        err[:cap].decode(errors="replace"),
        time.monotonic() - start,
        truncated,
    )
