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

import contextlib
import functools
import json
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from posttrain.rewards import sandbox_process

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
    tmp_mb: int = 64  # bwrap: size of the private /tmp (the working folder) and of /dev/shm


@dataclass(frozen=True)
class RunResult:
    status: Status  # ok: exit 0; error: nonzero exit or killed by a limit; timeout: wall_s hit
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False  # output past limits.output_bytes was dropped


# The sandbox's view of the host: read-only system folders and the few /etc files a language
# runtime reads (the loader's cache, the alternatives symlinks); never /etc as a whole (it holds
# host names, users and maybe credentials), /root, /home, the workspace or the host's /tmp.
_SYSTEM_RO = [
    "/usr",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
]
_PATH = "/usr/bin:/bin:/usr/local/bin"  # /usr/local/bin last: python images install python3 there
_INSTALL = "install it with `apt-get install bubblewrap`"


def _root_links() -> list[str]:
    """/bin, /lib, /lib64, /sbin: symlinks into /usr on merged-/usr systems, binds otherwise."""
    args: list[str] = []
    for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


def _bwrap_argv(limits: Limits, status_fd: int, file_fds: dict[str, int]) -> list[str]:
    """bwrap's command line up to (not including) the program."""
    args = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    args += ["--new-session", "--clearenv", "--setenv", "PATH", _PATH, "--setenv", "HOME", "/tmp"]
    args += ["--setenv", "LANG", "C.UTF-8"]
    for path in _SYSTEM_RO:
        args += ["--ro-bind-try", path, path]
    args += _root_links()
    # Writable: only /tmp and /dev/shm, both size-bounded tmpfs (they live in the host's memory).
    # bwrap's own root and /dev are tmpfs too: read-only, or writing there would be unbounded.
    size = str(limits.tmp_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm"]
    args += ["--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp", "--chdir", "/tmp"]
    for name, fd in file_fds.items():
        args += ["--file", str(fd), f"/tmp/{name}"]
    return args + ["--remount-ro", "/", "--json-status-fd", str(status_fd)]


def _prlimit(limits: Limits) -> list[str]:
    """The rlimits, set inside the sandbox (after bwrap made its user namespace): RLIMIT_NPROC
    then counts this sandbox's processes only, not every process of the host uid."""
    mb = 1 << 20
    return [
        "prlimit",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_mb * mb}",
        f"--nproc={limits.processes}",
        f"--fsize={limits.file_mb * mb}",
        "--core=0",
        "--",
    ]


def _check_names(files: dict[str, str]) -> None:
    for name in files:
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(
                f"sandbox file name {name!r} must be a relative path inside the folder"
            )


def _memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name.replace("/", "_"))
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _statuses(data: bytes) -> dict:
    """bwrap's --json-status-fd: one JSON object per event ({"child-pid": ...}, {"exit-code": ...})."""
    merged: dict = {}
    decoder = json.JSONDecoder()
    text, at = data.decode(errors="replace"), 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return merged
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return merged
        merged.update(obj)


def _result(outcome: sandbox_process.Outcome, status: Status | None, code: int | None) -> RunResult:
    """`status` None: from how the program ended (timeout, else its exit code)."""
    if status is None:
        status = "timeout" if outcome.timed_out else "ok" if code == 0 else "error"
    return RunResult(
        status,
        None if outcome.timed_out else code,
        outcome.stdout.decode(errors="replace"),
        outcome.stderr.decode(errors="replace"),
        round(outcome.seconds, 3),
        outcome.truncated,
    )


def _await_gone(pid: int, pid_ns: int | None, timeout_s: float = 2.0) -> None:
    """End the sandbox's pid 1 (a host pid; bwrap's outer process is gone by now) and wait for
    it: the kernel kills every process of a pid namespace before its pid 1 is gone, so
    afterwards nothing the program started is left. pid 1 normally dies with bwrap
    (--die-with-parent); the kill is the backstop, aimed only at the process still in that
    namespace (`pid_ns`, its inode), never at a recycled pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            same = os.stat(f"/proc/{pid}/ns/pid").st_ino == pid_ns
        except (OSError, IndexError):
            return
        if state in ("Z", "X") or not same:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _run_bwrap(argv: list[str], files: dict[str, str], stdin: str, limits: Limits) -> RunResult:
    file_fds = {name: _memfd(name, text) for name, text in files.items()}
    status_r, status_w = os.pipe()
    write_ends = [status_w]  # closed once bwrap holds it (so EOF comes when bwrap ends)

    def started() -> None:
        os.close(write_ends.pop())

    command = _bwrap_argv(limits, status_w, file_fds) + _prlimit(limits) + list(argv)
    command[0] = shutil.which("bwrap", path=os.environ.get("PATH", "") + ":/usr/bin") or "bwrap"
    try:
        # bwrap's own environment and folder too: its pid-1 monitor stays visible inside as
        # /proc/1 (environ, cwd), so it must carry nothing of the host's (no secrets).
        outcome = sandbox_process.drive(
            # bwrap itself: CPU and file size as a backstop (prlimit sets them all inside).
            sandbox_process.limited(command, limits.cpu_s, limits.file_mb),
            stdin.encode(),
            limits.wall_s,
            limits.output_bytes,
            pass_fds=(status_w, *file_fds.values()),
            after_start=started,
            cwd="/",
            env={"PATH": _PATH, "LANG": "C.UTF-8"},
        )
    except OSError as exc:  # no bwrap binary, or it could not be executed
        return RunResult("sandbox_failure", None, "", f"bwrap could not start: {exc}", 0.0)
    finally:
        for fd in file_fds.values():
            os.close(fd)
        for fd in write_ends:  # bwrap did not start: close its end here (exactly once)
            os.close(fd)
    status = _statuses(sandbox_process.read_all(status_r))
    os.close(status_r)
    if "child-pid" in status:
        _await_gone(int(status["child-pid"]), status.get("pid-namespace"))
    if "exit-code" not in status and not outcome.timed_out:
        # bwrap reports the program's exit code (a signal as 128 + its number) once the program
        # ran; without one, bwrap failed setting the sandbox up (its own error is on stderr).
        return _result(outcome, "sandbox_failure", outcome.returncode)
    return _result(outcome, None, status.get("exit-code", outcome.returncode))


def _run_plain(argv: list[str], files: dict[str, str], stdin: str, limits: Limits) -> RunResult:
    # As root the program runs as nobody, who must reach its folder: the temp dir this process
    # was given may sit below a root-only folder (a test's, a job's private TMPDIR), so /tmp.
    root = os.getuid() == 0
    shared = "/tmp" if root and os.path.isdir("/tmp") else None
    workdir = tempfile.mkdtemp(prefix="posttrain-run-", dir=shared)
    try:
        for name, text in files.items():
            path = Path(workdir, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if root:  # the program runs as nobody: it must be able to write its folder
            for dirpath, _, names in os.walk(workdir):
                for entry in [dirpath, *(os.path.join(dirpath, n) for n in names)]:
                    os.chown(entry, sandbox_process.NOBODY, sandbox_process.NOBODY)
        env = {"PATH": _PATH, "HOME": workdir, "LANG": "C.UTF-8"}
        command = sandbox_process.limited(
            list(argv), limits.cpu_s, limits.file_mb, limits.memory_mb, limits.processes
        )
        outcome = sandbox_process.drive(
            command,
            stdin.encode(),
            limits.wall_s,
            limits.output_bytes,
            cwd=workdir,
            env=env,
        )
        return _result(outcome, None, outcome.returncode)
    except OSError as exc:  # the program itself could not be started (not found, ...)
        return RunResult("error", None, "", f"could not start {argv[0]!r}: {exc}", 0.0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(
    argv: list[str],
    files: dict[str, str],
    stdin: str,
    limits: Limits,
    sandbox: Literal["bwrap", "none"] = "bwrap",
) -> RunResult:
    _check_names(files)
    if sandbox == "bwrap":
        return _run_bwrap(argv, files, stdin, limits)
    return _run_plain(argv, files, stdin, limits)


def _userns_hint() -> str:
    for path, off in (
        ("/proc/sys/kernel/unprivileged_userns_clone", "0"),
        ("/proc/sys/user/max_user_namespaces", "0"),
        ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1"),
    ):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value == off:
            name = path.removeprefix("/proc/sys/").replace("/", ".")
            good = "1" if off == "0" and "clone" in name else "0" if off == "1" else "15000"
            return f"user namespaces are off ({name}={value}): `sysctl -w {name}={good}`"
    return ""


@functools.cache
def unavailable() -> str | None:
    """Why the bubblewrap sandbox cannot run on this host (not installed, no user namespaces,
    ...) and what to install; None when a trial run succeeds. Cached per process."""
    if shutil.which("bwrap", path=os.environ.get("PATH", "") + ":/usr/bin:/bin") is None:
        return f"no `bwrap` (bubblewrap) on this host: {_INSTALL}"
    if shutil.which("prlimit", path="/usr/bin:/bin") is None:
        return "no /usr/bin/prlimit (it sets the limits inside the sandbox): `apt-get install util-linux`"
    if os.getuid() == 0 and not os.access(sandbox_process.SETPRIV, os.X_OK):
        return "no /usr/bin/setpriv (as root, programs run as nobody through it): `apt-get install util-linux`"
    result = run(["true"], {}, "", Limits(wall_s=20.0))
    if result.status == "ok":
        return None
    why = " ".join(result.stderr.split())[:300] or f"status {result.status}"
    hint = _userns_hint() or _INSTALL
    return f"bubblewrap cannot start a sandbox here ({why}); {hint}"
