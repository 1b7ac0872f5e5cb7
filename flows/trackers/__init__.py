"""Experiment trackers (TensorBoard, MLflow, W&B) fed from the one metrics stream.

Each stage's `metrics.jsonl` stays the source of truth; the flow process reads it (live, the
rest at the end, all at once for a reused stage) and hands the records to every enabled tracker.
Trackers live in the flow process, never in the ranks: a stalled tracker cannot stall a rank.
Each `Sink` is served by a daemon thread reading a bounded queue. A sink that raises, stalls past
`CALL_TIMEOUT_S` or fills its queue is given up: warned about once, its later records dropped
and counted, and the run report says so (`report_lines`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flows.report.tables import RunResult, StageRecord
from flows.stage.jsonl_tail import JsonlTail
from flows.stage.output import Poller, _start_thread, run_logger

log = logging.getLogger("posttrain.flows.trackers")

QUEUE_MAX = 10_000  # calls waiting for one sink; each `log` call is one poll's records
CALL_TIMEOUT_S = 60.0  # one call of a sink running longer than this: the sink is given up
FINISH_TIMEOUT_S = 30.0  # the most the end of the run waits for all trackers together
POLL_S = 2.0  # how often a running stage's metrics.jsonl is read
# Fields of a record that are not metrics.
NOT_METRICS = frozenset({"kind", "step", "total_steps", "time", "epoch_step"})


class Sink:
    """One tracker. Every method runs in the sink's own thread, in call order."""

    name = "tracker"
    link: str | None = None  # where to look at the run (a URL, a command line): set by start

    def start_pipeline(self, run_id: str, flow_run_id: str | None, recipe: dict[str, Any]) -> None:
        """A pipeline run begins. `recipe`: the resolved recipe (redacted), as JSON data."""

    def start_stage(self, stage: str, fingerprint: str) -> None:
        """A stage is launched (it may turn out to be reused: `end_stage` says)."""

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        """New metrics.jsonl records of `stage`."""

    def end_stage(self, record: StageRecord) -> None:
        """How the stage ended."""

    def finish(self, result: RunResult) -> None:
        """The run is recorded (its records, folder, images, export, promotion, failure)."""


def numeric_fields(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric top-level fields as `<kind>/<field>` (train/loss, eval/nll ...)."""
    kind = str(record.get("kind", "metrics"))
    return {
        f"{kind}/{k}": float(v)
        for k, v in record.items()
        if k not in NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool)
    }


def headline_metrics(headline: dict[str, Any]) -> dict[str, float]:
    """A stage's numeric headline (the evaluate stage's scores ...) as `headline/<key>`."""
    return {
        f"headline/{k}": float(v)
        for k, v in headline.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


class _Worker:
    """One sink's queue and thread; gives the sink up on its first error or stall."""

    def __init__(self, sink: Sink):
        self.sink = sink
        self.queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(QUEUE_MAX)
        self.failure: str | None = None
        self.dropped = 0  # metrics records not delivered after the failure
        self._busy_since: float | None = None
        self._lock = threading.Lock()
        self.thread = _start_thread(self._run, f"tracker-{sink.name}")

    def give_up(self, why: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = why
        dropped = "its records are dropped from here on; the run goes on and its report says so"
        run_logger().warning("experiment tracker %s failed (%s): %s", self.sink.name, why, dropped)

    def submit(self, method: str, *args: Any) -> None:
        busy = self._busy_since
        if busy is not None and time.monotonic() - busy > CALL_TIMEOUT_S:
            self.give_up(f"a call has not returned for {CALL_TIMEOUT_S:g} s")
        if self.failure is None:
            try:
                self.queue.put_nowait((method, args))
                return
            except queue.Full:
                self.give_up(f"{QUEUE_MAX} calls waiting: the tracker is too slow")
        if method == "log":
            self.dropped += len(args[1])

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            method, args = item
            if self.failure is not None:
                if method == "log":
                    self.dropped += len(args[1])
                continue
            self._busy_since = time.monotonic()
            try:
                getattr(self.sink, method)(*args)
            except Exception as exc:
                self.give_up(f"{method}: {type(exc).__name__}: {str(exc)[:300]}")
            finally:
                self._busy_since = None

    def close(self, deadline: float) -> None:
        with contextlib.suppress(queue.Full):
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self.give_up(f"still busy {FINISH_TIMEOUT_S:g} s after the run ended")


class Trackers:
    """Fans the run's events out to the enabled sinks; thread-safe (stages run side by side)."""

    def __init__(self, sinks: list[Sink]):
        self.workers = [_Worker(s) for s in sinks]
        self._seen: dict[str, set[tuple[str, Any]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _all(self, method: str, *args: Any) -> None:
        for w in self.workers:
            w.submit(method, *args)

    def start_pipeline(self, run_id: str, flow_run_id: str | None, recipe: dict[str, Any]) -> None:
        self._all("start_pipeline", run_id, flow_run_id, recipe)

    def start_stage(self, stage: str, fingerprint: str, metrics: Path) -> StageFeed:
        """Announce the stage and follow its metrics.jsonl; `StageFeed.stop` reads the rest."""
        self._all("start_stage", stage, fingerprint)
        return StageFeed(self, stage, metrics)

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        # A resumed stage rewrites metrics.jsonl with the records up to its checkpoint: what
        # was sent already is not sent twice.
        with self._lock:
            seen = self._seen.setdefault(stage, set())
            fresh = []
            for r in records:
                # Health samples come every few seconds, several within one long step.
                when = r.get("time") if r.get("kind") == "health" else None
                key = (str(r.get("kind")), r.get("step"), when)
                if key[1] is not None and key in seen:
                    continue
                seen.add(key)
                fresh.append(r)
        if fresh:
            self._all("log", stage, fresh)

    def end_stage(self, record: StageRecord) -> None:
        self._all("end_stage", record)

    def finish(self, result: RunResult, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Last call: hand over the run's files and wait (bounded) for every sink to drain."""
        if self._closed:
            return
        self._closed = True
        self._all("finish", result)
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.close(deadline)

    def report_lines(self) -> list[str]:
        """The report's tracking section: each tracker, where to look, what went wrong."""
        lines = []
        for w in self.workers:
            where = f": {w.sink.link}" if w.sink.link else ""
            line = f"- {w.sink.name}{where}"
            if w.failure is not None:
                line += f" — **failed** ({w.failure}); {w.dropped} metrics records dropped"
            lines.append(line)
        return lines


class StageFeed(Poller):
    """Follows one stage's metrics.jsonl and sends new records to the trackers every POLL_S;
    `stop` reads what is left (for a reused stage: the whole kept file, at once)."""

    def __init__(self, trackers: Trackers, stage: str, path: Path):
        self.trackers, self.stage, self.path = trackers, stage, path
        self._tail = JsonlTail(path)
        self._poll_lock = threading.Lock()
        self.interval_s = POLL_S
        self._start(f"{stage}-tracking")

    def poll(self) -> None:
        with self._poll_lock:
            records = self._tail.read()
        if records:
            self.trackers.log(self.stage, records)

    def _failed(self, exc: Exception) -> None:
        log.debug("metrics feed of %s failed: %s", self.stage, exc)


def open_trackers(tracking: Any, run_dir: Path, stages: Sequence[Any] = ()) -> Trackers:
    """The sinks `tracking` (the recipe's TrackingConfig) enables. A tracker whose package is
    missing is reported as failed, not raised. `stages`: the run's planned stages (Prometheus
    shows the pending ones and reads their folders)."""
    sinks: list[Sink] = []
    args: dict[str, tuple[Any, ...]] = {
        "tensorboard": (run_dir,) if tracking.tensorboard else (),
        "mlflow": (tracking.mlflow,) if tracking.mlflow is not None else (),
        "wandb": (tracking.wandb, run_dir) if tracking.wandb is not None else (),
        "prometheus": (tracking.prometheus, stages) if tracking.prometheus is not None else (),
    }
    for name, given in ((n, a) for n, a in args.items() if a):
        try:
            sinks.append(_sink(name)(*given))
        except Exception as exc:
            sinks.append(_Unavailable(name, f"{type(exc).__name__}: {exc}"))
    trackers = Trackers(sinks)
    for w in trackers.workers:
        if isinstance(w.sink, _Unavailable):
            w.give_up(w.sink.why)
    return trackers


def _sink(name: str) -> Callable[..., Sink]:
    # Imported only when enabled: mlflow and wandb are optional extras, and each costs
    # seconds to import.
    import importlib

    module = importlib.import_module(f"flows.trackers.{name}")
    return module.SINK


class _Unavailable(Sink):
    """A tracker that could not be set up (its extra not installed ...)."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why
