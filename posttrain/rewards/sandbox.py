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

from dataclasses import dataclass
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
    raise NotImplementedError
