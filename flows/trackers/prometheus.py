"""The Prometheus tracker (`tracking.prometheus`): the flow process serves `/metrics` for the
run's stages and ranks (`flows.trackers.exposition.RunSeries`), pushes to a Pushgateway,
or both.

Unlike the other trackers it reads the stages' files itself at each scrape, so a scrape is as
fresh as the files (on the shared workspace: every node's ranks). A port in use or an
unreachable Pushgateway gives the tracker up with one warning: the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server

from flows.report.tables import RunResult, StageRecord
from flows.stage.output import run_logger
from flows.trackers import Sink
from flows.trackers.exposition import RunSeries
from posttrain.runtime.spec import PlannedStage

log = logging.getLogger("posttrain.flows.trackers")

JOB = "posttrain"


class PrometheusSink(Sink):
    name = "prometheus"

    def __init__(self, cfg: Any, stages: Sequence[PlannedStage] = ()) -> None:
        self.cfg, self.planned = cfg, list(stages)
        self.series: RunSeries | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self._server: Any = None
        self._pusher: threading.Thread | None = None
        self._stop = threading.Event()
        self._push_error: str | None = None
        self._target: Path | None = None  # this run's file_sd target file

    def start_pipeline(self, run_id: str, flow_run_id: str | None, recipe: dict[str, Any]) -> None:
        name = str((recipe.get("run") or {}).get("name", ""))
        self.series = RunSeries(run_id, name, flow_run_id)
        for s in self.planned:
            self.series.add_stage(s.name, s.kind, s.out_dir, s.hang_timeout_s)
        self.registry.register(self.series)
        where = []
        if self.cfg.pushgateway:
            # Before the endpoint starts: an unreachable gateway gives the tracker up (one
            # warning) with no server left listening.
            self._push()
            self._pusher = threading.Thread(target=self._push_loop, daemon=True, name="prom-push")
            self._pusher.start()
            where.append(f"pushed to {self.cfg.pushgateway}")
        if self.cfg.port is not None:
            try:
                self._server, _ = start_http_server(self.cfg.port, self.cfg.host, self.registry)
            except OSError as exc:  # the port is taken: given up, so no pushing either
                self._stop.set()
                raise OSError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc}") from exc
            host, port = _shown_host(self.cfg.host), self._server.server_port
            where.insert(0, f"http://{host}:{port}/metrics")
            run_logger().info("Prometheus endpoint: %s", where[0])
            if self.cfg.file_sd_dir:
                self._target = write_target(Path(self.cfg.file_sd_dir), run_id, f"{host}:{port}")
        self.link = ", ".join(where)

    def start_stage(self, stage: str, fingerprint: str) -> None:
        if self.series is not None:
            self.series.set_status(stage, "running")

    def end_stage(self, record: StageRecord) -> None:
        if self.series is not None:
            self.series.set_status(record.stage, record.status)

    def finish(self, result: RunResult) -> None:
        self._stop.set()
        if self._pusher is not None:
            self._pusher.join(timeout=10)
        try:
            if self.cfg.pushgateway:
                self._push()  # how the run ended, kept by the gateway after this process
            if self._server is not None and self.cfg.linger_s:
                time.sleep(self.cfg.linger_s)
        finally:
            if self._target is not None:
                self._target.unlink(missing_ok=True)
                self._target = None
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None

    def _push(self) -> None:
        assert self.series is not None
        group = {"run": self.series.run}
        push_to_gateway(
            self.cfg.pushgateway, job=JOB, grouping_key=group, registry=self.registry, timeout=10
        )

    def _push_loop(self) -> None:
        while not self._stop.wait(self.cfg.push_every_s):
            try:
                self._push()
                self._push_error = None
            except Exception as exc:  # a gateway that blips is retried at the next push
                if self._push_error is None:
                    log.warning("Pushgateway %s: %s", self.cfg.pushgateway, exc)
                self._push_error = str(exc)


def write_target(folder: Path, run_id: str, address: str) -> Path:
    """`<folder>/<run_id>.json`: this run's one file_sd target (written whole, then renamed:
    Prometheus re-reads the folder when it changes); the series carry `run` themselves."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run_id}.json"
    tmp = folder / f".{run_id}.json.tmp"
    tmp.write_text(json.dumps([{"targets": [address]}]))
    os.replace(tmp, path)
    return path


def _shown_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        import socket

        return socket.gethostname()
    return host


SINK = PrometheusSink
