"""The per-rank health sampler: a daemon thread that reads the GPU (NVML), the InfiniBand ports
and the process's storage reads every `interval_s` and replaces
`<out_dir>/logs/health/rank<k>.json` atomically (tmp file + `os.replace`, like heartbeats), so
the flow's Prometheus exporter never reads half a sample. Rank 0 also appends each sample to
metrics.jsonl as one flat `kind: "health"` record once the stage's MetricsWriter exists
(`attach_writer`: the writer truncates the file on a fresh start, so earlier records would be
lost). The schema is the monitoring contract's (issue 30).

A source that is absent writes no entries (never zeros); `sources` says why in one line. A
sampler error never fails the stage: it is logged once and the next interval tries again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from posttrain.telemetry import heartbeat
from posttrain.telemetry.health.infiniband import InfinibandSource
from posttrain.telemetry.health.io import IoSource
from posttrain.telemetry.health.nvml import NvmlSource, cuda_pci_bus_id

log = logging.getLogger("posttrain.health")

HEALTH_DIR = Path("logs") / "health"
INTERVAL_ENV = "POSTTRAIN_HEALTH_INTERVAL_S"
DEFAULT_INTERVAL_S = 5.0


def health_dir(out_dir: Path) -> Path:
    return Path(out_dir) / HEALTH_DIR


def interval_from_env() -> float:
    """POSTTRAIN_HEALTH_INTERVAL_S, default 5 s; 0 turns sampling off. A value that is not a
    number is a warning, not a failed stage."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        log.warning(
            "%s=%r is not a number: sampling every %s s", INTERVAL_ENV, raw, DEFAULT_INTERVAL_S
        )
        return DEFAULT_INTERVAL_S


def cuda_index_of(device: Any = None) -> int | None:
    """This rank's CUDA device index: `device`'s (a torch.device), else the current device when
    this process has already started CUDA. Never starts CUDA itself (that would take device
    memory and break a later fork), and asks in the caller's thread: the current device is
    per-thread, so the sampler thread would see device 0 on every rank."""
    if device is not None:
        if getattr(device, "type", None) != "cuda":
            return None
        if device.index is not None:
            return int(device.index)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def default_sources(cuda_index: int | None) -> dict[str, Any]:
    bus_id = None
    if cuda_index is not None:
        try:
            bus_id = cuda_pci_bus_id(cuda_index)
        except Exception as exc:  # an old torch, a device torch cannot describe
            log.debug("no PCI bus id for CUDA device %s: %s", cuda_index, exc)
    return {
        "nvml": NvmlSource(cuda_index, bus_id=bus_id),
        "infiniband": InfinibandSource(),
        "io": IoSource(),
    }


def _key(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", str(text))


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def flatten_health(sample: dict[str, Any]) -> dict[str, float]:
    """One sample as flat numeric fields for metrics.jsonl: gpu<i>_<field>,
    gpu<i>_throttle_<reason> (0/1), ib_<device>_<port>_{tx,rx}_bytes_per_s, ib_<device>_<port>_
    errors and _retransmits (sums of the totals), io_read_bytes_per_s. Absent values stay
    absent."""
    flat: dict[str, float] = {}
    for pos, gpu in enumerate(sample.get("gpus", [])):
        prefix = f"gpu{gpu.get('index', pos)}"
        for field, value in gpu.items():
            if field == "throttle":
                flat |= {f"{prefix}_throttle_{r}": int(bool(on)) for r, on in value.items()}
            elif field != "index" and _is_number(value):
                flat[f"{prefix}_{field}"] = value
    for port in sample.get("ib_ports", []):
        prefix = f"ib_{_key(port['device'])}_{_key(port['port'])}"
        for field in ("tx_bytes_per_s", "rx_bytes_per_s"):
            if field in port:
                flat[f"{prefix}_{field}"] = port[field]
        for group in ("errors", "retransmits"):
            if port.get(group):  # none readable: no sum (a made-up 0 would read as healthy)
                flat[f"{prefix}_{group}"] = sum(port[group].values())
    io = sample.get("io") or {}
    if "read_bytes_per_s" in io:
        flat["io_read_bytes_per_s"] = io["read_bytes_per_s"]
    return flat


def read_health(out_dir: Path) -> dict[int, dict[str, Any]]:
    """The latest sample of every rank that has written one, by rank; a file that is
    unreadable, partial or foreign is skipped (the next poll sees the next sample)."""
    return heartbeat.read_rank_files(health_dir(out_dir))


def sources_line(sources: dict[str, str]) -> str:
    """`health: nvml absent (why), infiniband present, io present`."""

    def one(name: str, status: str) -> str:
        why = status.removeprefix("absent:").strip()
        return f"{name} {status}" if status == "present" else f"{name} absent ({why})"

    return "health: " + ", ".join(one(n, s) for n, s in sources.items())


class HealthSampler:
    """One rank's sampler. `start` takes the first sample at once (in the caller's thread),
    then a daemon thread samples every `interval_s`; `stop` joins it. `sources`: name ->
    source (tests); default NVML for `cuda_index`, InfiniBand, this process's I/O."""

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        interval_s: float,
        metrics_writer: Any = None,
        *,
        cuda_index: int | None = None,
        sources: dict[str, Any] | None = None,
    ):
        self.rank, self.interval_s = rank, interval_s
        self.path = health_dir(out_dir) / f"rank{rank}.json"
        self._tmp = self.path.with_name(f".rank{rank}.json.tmp")
        self.sources = sources if sources is not None else default_sources(cuda_index)
        self._node, self._pid = socket.gethostname(), os.getpid()
        # Guards `_writer` only; never held while writing (MetricsWriter has its own lock, and
        # its close() detaches: holding both would invert their order).
        self._lock = threading.Lock()
        self._writer = metrics_writer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def attach_writer(self, writer: Any) -> None:
        with self._lock:
            self._writer = writer

    def detach_writer(self, writer: Any) -> None:
        with self._lock:
            if self._writer is writer:
                self._writer = None

    def start(self) -> HealthSampler:
        if self.rank == 0:
            log.info("%s", sources_line({n: s.status for n, s in self.sources.items()}))
        self._tick()
        self._thread = threading.Thread(
            target=self._run, name=f"health-rank{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
        for source in self.sources.values():
            source.close()

    def sample(self) -> dict[str, Any]:
        """One sample in the contract's schema (absent sources contribute nothing)."""
        record: dict[str, Any] = {
            "rank": self.rank,
            "node": self._node,
            "pid": self._pid,
            "time": round(time.time(), 3),
            "interval_s": self.interval_s,
            "sources": {name: s.status for name, s in self.sources.items()},
        }
        gpus = self._read(record, "nvml")
        ports = self._read(record, "infiniband")
        io = self._read(record, "io")
        record["gpus"], record["ib_ports"] = gpus or [], ports or []
        if io:
            record["io"] = io
        return record

    def _read(self, record: dict[str, Any], name: str) -> Any:
        """Source `name`'s part of the sample; None when it is absent or failed this time (its
        `sources` entry then says so: one broken reader does not cost the others)."""
        source = self.sources.get(name)
        if source is None or source.status != "present":
            return None
        try:
            return source.sample()
        except Exception as exc:
            record["sources"][name] = f"absent: read failed ({type(exc).__name__}: {exc})"
            self._warn_once(f"health source {name} of rank {self.rank} failed: {exc!r}")
            return None

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s (logged once; sampling goes on)", message)

    def write(self, record: dict[str, Any]) -> None:
        """Replace the rank file; on rank 0 append the flat record when a writer is attached."""
        self.path.parent.mkdir(parents=True, exist_ok=True)  # also after a clean of logs/
        self._tmp.write_text(json.dumps(record))
        os.replace(self._tmp, self.path)
        with self._lock:
            writer = self._writer
        if writer is not None and self.rank == 0:
            # At the rank's current step: the trackers plot records by step.
            step = heartbeat.current_step()
            at = {"step": step} if step is not None else {}
            flat = flatten_health(record)
            writer.write("health", time=record["time"], rank=self.rank, **at, **flat)

    def _tick(self) -> None:
        try:
            self.write(self.sample())
        except Exception as exc:  # bookkeeping: never fail a stage over it
            self._warn_once(f"health sample of rank {self.rank} not written: {exc!r}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()


# The process's sampler, set by `start` (stage_main) and fed the stage's MetricsWriter by
# `attach_writer` (MetricsWriter.__init__ on rank 0); both are no-ops without a sampler.
_current: HealthSampler | None = None


def start(out_dir: Path, rank: int, device: Any = None) -> HealthSampler | None:
    """Start this rank's sampler (None when POSTTRAIN_HEALTH_INTERVAL_S is 0). `device`: the
    rank's torch.device, when it has one (see `cuda_index_of`)."""
    global _current
    stop()
    interval = interval_from_env()
    if interval <= 0:
        return None
    try:
        sampler = HealthSampler(out_dir, rank, interval, cuda_index=cuda_index_of(device))
    except Exception as exc:
        log.warning("health sampler not started: %r", exc)
        return None
    _current = sampler.start()
    return _current


def stop() -> None:
    """Stop this process's sampler (its files stay)."""
    global _current
    sampler, _current = _current, None
    if sampler is not None:
        sampler.stop()


def attach_writer(writer: Any) -> None:
    """From now on rank 0's samples also go to `writer` (a MetricsWriter) as flat records."""
    if _current is not None:
        _current.attach_writer(writer)


def detach_writer(writer: Any) -> None:
    if _current is not None:
        _current.detach_writer(writer)
