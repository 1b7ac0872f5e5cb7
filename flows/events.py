"""The `posttrain.base.published` event: a new base checkpoint is ready to post-train.

The flow emits it when its ingest stage ran (not when it was reused), `posttrain publish-base`
emits it for a checkpoint made elsewhere, and deployments with `schedule.on_new_base` run on it
(flows/deploy.py). Prefect events carry their data as resource labels.
"""

from __future__ import annotations

from pathlib import Path

from prefect.events import emit_event

BASE_EVENT = "posttrain.base.published"
BASE_PATH_LABEL = "posttrain.base.path"
PIPELINE_LABEL = "posttrain.plan.planner"


def publish_base(model_dir: str | Path, pipeline: str, fingerprint: str = "") -> None:
    """Emit the event for a base checkpoint folder (config, weights, tokenizer)."""
    path = str(Path(model_dir).resolve())
    emit_event(
        event=BASE_EVENT,
        resource={
            "prefect.resource.id": f"posttrain.base.{fingerprint or Path(path).name}",
            "prefect.resource.name": path,
            BASE_PATH_LABEL: path,
            PIPELINE_LABEL: pipeline,
        },
        payload={"fingerprint": fingerprint},
    )
