"""Weights & Biases: one W&B run per stage, grouped by the pipeline run id (`group`), the stage
as `job_type`; config = the resolved recipe; the Prefect flow-run id and the fingerprints as
config and summary entries.

W&B starts a service process (wandb-core) for its runs: `finish` tears it down, so none
outlives the flow run. Offline runs (mode `offline`, or WANDB_MODE) are written under WANDB_DIR,
else under the run folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flows.report.tables import RunResult, StageRecord
from flows.trackers import Sink, headline_metrics, numeric_fields


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, config: Any, run_dir: Path):
        import wandb

        self.wandb = wandb
        self.config = config
        self.mode = os.environ.get("WANDB_MODE") or config.mode
        self.dir = Path(os.environ.get("WANDB_DIR") or run_dir)
        self.run_id = ""
        self.flow_run_id: str | None = None
        self.recipe: dict[str, Any] = {}
        self.runs: dict[str, Any] = {}
        self.link = f"project {config.project}"

    def start_pipeline(self, run_id: str, flow_run_id: str | None, recipe: dict[str, Any]) -> None:
        self.run_id, self.flow_run_id, self.recipe = run_id, flow_run_id, recipe
        self.link = f"project {self.config.project}, group {run_id}"
        if self.mode == "offline":
            self.link += f" (offline, under {self.dir / 'wandb'}; `wandb sync` to upload)"

    def start_stage(self, stage: str, fingerprint: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        ids = {"run_id": self.run_id, "stage": stage, "fingerprint": fingerprint}
        ids["prefect_flow_run_id"] = self.flow_run_id
        where = {"project": self.config.project, "entity": self.config.entity, "mode": self.mode}
        what = {"group": self.run_id, "job_type": stage, "name": f"{self.run_id}/{stage}"}
        config = {"recipe": self.recipe, "posttrain": ids}
        # reinit: stages side by side, one live run each.
        run = self.wandb.init(
            **where, **what, dir=str(self.dir), config=config, tags=[stage], reinit="create_new"
        )
        self.runs[stage] = run
        url = getattr(run, "url", None)
        if url and self.mode == "online":
            self.link = f"project {self.config.project}, group {self.run_id}: {url}"

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        run = self.runs[stage]
        for r in records:
            step = r.get("step")
            values = numeric_fields(r)
            if values and isinstance(step, int | float):
                run.log(values, step=int(step))

    def end_stage(self, record: StageRecord) -> None:
        run = self.runs.pop(record.stage, None)
        if run is None:
            return
        about = {
            "status": record.status,
            "reused": record.status == "reused",
            "sha256": record.sha256,
        }
        about["artifact_uri"] = record.uri
        run.summary.update(
            headline_metrics(record.summary.headline)
            | {f"posttrain/{k}": v for k, v in about.items()}
        )
        run.finish(exit_code=1 if record.status == "failed" else 0)

    def finish(self, result: RunResult) -> None:
        for stage in list(self.runs):
            self.runs.pop(stage).finish(exit_code=1)
        self.wandb.teardown()  # stops the wandb-core service process


SINK = WandbSink
