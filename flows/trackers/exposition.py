"""A run's stages as Prometheus series (names in `flows.trackers.prom_names`).

`RunSeries` gets each stage's status from the flow (`set_status`) and reads everything else at
scrape time (`collect`), so a scrape is as fresh as the files: metrics.jsonl, heartbeats (a
beat's age measured on this process's monotonic clock from when it saw the beat change, as the
hang watch does, so ranks on machines with other clocks are judged alike) and health samples,
from every node through the shared workspace. A stage that is not running exports no per-rank
series: an ended stage's last beat would age into a false hang alert.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from flows.stage.jsonl_tail import JsonlTail
from flows.trackers import health_series
from flows.trackers.prom_names import BY_NAME
from posttrain.telemetry.heartbeat import read_heartbeats

GIB = 1024**3
STATUSES = ("pending", "running", "ran", "reused", "failed")
# train-record field -> gauge (the same value, base units)
TRAIN_GAUGES = {
    "step_time_s": "posttrain_step_seconds",
    "tokens_per_s": "posttrain_tokens_per_second",
    "tokens_per_s_per_device": "posttrain_tokens_per_second_per_device",
    "tflops_per_device": "posttrain_tflops_per_device",
    "mfu": "posttrain_mfu_ratio",
    "loss": "posttrain_loss",
    "grad_norm": "posttrain_grad_norm",
}
MEMORY_GAUGES = {  # GiB fields -> bytes gauges
    "mem_allocated_gib": "posttrain_memory_allocated_bytes",
    "mem_reserved_gib": "posttrain_memory_reserved_bytes",
    "mem_peak_allocated_gib": "posttrain_memory_peak_allocated_bytes",
    "mem_peak_reserved_gib": "posttrain_memory_peak_reserved_bytes",
    "mem_rss_gib": "posttrain_memory_rss_bytes",
    "mem_peak_rss_gib": "posttrain_memory_peak_rss_bytes",
}
COUNTERS = {
    "skipped_updates": "posttrain_skipped_updates_total",
    "nonfinite_updates": "posttrain_nonfinite_updates_total",
}
# RL phases: the record's share when it has one, else its seconds over the step's
RL_PHASES = {
    "generation": ("generation_share", "generation_s"),
    "scoring": ("scoring_share", "scoring_s"),
    "update": ("update_share", "training_s"),
    "tool": ("tool_share", None),
}
CLOCK_SLACK_S = 5.0
ETA_WINDOW = 20  # recent (time, step) points the step rate is measured over


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass
class StageSeries:
    """One stage's latest values. `hang_timeout_s`: None for stages without a hang watch."""

    name: str
    kind: str
    out_dir: Path
    hang_timeout_s: float | None = None
    status: str = "pending"
    gauges: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    steps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=ETA_WINDOW))
    # rank -> (beat seq, monotonic time this process saw it change)
    beats: dict[int, tuple[Any, float]] = field(default_factory=dict)
    tail: JsonlTail | None = None
    started: float = 0.0  # wall time of this launch: older health files are an earlier one's
    counted_step: float = -1.0  # counters add only steps past this (a resume rewrites the file)

    def read_records(self) -> None:
        """Take in what metrics.jsonl gained since the last read."""
        if self.tail is None:
            self.tail = JsonlTail(self.out_dir / "metrics.jsonl")
        for record in self.tail.read():
            self.observe(record)

    def observe(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "train":
            self._train(record)
        elif kind == "eval" and (loss := _number(record.get("eval_loss"))) is not None:
            self.gauges["posttrain_eval_loss"] = loss

    def _train(self, r: dict[str, Any]) -> None:
        for key, name in TRAIN_GAUGES.items():
            if (v := _number(r.get(key))) is not None:
                self.gauges[name] = v
        for key, name in MEMORY_GAUGES.items():
            if (v := _number(r.get(key))) is not None:
                self.gauges[name] = v * GIB
        alloc, reserved = _number(r.get("mem_allocated_gib")), _number(r.get("mem_reserved_gib"))
        if alloc is not None and reserved is not None:
            gap = (reserved - alloc) * GIB
            self.gauges["posttrain_memory_reserved_minus_allocated_bytes"] = gap
        step = _number(r.get("step")) or 0.0
        fresh = step > self.counted_step
        self.counted_step = max(self.counted_step, step)
        for key, name in COUNTERS.items():
            add = (_number(r.get(key)) or 0.0) if fresh else 0.0
            self.counters[name] = self.counters.get(name, 0.0) + add
        step_s, wait_s = _number(r.get("step_time_s")), _number(r.get("data_wait_s"))
        if step_s and wait_s is not None:
            self.gauges["posttrain_data_wait_ratio"] = wait_s / step_s
        self._rl(r, step_s)
        self._progress(r)

    def _rl(self, r: dict[str, Any], step_s: float | None) -> None:
        for phase, (share_key, seconds_key) in RL_PHASES.items():
            share = _number(r.get(share_key))
            if share is None and seconds_key and step_s:
                seconds = _number(r.get(seconds_key))
                share = None if seconds is None else seconds / step_s
            if share is not None:
                self.phases[phase] = share
        # `kl` only: the step's KL to the reference by the recipe's estimator. `approx_kl` is
        # the update's distance from the sampling policy, another quantity: a step that did
        # not score its KL (kl.coef 0) leaves the gauge as it was rather than relabel it.
        for name, keys in (
            ("posttrain_rl_reward", ("score_mean", "reward_mean")),
            ("posttrain_rl_kl", ("kl",)),
        ):
            value = next((v for k in keys if (v := _number(r.get(k))) is not None), None)
            if value is not None:
                self.gauges[name] = value

    def _progress(self, r: dict[str, Any]) -> None:
        step, total = _number(r.get("step")), _number(r.get("total_steps"))
        if step is None:
            return
        self.gauges["posttrain_stage_step"] = step
        if self.steps and step < self.steps[-1][1]:
            self.steps.clear()  # a resumed stage starts its rate again
        self.steps.append((_number(r.get("time")) or time.time(), step))
        if not total:
            return
        self.gauges["posttrain_stage_total_steps"] = total
        self.gauges["posttrain_stage_progress_ratio"] = step / total
        (t0, s0), (t1, s1) = self.steps[0], self.steps[-1]
        if s1 > s0 and t1 > t0:
            self.gauges["posttrain_stage_eta_seconds"] = (total - step) * (t1 - t0) / (s1 - s0)

    def heartbeat_ages(self, now: float, wall: float) -> dict[int, tuple[dict, float]]:
        """rank -> (its beat, seconds since the beat last advanced)."""
        out = {}
        for rank, beat in read_heartbeats(self.out_dir).items():
            seen = self.beats.get(rank)
            if seen is None or seen[0] != beat.get("seq"):
                # First sight: as old as its own timestamp says (never negative: clocks differ).
                age = max(0.0, wall - float(beat.get("time") or wall)) if seen is None else 0.0
                seen = (beat.get("seq"), now - age)
                self.beats[rank] = seen
            out[rank] = (beat, now - seen[1])
        return out


class RunSeries:
    """Every stage of one pipeline run; thread-safe (fed by the trackers' thread, read by the
    HTTP server's)."""

    def __init__(self, run: str, recipe: str, flow_run: str | None = None):
        self.run, self.recipe, self.flow_run = run, recipe, flow_run or ""
        self.stages: dict[str, StageSeries] = {}
        self._lock = threading.Lock()

    def add_stage(
        self, name: str, kind: str, out_dir: Path, hang_timeout_s: float | None = None
    ) -> None:
        with self._lock:
            self.stages[name] = StageSeries(name, kind or name, Path(out_dir), hang_timeout_s)

    def set_status(self, stage: str, status: str) -> None:
        """`running` when launched; ran, reused or failed when it ended. A stage that ran or
        failed has its last records read; a reused one's are history, not this run's."""
        with self._lock:
            series = self.stages.get(stage)
            if series is None:
                return
            if status == "running":
                series.beats.clear()  # an earlier launch's beats are not this one's
                series.started = time.time()
                # Counters exist from the start at 0: Prometheus's increase() takes a counter's
                # first value as its baseline, so one born at 1 would hide its first event.
                for name in COUNTERS.values():
                    series.counters.setdefault(name, 0.0)
            elif status != "reused" and series.status == "running":
                series.read_records()
            series.status = status

    def describe(self) -> list[Metric]:
        return []  # no fixed set: series come and go with the stages

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = _Families()
            families.add("posttrain_run_info", [self.run, self.recipe, self.flow_run], 1.0)
            now, wall = time.monotonic(), time.time()
            for s in self.stages.values():
                if s.status == "running":
                    s.read_records()
                    self._ranks(families, s, now, wall)
                self._stage(families, s)
        yield from families.metrics()

    def _stage(self, families: _Families, s: StageSeries) -> None:
        base = [self.run, self.recipe, s.name, s.kind]
        for status in STATUSES:
            families.add("posttrain_stage_status", [*base, status], float(s.status == status))
        if s.hang_timeout_s:
            families.add("posttrain_hang_timeout_seconds", base, s.hang_timeout_s)
        for name, value in (*s.gauges.items(), *s.counters.items()):
            families.add(name, base, value)
        for phase, share in s.phases.items():
            families.add("posttrain_rl_phase_ratio", [*base, phase], share)

    def _ranks(self, families: _Families, s: StageSeries, now: float, wall: float) -> None:
        base = [self.run, self.recipe, s.name, s.kind]
        for rank, (beat, age) in sorted(s.heartbeat_ages(now, wall).items()):
            labels = [*base, str(rank), str(beat.get("node") or "")]
            families.add("posttrain_heartbeat_age_seconds", labels, age)
            if (step := _number(beat.get("step"))) is not None:
                families.add("posttrain_heartbeat_step", labels, step)
        # An earlier launch's files (more ranks than this one) are not this launch's; a few
        # seconds allow for another node's clock.
        for name, labels, value in health_series.samples(s.out_dir, s.started - CLOCK_SLACK_S):
            families.add(name, [*base, *labels], value)


class _Families:
    """Metric families built during one scrape, in the table's order of first use."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def add(self, name: str, labels: list[str], value: float) -> None:
        family = self._families.get(name)
        if family is None:
            spec = BY_NAME[name]
            if spec.type == "counter":  # prometheus_client appends `_total` to a counter's name
                family = CounterMetricFamily(
                    name.removesuffix("_total"), spec.help, labels=spec.labels
                )
            else:
                family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            self._families[name] = family
        if not math.isnan(value) or family.type == "gauge":
            family.add_metric(labels, value)

    def metrics(self) -> list[Metric]:
        return list(self._families.values())
