"""What `posttrain run` shows on its terminal, besides Prefect's run/task lines: live training
progress, and nothing of a failure but the closing block (`flows.failure_block`).

Only the CLI installs these: a served flow has no terminal (its output goes to the UI and
`logs/stage.log`). On the console, the stage's output, Prefect's notes on the embedded server
and Prefect's repeats of a failure are dropped (the closing block says it once). Known failures
keep their message and lose their traceback of orchestration frames, in the UI too
(`quiet_known_failures`); a bug keeps it. Progress is one line per training stage
(`sft  step 120/400 · loss 1.23 · 5,100 tok/s · ETA 2m 10s`), redrawn in place on a TTY, else a
plain line at most every `POSTTRAIN_PROGRESS_EVERY_S` seconds (default 10): a log never floods.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any, TextIO

from prefect.exceptions import FailedRun
from prefect.logging.handlers import PrefectConsoleHandler

from flows.report.tables import format_duration
from flows.stage.failures import QualityGateFailed, StageFailed
from flows.stage.output import STAGE_OUTPUT, STEP_FIELDS, add_step_listener, remove_step_listener
from posttrain.config.loader import RecipeError
from posttrain.plan.selection import SelectionError

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# Prefect's (and our supervisor's) repeats of a failure the closing block states once.
REPEATS = re.compile(
    r"^(Finished in state (Failed|Crashed)|Task run failed with exception|"
    r"Encountered exception during execution|stage \S+: (timeout after|no heartbeat for))"
)
# Prefect's own lines about the embedded server `posttrain run` starts and stops.
EMBEDDED_SERVER_NOTES = ("Starting temporary server", "Stopping temporary server")
EVERY_ENV = "POSTTRAIN_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 10.0


class QuietConsole(logging.Filter):
    """On the console handler only: drop stage output lines and failure repeats."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, STAGE_OUTPUT, None) is not None:
            return False
        if record.name == "prefect" and record.getMessage().startswith(EMBEDDED_SERVER_NOTES):
            # The embedded server's start (its URL, dead once the run ends, and a pointer to
            # Prefect's docs on running a server) and its exit hook's stop: neither is the run.
            return False
        if record.name in RUN_LOGGERS or record.name.startswith(RUN_LOGGERS):
            if record.exc_info and record.levelno >= logging.ERROR:
                return False
            if REPEATS.match(record.getMessage()):
                return False
        return True


def quiet_console() -> None:
    """Install `QuietConsole` on Prefect's console handlers (the UI still gets everything)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, PrefectConsoleHandler) and not any(
            isinstance(f, QuietConsole) for f in handler.filters
        ):
            handler.addFilter(QuietConsole())


class _Rate:
    """Steps per second of one stage, from the first step this printer saw to the newest."""

    def __init__(self, step: float, now: float):
        self.first = (step, now)

    def eta(self, step: float, total: float, now: float) -> float | None:
        step0, t0 = self.first
        if step <= step0 or now <= t0:
            return None
        return (total - step) * (now - t0) / (step - step0)


def progress_text(stage: str, record: dict[str, Any], eta_s: float | None) -> str:
    """`sft  step 120/400 · loss 1.23 · 5,100 tok/s · ETA 2m 10s` (an RL step's reward first)."""
    parts = [f"step {record['step']:g}/{record['total_steps']:g}"]
    for key, fmt in STEP_FIELDS.items():
        if isinstance(value := record.get(key), int | float):
            parts.append(fmt.format(value))
    if eta_s is not None:
        parts.append(f"ETA {format_duration(round(eta_s))}")
    return f"{stage}  " + " · ".join(parts)


class ProgressPrinter:
    """Prints each stage's newest training record (from the stages' tail threads); one lock
    keeps lines whole."""

    def __init__(self, stream: TextIO, tty: bool | None = None, every_s: float | None = None):
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        if every_s is None:
            try:
                every_s = float(os.environ.get(EVERY_ENV) or DEFAULT_EVERY_S)
            except ValueError:  # a typo in the variable must not fail the run
                every_s = DEFAULT_EVERY_S
        self.every_s = every_s
        self._lock = threading.Lock()
        self._rates: dict[str, _Rate] = {}
        self._shown: dict[str, str] = {}  # stage -> its newest text (TTY line)
        self._printed_at: dict[str, float] = {}  # stage -> when its last plain line went out
        self._drawn = False  # a TTY line is on screen, to be cleared before other output

    def on_step(self, stage: str, record: dict[str, Any]) -> None:
        step, total = record.get("step"), record.get("total_steps")
        if not isinstance(step, int | float) or not isinstance(total, int | float) or total <= 0:
            return
        now = time.monotonic()
        with self._lock:
            rate = self._rates.setdefault(stage, _Rate(step, now))
            text = progress_text(stage, record, rate.eta(step, total, now))
            done = step >= total
            if self.tty:
                if done:
                    self._shown.pop(stage, None)
                    self._write_line(text)  # the stage's final figures stay on screen
                else:
                    self._shown[stage] = text
                self._redraw()
                return
            last = self._printed_at.get(stage)
            if last is None or done or now - last >= self.every_s:
                self._printed_at[stage] = now
                self._write(text + "\n")

    def clear(self) -> None:
        """Take the TTY line off the screen (before other output, and at the end)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        if self._drawn:
            self._write("\r\x1b[K")
            self._drawn = False

    def _write_line(self, text: str) -> None:
        self._clear()
        self._write(text + "\n")

    def _redraw(self) -> None:
        self._clear()
        if self._shown:
            self._write(" | ".join(self._shown.values()))
            self._drawn = True

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed terminal: progress is decoration
            pass


class ClearBeforeLog(logging.Filter):
    """On the console handler: clear the TTY progress line before a log line is printed."""

    def __init__(self, printer: ProgressPrinter):
        super().__init__()
        self.printer = printer

    def filter(self, record: logging.LogRecord) -> bool:
        self.printer.clear()
        return True


def attach_progress(printer: ProgressPrinter) -> None:
    """Feed `printer` from every stage's metrics tail in this process."""
    add_step_listener(printer.on_step)
    if printer.tty:
        for handler in logging.getLogger().handlers:
            if isinstance(handler, PrefectConsoleHandler):
                handler.addFilter(ClearBeforeLog(printer))


def detach_progress(printer: ProgressPrinter) -> None:
    remove_step_listener(printer.on_step)
    printer.clear()
    for handler in logging.getLogger().handlers:
        for f in [f for f in handler.filters if isinstance(f, ClearBeforeLog)]:
            handler.removeFilter(f)


# The failures posttrain raises and explains: the one line says it all (flows.failure_block).
KNOWN_FAILURES = (StageFailed, QualityGateFailed, RecipeError, SelectionError)


class DropKnownTracebacks(logging.Filter):
    """Known failures keep their message, not their traceback. Prefect's `FailedRun` record is
    dropped whole: Prefect raises it for a flow that returned a Failed state (a served run's
    known failure) and logs it with a traceback of its frames, after the reason was logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, FailedRun):
            return False
        if isinstance(exc, KNOWN_FAILURES):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_known_failures() -> None:
    """Install `DropKnownTracebacks` on Prefect's run loggers (once per process)."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropKnownTracebacks) for f in logger.filters):
            logger.addFilter(DropKnownTracebacks())
