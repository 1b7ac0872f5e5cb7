"""Served runs may only narrow the folders their worker allows (posttrain.config.served_access).

A run is served when the server created it from a deployment (`flow_run.deployment_id`): the UI's
Run form, the API, an event trigger, a schedule or `posttrain submit`. Its recipe parameter is
whatever the sender sent. That marker is the server's, not a parameter, so no recipe can claim to
be a `posttrain run`. The worker's folders come from this process's environment, which the serve
process (or a worker) set; a run's own job variables may not set them.
"""

from __future__ import annotations

from prefect.context import FlowRunContext

from posttrain.config.loader import RecipeError
from posttrain.config.served_access import ALLOWED_ENV, COMMANDS_ENV, REWARDS_ENV, ServedReach


def is_served_run() -> bool:
    ctx = FlowRunContext.get()
    return bool(ctx and ctx.flow_run and ctx.flow_run.deployment_id)


def served_reach() -> ServedReach | None:
    """For a served run, the worker's reach its recipe may only narrow (the flow checks it);
    None for a `posttrain run`. Refuses a run whose job variables try to set that reach."""
    if not is_served_run():
        return None
    ctx = FlowRunContext.get()
    job_env = ((ctx.flow_run.job_variables or {}) if ctx and ctx.flow_run else {}).get("env")
    if isinstance(job_env, dict) and (
        env := {ALLOWED_ENV, REWARDS_ENV, COMMANDS_ENV} & set(job_env)
    ):
        # A work-pool worker would put a run's job variables into this process's environment.
        why = "set by the run; only the worker may set it"
        raise RecipeError([f"job_variables.env.{k}: {why}" for k in sorted(env)], "served run")
    return ServedReach.of_worker()
