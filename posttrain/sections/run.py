"""The recipe sections about the pipeline rather than a stage: `run` (name, workspace, seed,
allowed folders), `schedule` (when a served deployment runs by itself) and `tracking` (the
experiment trackers). Of these only `run.seed` changes what a stage makes."""

from __future__ import annotations

from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, field_validator, model_validator

from posttrain.sections.fields import Execution, Result, _Section


class RunConfig(_Section):
    name: str = Execution(
        "posttrain-run",
        description="Pipeline name: groups runs, names the Prefect flow run and the champion slot.",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
    )
    workspace: str = Execution(
        "./workspace",
        description="Folder that holds artifacts/, runs/ and Prefect results. Relative paths are "
        "resolved against the recipe file's folder (given on the command line: the current "
        "directory) when the recipe is loaded.",
    )
    seed: int = Result(0, ge=0, description="Seed for data order, initialisation and sampling.")
    allowed_paths: list[str] = Execution(
        default_factory=list,
        description="Folders the recipe's input paths (ingest.path, data.path, data.eval_path) "
        "may point into, besides the recipe file's folder, the current directory and the "
        "workspace; relative ones are the recipe file's folder's. Anything else, reached by an "
        "absolute path, `..` or a symlink, is refused. Loading makes them absolute and appends "
        "the recipe's folder or current directory when a path needed it, so a resolved recipe "
        "passes the same check on the machine that runs it.",
    )


_CRON_FIELD = r"[0-9A-Za-z*/,\-?LW#]+"


class ScheduleConfig(_Section):
    """When a served deployment of this recipe runs by itself (`posttrain serve`)."""

    cron: str | None = Field(
        None,
        description="Cron expression (5 fields, e.g. `0 3 * * 1` = Mondays 03:00) in `timezone`.",
        pattern=rf"^\s*{_CRON_FIELD}(\s+{_CRON_FIELD}){{4}}\s*$",
    )
    interval_s: float | None = Field(
        None, ge=60, description="Run every this many seconds (at least 60); instead of cron."
    )
    timezone: str = Field(
        "UTC",
        description="IANA time zone for cron (e.g. Europe/Paris): 03:00 stays 03:00 "
        "across daylight-saving changes.",
    )
    on_new_base: bool = Field(
        False,
        description="Also run when another pipeline's ingest emits `posttrain.base.published`; "
        "the run uses that base checkpoint (ingest.source = path).",
    )
    active: bool = Field(
        True,
        description="False: the schedule is created paused (the deployment still runs "
        "on request and on events).",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleConfig:
        if self.cron is not None and self.interval_s is not None:
            raise ValueError("give cron or interval_s, not both")
        return self

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a name too long
            raise ValueError(f"unknown time zone {value[:100]!r} (use an IANA name)") from None
        return value


class MlflowTracking(_Section):
    """An MLflow tracking server the run reports to (extra: `pip install posttrain[mlflow]`)."""

    uri: str = Field(
        description="Tracking server URI, e.g. `http://mlflow.internal:5000` (also the model "
        "registry's). Credentials come from MLflow's own environment variables "
        "(MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME/PASSWORD), never from the recipe.",
        min_length=1,
    )
    experiment: str | None = Field(
        None, description="Experiment the pipeline runs go to; default: `run.name`."
    )
    upload_model: bool = Field(
        False,
        description="On promotion, copy the exported model folder into MLflow's artifact store "
        "(the weights: GBs for a large model) as the registered version's files. Off: the "
        "version's files are a small `posttrain_export.json` naming the export's path, "
        "fingerprint and checksum in the workspace.",
    )


class WandbTracking(_Section):
    """A Weights & Biases project the run reports to (extra: `pip install posttrain[wandb]`)."""

    project: str = Field(description="W&B project.", min_length=1)
    entity: str | None = Field(None, description="W&B entity (user or team); default: yours.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="`offline` writes the runs under WANDB_DIR for a later `wandb sync`; the "
        "WANDB_MODE environment variable, when set, wins.",
    )


class PrometheusTracking(_Section):
    """A Prometheus endpoint served by the flow process for the run's stages and ranks
    (docs/monitoring.md): scraped at `http://<flow host>:<port>/metrics`, pushed to
    a Pushgateway, or both."""

    port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the `/metrics` endpoint; 0 picks a free one (the run prints it). "
        "None with `pushgateway` set: push only.",
    )
    host: str = Field(
        "0.0.0.0", description="Address the endpoint listens on (`127.0.0.1`: this host only)."
    )
    pushgateway: str | None = Field(
        None,
        description="A Pushgateway URL (`http://pushgateway:9091`) the run pushes its series to "
        "every `push_every_s` and once at the end, for flows Prometheus cannot scrape; grouped "
        "by job `posttrain` and the run id.",
    )
    push_every_s: float = Field(15.0, gt=0, description="Seconds between pushes.")
    file_sd_dir: str | None = Field(
        None,
        description="A folder Prometheus watches with `file_sd_configs` "
        "(`files: [<folder>/*.json]`): the run writes `<run-id>.json` naming its endpoint "
        "while it serves and removes it when it stops, so runs on any port (`port: 0`, several "
        "runs of one `posttrain serve` worker) are found without editing Prometheus's config.",
    )
    linger_s: float = Field(
        0.0,
        ge=0,
        le=25,
        description="Seconds the endpoint keeps serving after the run ends, so a scrape sees "
        "how it ended (a failed stage's alert); at most 25, within the trackers' 30 s for "
        "finishing.",
    )

    @model_validator(mode="after")
    def _somewhere(self) -> PrometheusTracking:
        if self.port is None and self.pushgateway is None:
            raise ValueError("set `port` (serve /metrics), `pushgateway` (push), or both")
        if self.file_sd_dir is not None and self.port is None:
            raise ValueError("`file_sd_dir` names the endpoint: set `port` (0 for any)")
        return self


class TrackingConfig(_Section):
    """Experiment trackers fed from the stages' metrics.jsonl by the flow process. None of it is
    part of any fingerprint; a tracker that is down never fails or stalls the run."""

    tensorboard: bool = Field(
        True,
        description="Write TensorBoard event files to `<workspace>/runs/<run-id>/<stage>/`: "
        "`tensorboard --logdir <workspace>/runs` shows every stage of every run, x = the "
        "stage's optimizer step.",
    )
    mlflow: MlflowTracking | None = Field(
        None,
        description="MLflow: one parent run per pipeline run, a nested run per stage, the "
        "report and curves as artifacts, the promoted export as a registered model version "
        "with alias `champion`.",
    )
    wandb: WandbTracking | None = Field(
        None,
        description="Weights & Biases: one run per stage, grouped by the pipeline run id.",
    )
    prometheus: PrometheusTracking | None = Field(
        None,
        description="Prometheus: the run's stages and ranks as scrapeable series (throughput, "
        "MFU, memory, heartbeats, GPU and network health); off by default.",
    )
