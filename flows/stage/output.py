"""A stage's output copied to its log file and the Prefect run logger, and its metrics.jsonl
tailed into a progress artifact. Decoration never fails a stage: problems are swallowed here."""

from __future__ import annotations

import contextvars
import logging
import re
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.logging import get_run_logger
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from flows.stage.jsonl_tail import JsonlTail
from posttrain.errors import ERROR_MARKER

ARTIFACT_MARKER = "POSTTRAIN_ARTIFACT "
# A remote engine's launch prefixes each line with the node it came from (`[node 1] ...`);
# the marker and torchrun's failure summary are read without it.
NODE_PREFIX = re.compile(r"^\[node \d+\] ")
TAIL_LINES = 30
# Lines kept to find torchrun's failure summary in (it follows the ranks' tracebacks).
SUMMARY_LINES = 400
PROGRESS_INTERVAL_S = 2.0
STAGE_OUTPUT = "posttrain_stage_output"  # LogRecord attribute on a stage's output lines

# Who else wants each stage's newest training record, `(stage, record)`: the CLI's terminal
# printer (flows.terminal). Empty under `posttrain serve` and deployments: nothing is printed.
_step_listeners: list[Callable[[str, dict[str, Any]], None]] = []


def add_step_listener(listener: Callable[[str, dict[str, Any]], None]) -> None:
    _step_listeners.append(listener)


def remove_step_listener(listener: Callable[[str, dict[str, Any]], None]) -> None:
    if listener in _step_listeners:
        _step_listeners.remove(listener)


def run_logger() -> logging.LoggerAdapter | logging.Logger:
    """Prefect's run logger inside a task; a plain logger when called outside Prefect (tests)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("posttrain.flows")


def _start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    # Prefect's run context and settings live in contextvars, which a new thread does not
    # inherit: run the thread inside a copy so logs and artifacts land on this task run.
    ctx = contextvars.copy_context()
    t = threading.Thread(target=ctx.run, args=(target,), name=name, daemon=True)
    t.start()
    return t


class OutputPump:
    """Copies the output to the log file and the run logger, keeps the last lines for error
    messages and catches the POSTTRAIN_ARTIFACT line."""

    def __init__(
        self,
        stream: Iterable[str],
        log_file: IO[str],
        log: logging.LoggerAdapter | logging.Logger,
        stage: str,
    ):
        self.stream, self.log_file, self.log, self.stage = stream, log_file, log, stage
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.recent: deque[str] = deque(maxlen=SUMMARY_LINES)
        self.artifact_json: str | None = None
        # The last verdict line (POSTTRAIN_ERROR) and up to TAIL_LINES after it: torchrun's
        # closing report of a multi-rank stage is longer than the tail and would push it out.
        self.verdict: list[str] = []
        self.thread = _start_thread(self._run, f"{stage}-output")

    def _run(self) -> None:
        for raw in self.stream:
            line = raw.rstrip("\n")
            body = NODE_PREFIX.sub("", line, count=1)
            self.tail.append(line)
            self.recent.append(body)
            if body.startswith(ARTIFACT_MARKER):
                self.artifact_json = body[len(ARTIFACT_MARKER) :]
            if body.startswith(ERROR_MARKER):
                self.verdict = [line]
            elif self.verdict and len(self.verdict) < TAIL_LINES:
                self.verdict.append(line)
            try:
                self.log_file.write(line + "\n")
                self.log_file.flush()
                # Marked, so the CLI can keep it off the terminal (flows.terminal); it still
                # goes to the UI, and the log file has it above.
                self.log.info("[%s] %s", self.stage, line, extra={STAGE_OUTPUT: self.stage})
            except Exception:
                # Keep draining whatever happens (disk full, logging down): a child writing
                # into a full pipe nobody reads would block until its timeout.
                pass

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    def tail_text(self) -> str:
        """The last TAIL_LINES lines, after the last verdict and its lines when they fell out
        of them (the failure block is read from this text)."""
        tail = list(self.tail)
        if self.verdict and self.verdict[0] not in tail:
            tail = [*self.verdict, "...", *tail]
        return "\n".join(tail)


# An RL step's mean reward over its rollout (posttrain.rl.metrics.train_metrics): the combined
# score of the reward model and/or functions, the figure that says whether RL is learning.
REWARD_FIELD = "score_mean"
# A training step's figures as the progress artifact and the terminal show them (reward first:
# a group-relative loss is 0 whenever a group's rewards tie).
STEP_FIELDS = {REWARD_FIELD: "reward {:.4g}", "loss": "loss {:.4g}"}
STEP_FIELDS["tokens_per_s"] = "{:,.0f} tok/s"


def progress_from_record(record: dict[str, Any]) -> tuple[float, str] | None:
    """(percent, description) from one metrics.jsonl line; None unless it is a training step."""
    if record.get("kind") != "train":
        return None
    step, total = record.get("step"), record.get("total_steps")
    if not isinstance(step, int | float) or not isinstance(total, int | float) or total <= 0:
        return None
    parts = [f"step {step:g}/{total:g}"]
    for key, fmt in {**STEP_FIELDS, "mfu": "MFU {:.1%}"}.items():
        if isinstance(value := record.get(key), int | float):
            parts.append(fmt.format(value))
    return min(100.0, max(0.0, 100.0 * step / total)), " · ".join(parts)


class Poller:
    """Calls `poll` every `interval_s` seconds on its own thread, and once more at `stop`. What
    it feeds is decoration: a failed poll is logged (debug) and never fails the stage."""

    interval_s: float

    def _start(self, name: str) -> None:
        self._stop = threading.Event()
        self.thread = _start_thread(self._run, name)

    def poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._safe_poll()

    def _safe_poll(self) -> None:
        try:
            self.poll()
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        logging.getLogger("posttrain.flows").debug("progress update failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self._safe_poll()  # what was written last


class MetricsTail(Poller):
    """Follows metrics.jsonl and reports training progress every `interval_s` seconds."""

    def __init__(
        self,
        path: Path,
        report: Callable[[float, str], None],
        interval_s: float = PROGRESS_INTERVAL_S,
        stage: str | None = None,
    ):
        self.path, self.report, self.interval_s = path, report, interval_s
        self.stage = stage  # named to the step listeners; None: they are not told
        self._tail = JsonlTail(path)
        self._last: tuple[float, str] | None = None
        self._start(f"{path.parent.name}-metrics")

    def poll(self) -> None:
        """Read the lines appended since the last poll; report the newest training step."""
        latest, newest = None, None
        for record in self._tail.read():
            if progress := progress_from_record(record):
                latest, newest = progress, record
        if latest is not None and latest != self._last:
            self._last = latest
            self.report(*latest)
            if self.stage is not None and newest is not None:
                for listener in list(_step_listeners):
                    listener(self.stage, newest)


class ProgressArtifact:
    """A Prefect progress artifact for one stage run; does nothing outside a task run."""

    def __init__(self, stage: str):
        self.stage = stage
        self.id = None
        if TaskRunContext.get() is None:
            return
        try:
            self.id = create_progress_artifact(
                0.0, key=f"{artifact_key(stage)}-progress", description=f"{stage}: starting"
            )
        except Exception as exc:  # progress is decoration: never fail a stage over it
            run_logger().warning("no progress artifact for %s: %s", stage, exc)

    def update(self, percent: float, description: str) -> None:
        if self.id is None:
            return
        try:
            # No retries: while the server is away a retried update would hold the caller (the
            # supervisor, for the last one) for a minute or more; the next update comes anyway.
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
                update_progress_artifact(
                    self.id, percent, description=f"{self.stage}: {description}"
                )
        except Exception as exc:
            logging.getLogger("posttrain.flows").debug("progress update failed: %s", exc)


def artifact_key(text: str) -> str:
    """Prefect artifact keys allow only lowercase letters, digits and dashes."""
    key = "".join(c if c.isalnum() else "-" for c in text.lower())
    return "-".join(part for part in key.split("-") if part) or "stage"
