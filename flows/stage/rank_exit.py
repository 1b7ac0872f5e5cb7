"""Which rank of a failed torchrun stage died first, and how, in one line a person can act on.

torchrun's failure summary names the rank that failed first (the others' exits are its
consequences):

    Root Cause (first observed failure):
    [0]:
      time      : 2026-12-01_07:40:47
      host      : localhost
      rank      : 1 (local_rank: 1)
      exitcode  : -9 (pid: 4114)  (SIGKILL)
      error_file: <N/A>
      traceback : Signal 9 (SIGKILL) received by PID 4114

`root_causes` reads that block; `describe_exit` adds the rank's last heartbeat: `rank 1 (pid
4114) was killed by SIGKILL; its last heartbeat: step 7, phase train, 2 s before`.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_ROOT_CAUSE = "Root Cause (first observed failure):"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?")
_HOST = re.compile(r"^\s*host\s*:\s*(\S+)")


@dataclass(frozen=True)
class RankExit:
    rank: int
    exitcode: int  # negative: killed by that signal (Popen's convention, which torchrun keeps)
    pid: int | None = None
    host: str | None = None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def how_it_ended(exitcode: int) -> str:
    return (
        f"was killed by {signal_name(-exitcode)}"
        if exitcode < 0
        else f"exited with code {exitcode}"
    )


def root_causes(lines: Iterable[str]) -> list[RankExit]:
    """The ranks the last torchrun summary names as the root cause (a log can hold several
    launches); empty without one (one process, or the agent itself killed)."""
    found: list[RankExit] = []
    inside = False
    rank: int | None = None
    host: str | None = None
    for line in lines:
        if _ROOT_CAUSE in line:
            found, inside, rank, host = [], True, None, None
            continue
        if not inside:
            continue
        if line.strip().startswith("====="):
            inside = False
        elif m := _HOST.match(line):
            host = m.group(1)
        elif m := _RANK.match(line):
            rank = int(m.group(1))
        elif (m := _EXITCODE.match(line)) and rank is not None:
            pid = int(m.group(2)) if m.group(2) else None
            found.append(RankExit(rank, int(m.group(1)), pid, host))
            rank = host = None
    return found


def describe_beat(beat: dict[str, Any] | None, now: float | None = None) -> str:
    """`step 7, phase train, 2 s before` from a beat record (see heartbeat.Heartbeat.beat)."""
    if not beat:
        return "none (it died before its first beat)"
    now = time.time() if now is None else now
    step = beat.get("step")
    where = "before its first step" if step is None else f"step {step}"
    parts = [where, f"phase {beat.get('phase')}"]
    if isinstance(beat.get("time"), int | float):
        parts.append(f"{max(0.0, now - beat['time']):.0f} s before")
    return ", ".join(parts)


def describe_exit(
    exit: RankExit, beats: dict[int, dict[str, Any]], now: float | None = None
) -> str:
    """One line: which rank, which process, how it ended, and where it was."""
    pid = exit.pid if exit.pid is not None else (beats.get(exit.rank) or {}).get("pid")
    who = f"rank {exit.rank}" + (f" (pid {pid})" if pid else "")
    if exit.host and exit.host not in ("localhost", "127.0.0.1"):
        who += f" on {exit.host}"
    beat = describe_beat(beats.get(exit.rank), now)
    return f"{who} {how_it_ended(exit.exitcode)}; its last heartbeat: {beat}"
