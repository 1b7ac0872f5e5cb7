"""TensorBoard event files, one folder per stage: `<workspace>/runs/<run-id>/<stage>/`.

`tensorboard --logdir <workspace>/runs` then lists one run per stage named `<run-id>/<stage>`,
x = the stage's optimizer step. Written with tensorboard's own event writer and protos, not
torch's SummaryWriter: the flow process stays torch-free (importing torch costs ~2 s).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from flows.report.tables import RunResult, StageRecord
from flows.trackers import Sink, headline_metrics, numeric_fields


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.link = f"tensorboard --logdir {self.run_dir.parent}"
        self._writers: dict[str, EventFileWriter] = {}
        self._last_step: dict[str, int] = {}

    def _writer(self, stage: str) -> EventFileWriter:
        if stage not in self._writers:
            folder = self.run_dir / stage
            folder.mkdir(parents=True, exist_ok=True)
            self._writers[stage] = EventFileWriter(str(folder), flush_secs=10)
        return self._writers[stage]

    def _scalars(self, stage: str, values: dict[str, float], step: int, wall: float) -> None:
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        )
        self._writer(stage).add_event(event_pb2.Event(wall_time=wall, step=step, summary=summary))

    def start_stage(self, stage: str, fingerprint: str) -> None:
        self._writer(stage)

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        for r in records:
            values = numeric_fields(r)
            step = r.get("step")
            if not values or not isinstance(step, int | float):
                continue
            self._last_step[stage] = int(step)
            self._scalars(stage, values, int(step), float(r.get("time") or time.time()))

    def end_stage(self, record: StageRecord) -> None:
        stage, values = record.stage, headline_metrics(record.summary.headline)
        if values:  # at the stage's last step, so it lines up with its curves
            self._scalars(stage, values, self._last_step.get(stage, 0), time.time())
        if stage in self._writers:
            self._writers[stage].flush()

    def finish(self, result: RunResult) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


SINK = TensorBoardSink
