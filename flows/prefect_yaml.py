"""Generate `prefect.yaml`: the deployments `posttrain serve` serves, for a Prefect work pool.

    python -m flows.prefect_yaml recipes/*.yaml > prefect.yaml

Each recipe becomes the deployment `post-train/<run.name>` with the recipe (as written, paths
relative to the project folder) as its parameter, its schedule and its new-base trigger, on the
process work pool `posttrain`. A test keeps the committed file equal to this output.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from posttrain.config.extends import read_recipe
from posttrain.config.loader import rebase_paths, validate_recipe
from posttrain.config.schema import Recipe

WORK_POOL = "posttrain"

HEADER = f"""\
# Deployments of the post-train flow for a Prefect work pool (generated: do not edit by hand).
#   python -m flows.prefect_yaml recipes/*.yaml > prefect.yaml
#
# On the machine with the devices, from this folder, with PREFECT_API_URL set:
#   prefect work-pool create {WORK_POOL} --type process
#   POSTTRAIN_HOME=$PWD prefect --no-prompt deploy --all
#   prefect worker start --pool {WORK_POOL}
# The pull step's folder is filled in from POSTTRAIN_HOME when `prefect deploy` runs; the worker
# runs each flow run in a fresh process there, so the recipes' relative paths (./workspace)
# resolve in this checkout. `posttrain serve recipes/*.yaml` serves
# the same deployments without a work pool; `posttrain submit RECIPE [overrides]` starts a run of
# either and prints its URL.
#
# Kubernetes instead of processes: a work pool of type kubernetes (`pip install prefect-kubernetes`)
# runs each flow run as a Job. The image must contain this project installed with `pip install .`
# and the workspace must be a volume every Job mounts (a ReadWriteMany claim): artifacts are
# exchanged through it. For example:
#
#   prefect work-pool create posttrain-k8s --type kubernetes
#   # and in a deployment below:
#   #   work_pool:
#   #     name: posttrain-k8s
#   #     job_variables:
#   #       image: registry.example.com/posttrain:0.1.0
#   #       namespace: training
#   #       env: {{POSTTRAIN_HOME: /work}}
#   #       # GPUs and the workspace volume go in the pool's base job template:
#   #       # resources.limits: {{nvidia.com/gpu: "8"}}, a volumeMount of the workspace claim
#   #       # at /work/workspace.
#   # and a pull step that sets /work as the working directory.
"""


def recipe_parameters_as_written(recipe: Recipe) -> dict[str, Any]:
    """The recipe with only the fields its file sets (the flow and the server fill defaults)."""
    return {"recipe": recipe.model_dump(mode="json", exclude_unset=True)}


def deployment_entry(recipe: Recipe) -> dict[str, Any]:
    from flows.deploy import base_trigger

    entry: dict[str, Any] = {
        "name": recipe.run.name,
        "entrypoint": "flows/post_train.py:post_train",
        "description": f"posttrain pipeline '{recipe.run.name}'",
        "tags": ["posttrain"],
        "enforce_parameter_schema": True,
        "parameters": recipe_parameters_as_written(recipe),
        "work_pool": {"name": WORK_POOL},
    }
    s = recipe.schedule
    if s is not None and (s.cron is not None or s.interval_s is not None):
        when = {"cron": s.cron} if s.cron is not None else {"interval": s.interval_s}
        entry["schedules"] = [{**when, "timezone": s.timezone, "active": s.active}]
    if s is not None and s.on_new_base:
        trigger = base_trigger(recipe)
        params = recipe_parameters_as_written(recipe)
        params["recipe"]["ingest"] = trigger.parameters["recipe"]["ingest"]
        event = {"type": "event", "name": trigger.name, "enabled": True}
        event |= {"expect": sorted(trigger.expect), "match": trigger.match.model_dump()}
        entry["triggers"] = [{**event, "parameters": params}]
    return entry


def render(paths: list[str]) -> str:
    deployments = []
    for path in sorted(paths):
        data, origins = read_recipe(path)
        recipe = validate_recipe(data, path)
        # The deployments run in $POSTTRAIN_HOME (the folder this is rendered in): a path
        # relative to its recipe's folder becomes one relative to that.
        recipe = rebase_paths(recipe, origins, Path.cwd().resolve())
        deployments.append(deployment_entry(recipe))
    pull = {
        "prefect.deployments.steps.set_working_directory": {"directory": "{{ $POSTTRAIN_HOME }}"}
    }
    doc = {"name": "posttrain", "prefect-version": "3.9.1", "pull": [pull]}
    doc["deployments"] = deployments
    return HEADER + "\n" + yaml.safe_dump(doc, sort_keys=False, width=100)


def main(argv: list[str]) -> int:
    paths = argv or [str(p) for p in Path("recipes").glob("*.yaml")]
    sys.stdout.write(render(paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
