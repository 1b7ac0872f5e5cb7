"""MLflow: one parent run per pipeline run, a nested run per stage, and the promoted export as
a new version of the registered model `run.name` with alias `champion`.

Uses an `MlflowClient` bound to the recipe's URI (never mlflow's process-global tracking URI:
another pipeline in the same process may track elsewhere). Metrics and params go in batches
(`log_batch`: up to 1000 metrics / 100 params per HTTP call), not one call per value.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from flows.report.tables import RunResult, StageRecord
from flows.trackers import Sink, headline_metrics, numeric_fields

PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value
PARAM_KEY_MAX = 250
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
ALIAS = "champion"
FINGERPRINT_TAG = "posttrain.export_fingerprint"


def metric_key(key: str) -> str:
    """A name MLflow accepts (letters, digits, `_ - . / :` and spaces): `headline/pass@1` ->
    `headline/pass_1`. An invalid name would make the server refuse the whole batch."""
    return re.sub(r"[^\w\-. /:]", "_", key)[:PARAM_KEY_MAX]


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested recipe data as dotted keys -> strings (lists as JSON), cut to MLflow's limits."""
    out: dict[str, str] = {}
    if isinstance(data, dict) and data:
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if not prefix:
        return out
    text = data if isinstance(data, str) else json.dumps(data)
    if len(text) > PARAM_VALUE_MAX:
        text = text[: PARAM_VALUE_MAX - 3] + "..."
    out[metric_key(prefix)] = text
    return out


class MlflowSink(Sink):
    name = "mlflow"

    def __init__(self, config: Any):
        from mlflow.tracking import MlflowClient

        self.config = config
        self.uri = config.uri.rstrip("/")
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        self.link = self.uri
        self.experiment_id: str | None = None
        self.parent_id: str | None = None
        self.model_name = "posttrain-run"
        self.stage_runs: dict[str, str] = {}
        self._last_step: dict[str, int] = {}

    def start_pipeline(self, run_id: str, flow_run_id: str | None, recipe: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.model_name = str((recipe.get("run") or {}).get("name") or self.model_name)
        name = self.config.experiment or self.model_name
        found = self.client.get_experiment_by_name(name)
        self.experiment_id = found.experiment_id if found else self.client.create_experiment(name)
        tags = {"posttrain.run_id": run_id, "posttrain.pipeline": self.model_name}
        if flow_run_id:
            tags["prefect.flow_run_id"] = flow_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_id, tags=tags)
        self.parent_id = run.info.run_id
        self.link = f"{self.uri}/#/experiments/{self.experiment_id}/runs/{self.parent_id}"
        params = [Param(k, v) for k, v in flatten(recipe).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.parent_id, params=params[i : i + PARAMS_PER_BATCH])

    def start_stage(self, stage: str, fingerprint: str) -> None:
        assert self.experiment_id is not None and self.parent_id is not None
        tags = {"mlflow.parentRunId": self.parent_id, "posttrain.stage": stage}
        tags["posttrain.fingerprint"] = fingerprint
        run = self.client.create_run(self.experiment_id, run_name=stage, tags=tags)
        self.stage_runs[stage] = run.info.run_id

    def _metrics(self, run_id: str, metrics: list[Any]) -> None:
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + METRICS_PER_BATCH])

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = []
        for r in records:
            step = r.get("step")
            if not isinstance(step, int | float):
                continue
            self._last_step[stage] = int(step)
            ms = int(1000 * float(r.get("time") or time.time()))
            metrics += [
                Metric(metric_key(k), v, ms, int(step)) for k, v in numeric_fields(r).items()
            ]
        self._metrics(self.stage_runs[stage], metrics)

    def end_stage(self, record: StageRecord) -> None:
        from mlflow.entities import Metric, RunTag

        run_id = self.stage_runs[record.stage]
        ms, step = int(time.time() * 1000), self._last_step.get(record.stage, 0)
        headline = headline_metrics(record.summary.headline)
        metrics = [Metric(metric_key(k), v, ms, step) for k, v in headline.items()]
        tags = {
            "posttrain.status": record.status,
            "posttrain.reused": str(record.status == "reused").lower(),
            "posttrain.artifact_uri": record.uri,
            "posttrain.sha256": record.sha256,
        }
        if record.error:
            tags["posttrain.error"] = record.error[:5000]
        self.client.log_batch(run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()])
        self.client.set_terminated(run_id, "FAILED" if record.status == "failed" else "FINISHED")

    def finish(self, result: RunResult) -> None:
        assert self.parent_id is not None
        parent = self.parent_id
        for r in result.stages:
            self.client.set_tag(parent, f"posttrain.fingerprint.{r.stage}", r.fingerprint)
        self.client.log_artifact(parent, str(result.run_dir / "report.md"))
        for image in result.images:
            self.client.log_artifact(parent, str(image), "curves")
        exports = [r for r in result.stages if r.stage == "export" and r.status != "failed"]
        export = exports[0] if exports else None
        if result.promotion and result.promotion.promoted and export and result.export_path:
            self._register(parent, Path(result.export_path), export)
        self.client.set_terminated(parent, "FAILED" if result.failed else "FINISHED")

    def _register(self, parent: str, export_path: Path, export: StageRecord) -> None:
        """The promoted export as a new version of the registered model, alias `champion`."""
        from mlflow.exceptions import MlflowException

        fingerprint = export.fingerprint
        try:
            current = self.client.get_model_version_by_alias(self.model_name, ALIAS)
        except MlflowException:
            current = None  # no such model or alias yet
        if current is not None and current.tags.get(FINGERPRINT_TAG) == fingerprint:
            return  # a re-run that promoted the same export: already the champion version
        if self.config.upload_model:
            self.client.log_artifacts(parent, str(export_path), "model")
        else:
            where = {"path": str(export_path), "fingerprint": fingerprint, "sha256": export.sha256}
            with tempfile.TemporaryDirectory() as tmp:
                pointer = Path(tmp) / "posttrain_export.json"
                pointer.write_text(json.dumps(where, indent=2))
                self.client.log_artifact(parent, str(pointer), "model")
        try:
            self.client.create_registered_model(self.model_name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        run = self.client.get_run(parent)
        version = self.client.create_model_version(
            self.model_name,
            source=f"{run.info.artifact_uri}/model",
            run_id=parent,
            tags={"posttrain.export_path": str(export_path), FINGERPRINT_TAG: fingerprint},
        )
        self.client.set_registered_model_alias(self.model_name, ALIAS, version.version)
        self.client.set_tag(parent, "posttrain.registered_version", str(version.version))


SINK = MlflowSink
