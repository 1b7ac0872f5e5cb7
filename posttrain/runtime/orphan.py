"""A stage process notices when the process that supervises it is gone, and acts on it.

A stage runs in a session of its own (so it can be killed as a group), hence nothing stops it
when its supervisor dies: `posttrain run` SIGKILLed by the OOM killer, a lost pod, a Prefect
worker killed outright. Left alone it would go on training with nobody reading its output, its
artifact lock already released by the kernel (the supervisor held it), so a new run could start
writing the same folder.

The supervisor (the process that started and follows the stage) writes its PID and start time
into the stage's spec (`spec.json`, `launch.supervisor_pid`/`supervisor_start`); every process
of the stage that runs `stage_main` (each rank under torchrun) starts a daemon thread that checks
once a second that this very process (same PID, same start time: a PID can be reused) is still
alive. A stage that an engine (Slurm, Kubernetes) runs on other machines cannot see the
supervisor's PID: the supervisor rewrites a beat file on the shared workspace instead
(`SupervisorBeat`, `launch.beat_file`), and it counts as gone when the file's content has not
changed for `infra.supervisor_silence_s` by this process's own clock (no comparison of two
machines' clocks). When it is gone, per `infra.orphan`:
  - `stop`: one line in the stage's log, then the process ends at once (`os._exit`). Safe at any
    moment: checkpoints are written to `step_N.tmp` and renamed, the manifest is written last,
    so what is left is complete checkpoints and no manifest; the next run resumes from the
    newest. Rank 0 looks once more right before sealing the manifest, so an orphan never seals
    (nobody holds the artifact's lock any more), however fast its last steps were. Under
    torchrun the rank also SIGTERMs its torchrun agent (it carries the same launch tag), which
    stops the other ranks.
  - `finish`: the stage goes on to the end and seals its artifact. Its output goes to its log
    file (the supervisor's pipe has no reader any more). Rank 0 takes over the artifact lock (and
    the device lock) from the dead supervisor, so a new run of the same stage waits, then reuses
    the artifact. If a new run already took the artifact lock, two writers must not share the
    folder: the stage stops instead.
No Prefect here: the stage side knows only processes, files and locks.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from posttrain.runtime.spec import LAUNCH_TAG_ENV, LaunchInfo
from posttrain.store.locking import FileLock

PR_SET_PDEATHSIG = 1
BEAT_EVERY_S = 5.0
POLL_S = 1.0
EXIT_ORPHANED = 1  # like any stage that did not finish: no manifest, "not done"
# A killed supervisor's main thread reads as a zombie (gone) while its other threads are still
# exiting, and those share its open files: its locks are released a moment later, longer on a
# loaded machine. While a lock's record still names the dead supervisor, `finish` waits this long
# for that release before it concludes that someone else holds the lock.
RELEASE_GRACE_S = 5.0

log = logging.getLogger("posttrain.runtime.orphan")


def die_with(parent: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn`: the child gets `sig` when its parent's forking thread ends."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def process_start(pid: int | None = None) -> float:
    """When a process started, in seconds after boot (with its PID, the process's identity on
    this machine). From the kernel's start ticks (`/proc/<pid>/stat`), not psutil's
    create_time: that adds the boot time as the wall clock now sees it, so a clock step (NTP)
    between recording and checking made a live supervisor look like another process and its
    stage stop itself as an orphan. Raises psutil.NoSuchProcess when there is no such process."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, field 3 on
    except FileNotFoundError:
        raise psutil.NoSuchProcess(pid) from None
    except OSError:  # no /proc (not Linux): psutil's, wall-clock based
        return psutil.Process(pid).create_time()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime


def supervisor_alive(pid: int, start: float) -> bool:
    """Whether the process `pid` that started at `start` still runs (a zombie does not)."""
    try:
        p = psutil.Process(pid)
        return abs(process_start(pid) - start) < 0.05 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to inspect: it exists, so assume it is the supervisor
        return True


class SupervisorBeat:
    """The supervisor side of a remote stage's orphan watch: a thread rewrites `path` with a
    new counter every `every_s` while the supervisor follows the stage. A context manager;
    `of(launch)` is a no-op one for a launch that names no beat file (a local one)."""

    def __init__(self, path: Path, every_s: float = BEAT_EVERY_S):
        self.path, self.every_s = Path(path), every_s
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="supervisor-beat", daemon=True)

    @classmethod
    def of(cls, launch: LaunchInfo) -> contextlib.AbstractContextManager[object]:
        return cls(Path(launch.beat_file)) if launch.beat_file else contextlib.nullcontext()

    def beat(self, n: int) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with contextlib.suppress(OSError):  # a full disk must not end the flow; silence will
            tmp.write_text(f"{n} {time.time():.3f} {os.getpid()}\n")
            os.replace(tmp, self.path)

    def _run(self) -> None:
        n = 1
        while not self._stop.wait(self.every_s):
            n += 1
            self.beat(n)

    def __enter__(self) -> SupervisorBeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat(1)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(timeout=5)


class BeatReader:
    """The stage side: whether the supervisor's beat file changed within `silence_s`."""

    def __init__(self, path: Path, silence_s: float):
        self.path, self.silence_s = Path(path), silence_s
        self.last: str | None = None
        self.changed_at = time.monotonic()  # the supervisor wrote a beat right before submitting

    def alive(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with contextlib.suppress(OSError):
            text = self.path.read_text()
            if text != self.last:
                self.last, self.changed_at = text, now
        return now - self.changed_at < self.silence_s


class OrphanWatch:
    """The watching thread of one stage process; `start()` returns None when its launch names
    nothing to watch."""

    def __init__(
        self,
        out_dir: Path,
        stage: str,
        policy: str,
        launch: LaunchInfo,
        env: Mapping[str, str] | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        # RANK/GROUP_RANK (torchrun's) say which process takes the locks over; the launch tag
        # says which parent is this launch's torchrun agent.
        self.env = dict(os.environ if env is None else env)
        self.out_dir, self.stage, self.policy, self.poll_s = Path(out_dir), stage, policy, poll_s
        self.launch = launch
        self.beats: BeatReader | None = None
        if launch.beat_file:
            self.beats = BeatReader(Path(launch.beat_file), float(launch.silence_s or 0.0))
        self.pid, self.start_time = launch.supervisor_pid or 0, launch.supervisor_start or 0.0
        self.taken: list[FileLock] = []  # locks taken over (finish): freed when we exit
        self._stop = threading.Event()
        self._acting = threading.Lock()
        self.supervisor_gone = False
        self.thread: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        out_dir: Path,
        stage: str,
        policy: str,
        launch: LaunchInfo,
        poll_s: float = POLL_S,
    ) -> OrphanWatch | None:
        if not (launch.beat_file or launch.supervisor_pid):
            return None
        watch = cls(out_dir, stage, policy, launch, poll_s=poll_s)
        watch.thread = threading.Thread(target=watch._run, name="orphan-watch", daemon=True)
        watch.thread.start()
        return watch

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:  # first look at once: the supervisor may have died while we imported torch
            if self.check():
                return
            if self._stop.wait(self.poll_s):
                return

    def check(self) -> bool:
        """Act now if the supervisor is gone (once); returns whether it is. Also called right
        before the manifest is sealed, so that with `stop` an orphan never seals an artifact
        (nobody holds its lock any more), however short its last steps were."""
        with self._acting:
            if self.supervisor_gone:
                return True
            if self.beats is not None:
                if self.beats.alive():
                    return False
            elif supervisor_alive(self.pid, self.start_time):
                return False
            self.supervisor_gone = True
            self.orphaned()
            return True

    def orphaned(self) -> None:
        self._to_log_file()
        if self.beats is not None:
            what = (
                f"stage {self.stage}: its supervisor is gone (its beat file {self.beats.path} has "
                f"not changed for {self.beats.silence_s:g} s)"
            )
        else:
            what = f"stage {self.stage}: its supervisor (pid {self.pid}) is gone"
        if self.policy == "finish":
            taken = self._take_over_locks()
            if taken is not None:
                log.warning(
                    "%s; infra.orphan=finish: finishing the stage (now holding %s; a new run "
                    "waits for it, then reuses the artifact)",
                    what,
                    ", ".join(taken) or "no lock",
                )
                return
            log.warning(
                "%s; infra.orphan=finish, but a new run already holds the artifact lock: "
                "stopping, so that two runs never write one folder",
                what,
            )
        else:
            log.warning(
                "%s; infra.orphan=stop: stopping now (complete checkpoints are kept; the next "
                "run resumes from the newest)",
                what,
            )
        self._stop_agent()
        with contextlib.suppress(Exception):
            logging.shutdown()
        os._exit(EXIT_ORPHANED)

    def _to_log_file(self) -> None:
        # Our stdout/stderr were the dead supervisor's pipe: a write would fail (EPIPE) and end
        # the stage mid-step. The supervisor appended them to logs/stage.log: go on doing so.
        path = self.out_dir / "logs" / "stage.log"
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)

    def _take_over_locks(self) -> list[str] | None:
        """Rank 0 of node 0 takes the artifact lock (when the supervisor held it) and the device
        lock. None when the artifact lock is taken by someone else."""
        if self.env.get("RANK", "0") != "0" or self.env.get("GROUP_RANK", "0") != "0":
            return []
        owner = {"what": f"stage {self.stage}, orphaned (infra.orphan=finish)"}
        names = []
        if artifact := self.launch.lock:
            lock = FileLock(artifact)
            if not self._take_from_supervisor(lock, owner):
                return None
            self.taken.append(lock)
            names.append(artifact)
        if devices := self.launch.device_lock:
            lock = FileLock(devices)
            with contextlib.suppress(OSError):
                if lock.try_acquire(owner):  # a new run may have it already: go on anyway
                    # Keep naming the dead run's flow run: its Prefect slot is still occupied,
                    # and the run that repossesses it says whose it was.
                    dead = lock.previous or {}
                    lock.update(
                        **{k: dead[k] for k in ("flow_run_id", "flow_run_name") if k in dead}
                    )
                    self.taken.append(lock)
                    names.append(devices)
        return names

    def _take_from_supervisor(self, lock: FileLock, owner: Mapping[str, str]) -> bool:
        """Take `lock`, waiting up to RELEASE_GRACE_S while its holder is still recorded as
        the dead supervisor (its exit is releasing it); False when another process holds it."""
        deadline = time.monotonic() + RELEASE_GRACE_S
        while not lock.try_acquire(owner):
            holder = lock.holder() or {}
            if not self.pid or holder.get("pid") != self.pid or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _stop_agent(self) -> None:
        # Under torchrun our parent is its agent, of the same launch: SIGTERM makes it stop
        # the other ranks and exit, rather than wait for them to notice on their own.
        tag = self.env.get(LAUNCH_TAG_ENV)
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(os.getppid())
            if tag and parent.environ().get(LAUNCH_TAG_ENV) == tag:
                parent.send_signal(signal.SIGTERM)
                time.sleep(0.2)  # let it start forwarding before this rank vanishes
