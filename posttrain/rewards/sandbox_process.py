"""Driving one untrusted process for `sandbox.run`: rlimits (`prlimit`) and a dropped uid, both output streams read at once (kept up to a bound, the rest drained), stdin fed without
blocking, and the whole process group killed at the wall-clock limit and after the program ends
(so nothing it started is left running)."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

NOBODY = 65534  # the uid/gid programs run as when this process is root
PRLIMIT = "/usr/bin/prlimit"
SETPRIV = "/usr/bin/setpriv"
_GRACE_S = 0.5  # after the program exits: how long leftovers may hold its pipes open
_CHUNK = 65536


def limited(
    command: list[str],
    cpu_s: int,
    file_mb: int,
    memory_mb: int | None = None,
    processes: int | None = None,
) -> list[str]:
    """`command` behind util-linux's `prlimit`, which sets the limits given (None: not here)
    and execs it. Not a `preexec_fn`: Python code between fork and exec in a process with
    other threads (the rewarder's pool, torch's) can deadlock or crash the child, which the
    test suite saw as a segfault in every run after torch had started its threads. As root the
    child already runs as `NOBODY` (`drive` puts `setpriv` first), so RLIMIT_NPROC binds it."""
    mb = 1 << 20
    limits = [f"--cpu={cpu_s}:{cpu_s + 1}", f"--fsize={file_mb * mb}", "--core=0"]
    if memory_mb is not None:
        limits.append(f"--as={memory_mb * mb}")
    if processes is not None:
        limits.append(f"--nproc={processes}")
    return [PRLIMIT, *limits, "--", *command]


@dataclass
class Outcome:
    returncode: int | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    seconds: float


def _exited(pid: int) -> bool:
    """Whether the child ended, without reaping it: its pid (= the process group id) stays
    taken until `wait`, so the group kill cannot hit a recycled pid."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class _Pump:
    """stdin written and stdout/stderr read through one selector: the first `keep` bytes of
    each stream kept, the rest read and dropped (a flood never blocks the program nor fills
    memory)."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, keep: int) -> None:
        self.keep, self.truncated = keep, False
        self.kept: dict[int, bytearray] = {}
        self.sel = selectors.DefaultSelector()
        for stream in (proc.stdout, proc.stderr):
            self.kept[stream.fileno()] = bytearray()
            self.sel.register(stream.fileno(), selectors.EVENT_READ)
        self.pending = memoryview(stdin)
        self.stdin = proc.stdin
        self.stdin_fd = proc.stdin.fileno()
        if stdin:
            os.set_blocking(self.stdin_fd, False)
            self.sel.register(self.stdin_fd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()

    def open(self) -> bool:
        return bool(self.sel.get_map())

    def step(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            fd = key.fd
            if fd == self.stdin_fd:
                self._write()
                continue
            data = os.read(fd, _CHUNK)
            if not data:
                self.sel.unregister(fd)
                continue
            room = self.keep - len(self.kept[fd])
            self.kept[fd] += data[: max(room, 0)]
            self.truncated |= len(data) > room

    def _write(self) -> None:
        try:
            self.pending = self.pending[os.write(self.stdin_fd, self.pending[:_CHUNK]) :]
        except (BrokenPipeError, BlockingIOError) as exc:
            if isinstance(exc, BlockingIOError):
                return
            self.pending = self.pending[:0]
        if not self.pending:
            self.sel.unregister(self.stdin_fd)
            self.stdin.close()


def drive(
    command: list[str],
    stdin: bytes,
    wall_s: float,
    output_bytes: int,
    pass_fds: tuple[int, ...] = (),
    after_start: Callable[[], None] = lambda: None,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
) -> Outcome:
    """Run `command` in a new session for at most `wall_s`, keeping `output_bytes` of each
    stream; its whole process group is killed at the end. As root, as `NOBODY`."""
    start = time.monotonic()
    if os.getuid() == 0:
        # util-linux's setpriv drops the uid, not subprocess's `user=`/`group=`: with those,
        # CPython forks instead of vforking, and copying the page tables of a stage that holds
        # a model (torch's heap) cut the programs run per second to a third.
        command = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]
    proc = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        pass_fds=pass_fds,
        cwd=cwd,
        env=env,
    )
    after_start()
    pump = _Pump(proc, stdin, output_bytes)
    deadline, ended = start + wall_s, False
    try:
        while pump.open() or not ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if pump.open():
                pump.step(min(remaining, 0.05))
            else:
                time.sleep(min(remaining, 0.01))
            if not ended and _exited(proc.pid):
                ended = True  # leftovers get a moment to close the pipes, then are killed
                deadline = min(deadline, time.monotonic() + _GRACE_S)
                _kill_group(proc.pid)
        ended = ended or _exited(proc.pid)
    finally:
        _kill_group(proc.pid)
        proc.wait()
        pump.sel.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                stream.close()
    kept = list(pump.kept.values())
    seconds = time.monotonic() - start
    return Outcome(
        proc.returncode, bytes(kept[0]), bytes(kept[1]), pump.truncated, not ended, seconds
    )


def read_all(fd: int) -> bytes:
    """Whatever is in a pipe whose writers are gone (non-blocking: never waits on a straggler)."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)
