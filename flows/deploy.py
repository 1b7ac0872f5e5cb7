"""Deployments of the `post-train` flow: what `posttrain serve` serves and `posttrain submit` runs.

One recipe = one deployment, `post-train/<run.name>`: the recipe is its default parameter (the
UI's run form is the recipe schema, enforced by the server), its `schedule` adds a cron or
interval schedule and, with `on_new_base`, a trigger on another pipeline's new base. The
entrypoint is a module path, so a worker imports the flow whatever its working directory.
"""

from __future__ import annotations

from typing import Any

from prefect.client.schemas.objects import FlowRun
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.schedules import Cron, Interval, Schedule
from prefect.settings import PREFECT_UI_URL

from flows.events import BASE_EVENT, BASE_PATH_LABEL, PIPELINE_LABEL
from flows.post_train import post_train
from posttrain.config.schema import Recipe
from posttrain.plan.selection import Selection

FLOW_NAME = "post-train"
TAG = "posttrain"


def recipe_parameters(recipe: Recipe, selection: Selection | None = None) -> dict[str, Any]:
    """The flow's parameters for a recipe: JSON, every field present (the UI form shows them);
    with a stage selection (`submit --until/--only`), its `until` and `only` too."""
    params: dict[str, Any] = {"recipe": recipe.model_dump(mode="json")}
    if selection:
        params |= {"until": list(selection.until), "only": list(selection.only)}
    return params


def schedules_for(recipe: Recipe) -> list[Schedule]:
    s = recipe.schedule
    if s is None:
        return []
    if s.cron is not None:
        return [Cron(s.cron, timezone=s.timezone, active=s.active)]
    if s.interval_s is not None:
        return [Interval(s.interval_s, timezone=s.timezone, active=s.active)]
    return []


def base_trigger(recipe: Recipe) -> DeploymentEventTrigger:
    """Run this deployment on the base a `posttrain.base.published` event names (not one this
    pipeline emitted, or its ingest would re-trigger it): ingest switched to the event's path,
    a template Prefect renders when it creates the run."""
    params = recipe_parameters(recipe)
    ingest = params["recipe"]["ingest"]
    ingest["source"] = "path"
    ingest["path"] = "{{ event.resource['" + BASE_PATH_LABEL + "'] }}"
    return DeploymentEventTrigger(
        name=f"{recipe.run.name}: retrain on a new base",
        expect={BASE_EVENT},
        match={PIPELINE_LABEL: f"!{recipe.run.name}"},
        parameters=params,
    )


def deployment_for(recipe: Recipe) -> RunnerDeployment:
    triggers = [base_trigger(recipe)] if recipe.schedule and recipe.schedule.on_new_base else []
    return post_train.to_deployment(
        name=recipe.run.name,
        parameters=recipe_parameters(recipe),
        schedules=schedules_for(recipe),
        triggers=triggers,
        description=f"posttrain pipeline '{recipe.run.name}' (workspace {recipe.run.workspace})",
        tags=[TAG],
        enforce_parameter_schema=True,
        entrypoint_type=EntrypointType.MODULE_PATH,
    )


def check_unique(recipes: list[tuple[str, Recipe]]) -> list[str]:
    """Errors for two recipes that would serve the same deployment name."""
    seen: dict[str, str] = {}
    errors = []
    for path, recipe in recipes:
        name = recipe.run.name
        if name in seen:
            errors.append(f"{path}: run.name {name!r} is already served from {seen[name]}")
        seen[name] = path
    return errors


def describe(recipe: Recipe) -> str:
    """One line per served deployment: its name, schedule and trigger."""
    s = recipe.schedule
    parts = [f"{FLOW_NAME}/{recipe.run.name}"]
    if s is not None and s.cron is not None:
        parts.append(f"cron '{s.cron}' {s.timezone}")
    elif s is not None and s.interval_s is not None:
        parts.append(f"every {s.interval_s:g} s")
    if s is not None and not s.active:
        parts.append("(schedule paused)")
    if s is not None and s.on_new_base:
        parts.append(f"on {BASE_EVENT}")
    return "serving " + ", ".join(parts)


def flow_run_url(flow_run: FlowRun | str) -> str:
    """The UI page of a flow run (PREFECT_UI_URL, derived from PREFECT_API_URL by Prefect)."""
    run_id = flow_run if isinstance(flow_run, str) else str(flow_run.id)
    base = PREFECT_UI_URL.value() or ""
    return f"{base.rstrip('/')}/runs/flow-run/{run_id}"
