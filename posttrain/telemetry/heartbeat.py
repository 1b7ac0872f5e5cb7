"""Per-rank heartbeats and the hang watch that reads them.

Every rank of a stage process writes `<out_dir>/logs/heartbeat/rank<k>.json` (logs/ is outside
the manifest) at stage start, at the start of its training loop, after every optimizer step, at
every evaluation batch and before every checkpoint: `{rank, node, pid, seq, step, phase, time}`,
replaced atomically (write a temporary file, `os.replace`), so a reader never sees half a beat.
A beat that changes the phase is written at once. Beats within one phase (a step of a small model
takes tens of milliseconds; a file write on a shared filesystem can take milliseconds) only
replace the beat held in memory: a writer thread puts the newest on disk every
`WRITE_INTERVAL_S`, so the file trails the loop by at most that. A rank stuck in C code or in a
Python loop stops beating, so the file stops changing either way.

At stage start every rank also registers `faulthandler` on SIGUSR1 into
`<out_dir>/logs/stacks-rank<k>.txt`: `kill -USR1 <pid>` (or the supervisor's hang watch) dumps
the Python stacks of all its threads there, even while the rank is stuck in C code (a
collective, a read).

`HangWatch` is the supervisor's side (no torch, no Prefect): it polls the beat files and says
when no rank's beat has advanced for too long. It measures silence with the supervisor's own
monotonic clock from when it saw each beat change (`seq`), so ranks on other machines with other
clocks are judged the same way.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("posttrain.heartbeat")

HEARTBEAT_DIR = Path("logs") / "heartbeat"
# Phases before the training loop (loading the model, preparing data, sharding, resuming): the
# watch allows `startup_s` more silence while any rank is still in one of them.
STARTUP_PHASES = ("start", "setup")
# How far the beat file of a stage process may trail its newest beat within one phase: far below
# any hang limit (seconds to minutes), far above a small model's step time.
WRITE_INTERVAL_S = 0.25


def heartbeat_dir(out_dir: Path) -> Path:
    return Path(out_dir) / HEARTBEAT_DIR


def stack_file(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / "logs" / f"stacks-rank{rank}.txt"


class Heartbeat:
    """One rank's beat file. `write_interval_s` 0: every beat is written at once (tests, tools);
    above 0: phase changes at once, other beats by a writer thread at that interval."""

    def __init__(self, out_dir: Path, rank: int, write_interval_s: float = 0.0):
        self.rank = rank
        self.path = heartbeat_dir(out_dir) / f"rank{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".rank{rank}.json.tmp")
        self.seq = 0
        self.step: int | None = None
        self.phase = "start"
        self._warned = False
        self._pid = os.getpid()
        # The host, for a reader (the Prometheus exporter) that labels ranks by node.
        self._node = socket.gethostname()
        self._interval = write_interval_s
        # Guards `_pending` and the file: the writer thread and a phase change never interleave,
        # and an older beat never replaces a newer one on disk.
        self._lock = threading.Lock()
        self._pending: dict[str, Any] | None = None
        self._written_seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int | None = None, phase: str | None = None) -> None:
        """Record progress. `step`/`phase` of None keep the previous value."""
        self.seq += 1
        new_phase = phase is not None and phase != self.phase
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase
        record = {
            "rank": self.rank,
            "node": self._node,
            "pid": self._pid,
            "seq": self.seq,
            "step": self.step,
            "phase": self.phase,
            "time": round(time.time(), 3),
        }
        with self._lock:
            self._pending = record
            if self._interval <= 0 or new_phase or self._written_seq == 0:
                self._write_pending()
                return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._writer, name=f"heartbeat-rank{self.rank}", daemon=True
            )
            self._thread.start()

    def flush(self) -> None:
        """Write the newest beat now, if the file does not hold it yet."""
        with self._lock:
            self._write_pending()

    def close(self) -> None:
        """Stop the writer thread and write the newest beat."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.flush()

    def _writer(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()

    def _write_pending(self) -> None:  # under self._lock
        record, self._pending = self._pending, None
        if record is None or record["seq"] <= self._written_seq:
            return
        try:
            self._tmp.write_text(json.dumps(record))
            os.replace(self._tmp, self.path)
            self._written_seq = record["seq"]
        except OSError as exc:
            # A beat is bookkeeping: never fail a training step over it (a full disk fails the
            # next checkpoint anyway). Without beats the hang watch will stop the stage.
            if not self._warned:
                log.warning("heartbeat %s not written: %s", self.path, exc)
                self._warned = True


# The process's heartbeat and stack file, set by `start` (stage_main); beats before it are no-ops,
# so library code can beat unconditionally (tests that call it outside a stage included).
_current: Heartbeat | None = None
_stack_file: IO[str] | None = None


def start(out_dir: Path, rank: int) -> Heartbeat:
    """Register the SIGUSR1 stack dump and write this rank's first beat (phase `start`)."""
    global _current, _stack_file
    stacks = stack_file(out_dir, rank)
    stacks.parent.mkdir(parents=True, exist_ok=True)
    if _stack_file is not None:
        _stack_file.close()
    # Truncated per launch: non-empty means this launch was asked for its stacks. Kept open for
    # the life of the process: faulthandler writes to its descriptor from the signal handler.
    _stack_file = open(stacks, "w", encoding="utf-8")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    if _current is not None:
        _current.close()
    _current = Heartbeat(out_dir, rank, write_interval_s=WRITE_INTERVAL_S)
    _current.beat(phase="start")
    return _current


def beat(step: int | None = None, phase: str | None = None) -> None:
    """Beat this process's heartbeat, if `start` was called."""
    if _current is not None:
        _current.beat(step, phase)


def current_step() -> int | None:
    """The step of this process's newest beat (None before the first step, or outside a stage)."""
    return _current.step if _current is not None else None


def flush() -> None:
    """Put this process's newest beat on disk now (a beat within a phase trails by up to
    `WRITE_INTERVAL_S`)."""
    if _current is not None:
        _current.flush()


def stop() -> None:
    """Write the newest beat, unregister the stack dump and forget the heartbeat (the files
    stay)."""
    global _current, _stack_file
    if _current is not None:
        _current.close()
    if _stack_file is not None:
        faulthandler.unregister(signal.SIGUSR1)
        _stack_file.close()
        _stack_file = None
    _current = None


def read_rank_files(folder: Path) -> dict[int, dict[str, Any]]:
    """Every `rank<k>.json` record in `folder`, by its `rank`; a file that vanished, is torn or
    foreign is skipped (the next poll sees the next one). Heartbeats and health samples."""
    out: dict[int, dict[str, Any]] = {}
    if not folder.is_dir():
        return out
    for path in folder.glob("rank*.json"):
        try:
            record = json.loads(path.read_text())
            out[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def read_heartbeats(out_dir: Path) -> dict[int, dict[str, Any]]:
    """The latest beat of every rank that has written one, by rank."""
    return read_rank_files(heartbeat_dir(out_dir))


@dataclass
class RankSilence:
    rank: int
    pid: int | None
    step: int | None
    phase: str | None
    silent_s: float | None  # None: never beat


@dataclass
class Hang:
    """What the watch saw when it gave up: every rank's last beat, the ones behind first."""

    limit_s: float
    ranks: list[RankSilence]

    @property
    def behind(self) -> RankSilence:
        return self.ranks[0]

    def describe(self) -> str:
        def one(r: RankSilence) -> str:
            if r.silent_s is None:
                return f"rank {r.rank}: no beat at all"
            step = "before its first step" if r.step is None else f"at step {r.step}"
            return f"rank {r.rank} {step} (phase {r.phase}), silent {r.silent_s:.1f} s"

        return "; ".join(one(r) for r in self.ranks)


class HangWatch:
    """Decides from the beat files whether a stage hangs.

    Armed by the first beat of any rank (before it, process start, imports and the process-group
    rendezvous are bounded by the stage timeout only). Then: a hang is `timeout_s` without any
    rank's beat advancing, or `timeout_s + startup_s` while some rank is still in a startup
    phase (or has not beaten yet). `expected_ranks`: ranks that should beat here (reported when they never did)."""

    def __init__(
        self,
        out_dir: Path,
        timeout_s: float,
        startup_s: float = 0.0,
        expected_ranks: tuple[int, ...] = (),
    ):
        self.out_dir = Path(out_dir)
        self.timeout_s, self.startup_s = timeout_s, startup_s
        self.expected = expected_ranks
        # rank -> (seq, monotonic time the supervisor saw it change, record)
        self.seen: dict[int, tuple[int, float, dict[str, Any]]] = {}

    def clear(self) -> None:
        """Remove beats of an earlier launch (before starting a new one)."""
        folder = heartbeat_dir(self.out_dir)
        if folder.is_dir():
            for path in folder.iterdir():
                path.unlink(missing_ok=True)

    def poll(self, now: float | None = None) -> Hang | None:
        """Read the beats; a `Hang` when the stage has been silent past its limit."""
        now = time.monotonic() if now is None else now
        for rank, record in read_heartbeats(self.out_dir).items():
            prev = self.seen.get(rank)
            if prev is None or prev[0] != record.get("seq"):
                self.seen[rank] = (record.get("seq"), now, record)
        if not self.seen:
            return None
        last_change = max(t for _, t, _ in self.seen.values())
        # A rank still loading keeps the others waiting in their first collective: the startup
        # allowance lasts until every rank has reached its training loop.
        starting = any(k not in self.seen for k in self.expected) or any(
            r.get("phase") in STARTUP_PHASES for _, _, r in self.seen.values()
        )
        limit = self.timeout_s + (self.startup_s if starting else 0.0)
        if now - last_change <= limit:
            return None
        ranks = [
            RankSilence(rank, r.get("pid"), r.get("step"), r.get("phase"), now - t)
            for rank, (_, t, r) in self.seen.items()
        ]
        ranks += [
            RankSilence(k, None, None, None, None) for k in self.expected if k not in self.seen
        ]

        # Behind first: a rank that never beat, then the lowest step, then the longest silent.
        def order(r: RankSilence) -> tuple[int, float, float]:
            if r.silent_s is None:
                return (0, 0.0, 0.0)
            return (1, -1.0 if r.step is None else float(r.step), -r.silent_s)

        return Hang(limit, sorted(ranks, key=order))
