"""`posttrain serve`, `submit` and `publish-base`: the Prefect server's side."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TextIO

from flows.cli_common import EXIT_FAILED, EXIT_INVALID, EXIT_OK, reported
from flows.prefect_env import apply_prefect_defaults
from posttrain.config.loader import load_for_deployment
from posttrain.config.served_access import (
    ALLOWED_ENV,
    COMMANDS_ENV,
    REWARDS_ENV,
    served_commands,
    served_reward_roots,
    served_roots,
    with_commands,
    with_roots,
    worker_commands,
)
from posttrain.plan.selection import ALL_STAGES, Selection


def _server_url(err: TextIO) -> str | None:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        print(
            "error: this command needs a Prefect server: set PREFECT_API_URL (e.g. "
            "http://127.0.0.1:4200/api after `prefect server start`; see docs/deployments.md)",
            file=err,
        )
    return url


def cmd_serve(
    paths: list[str],
    out: TextIO,
    err: TextIO,
    allow_paths: list[str] | None = None,
    allow_rewards: list[str] | None = None,
    allow_commands: list[str] | None = None,
) -> int:
    """Serve one deployment per recipe until stopped (SIGINT/SIGTERM); runs execute here."""
    for flag, given in (("--allow-path", allow_paths), ("--allow-rewards", allow_rewards)):
        bad = [p for p in given or [] if not p.startswith(("/", "~"))]
        if bad:
            print(f"error: {flag} needs absolute folders, got {', '.join(bad)}", file=err)
            return EXIT_INVALID
    recipes = []
    for path in paths:
        recipe = reported(load_for_deployment, path, [], err)
        if recipe is None:
            return EXIT_INVALID
        recipes.append((path, recipe))
    # What served runs may read: the operator's folders and those of the recipe files served
    # (the operator wrote them); a recipe sent with a run may only narrow them. Set here, before
    # serving: the runs are subprocesses of this process and inherit it.
    trusted = [*(allow_paths or []), *(p for _, r in recipes for p in served_roots(r))]
    os.environ[ALLOWED_ENV] = with_roots(os.environ.get(ALLOWED_ENV), trusted)
    print(f"served runs may read from: {os.environ[ALLOWED_ENV]}", file=out, flush=True)
    # Reward code likewise: the operator's folders and the served recipes' own reward modules.
    code = [*(allow_rewards or []), *(p for _, r in recipes for p in served_reward_roots(r))]
    os.environ[REWARDS_ENV] = with_roots(os.environ.get(REWARDS_ENV), code)
    if os.environ[REWARDS_ENV]:
        print(f"served runs may import reward code from: {os.environ[REWARDS_ENV]}", file=out)
    # Server commands likewise: the operator's and those the served recipes start.
    started = [
        *(allow_commands or []),
        *(c for _, r in recipes for c in served_commands(r).values()),
    ]
    os.environ[COMMANDS_ENV] = with_commands(os.environ.get(COMMANDS_ENV), started)
    if allowed := worker_commands():
        print(f"served runs may start: {'; '.join(allowed)}", file=out)
    if _server_url(err) is None:
        return EXIT_INVALID
    apply_prefect_defaults()
    from prefect import serve

    from flows.deploy import check_unique, deployment_for, describe

    problems = check_unique(recipes)
    if problems:
        print("error: " + "\n  ".join(problems), file=err)
        return EXIT_INVALID
    deployments = []
    for _, recipe in recipes:
        try:
            deployments.append(deployment_for(recipe))
        except ValueError as exc:  # a cron expression Prefect's parser refuses
            print(f"error: schedule of '{recipe.run.name}': {exc}", file=err)
            return EXIT_INVALID
        print(describe(recipe), file=out, flush=True)
    # pause_on_shutdown=False: a restart of this process must not silently stop retraining.
    # Prefect's serve returns on the first Ctrl-C (SIGINT) or SIGTERM, its runs cancelled.
    serve(*deployments, pause_on_shutdown=False, print_starting_message=False)
    print(
        "posttrain serve: stopped; the deployments' schedules stay active, their runs wait "
        "for the next `posttrain serve`",
        file=out,
        flush=True,
    )
    return EXIT_OK


def cmd_submit(
    path: str,
    overrides: list[str],
    out: TextIO,
    err: TextIO,
    wait: bool,
    selection: Selection = ALL_STAGES,
) -> int:
    """Start a run of the served deployment of this recipe, with overrides and the stage
    selection (checked by the run, against the worker's workspace); print its URL."""
    recipe = reported(load_for_deployment, path, overrides, err)
    if recipe is None or _server_url(err) is None:
        return EXIT_INVALID
    apply_prefect_defaults()
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    from flows.deploy import FLOW_NAME, flow_run_url, recipe_parameters

    name = f"{FLOW_NAME}/{recipe.run.name}"
    try:
        params = recipe_parameters(recipe, selection)
        run = run_deployment(name, parameters=params, timeout=None if wait else 0)
    except ObjectNotFound:
        print(f"error: no deployment {name}; is `posttrain serve {path}` running?", file=err)
        return EXIT_FAILED
    print(flow_run_url(run), file=out, flush=True)
    if not wait:
        return EXIT_OK
    state = run.state
    print(f"{run.name}: {state.name if state else 'unknown'}", file=out)
    if state is not None and state.is_completed():
        return EXIT_OK
    # Why, as the run's final state says it: posttrain's one-line reason for what it refused
    # or stopped (flows.post_train), Prefect's own message otherwise. The worker's log has more.
    for line in ((state.message if state else "") or "").strip().splitlines():
        print(f"  {line}", file=out)
    return EXIT_FAILED


def cmd_publish_base(model_dir: str, pipeline: str, out: TextIO, err: TextIO) -> int:
    """Emit posttrain.base.published for a checkpoint folder made outside posttrain."""
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        print(f"error: {folder} is not a model folder (no config.json)", file=err)
        return EXIT_INVALID
    if _server_url(err) is None:
        return EXIT_INVALID
    apply_prefect_defaults()
    from prefect.events.worker import EventsWorker

    from flows.events import BASE_EVENT, publish_base

    publish_base(folder, pipeline)
    EventsWorker.drain_all()  # the event is sent by a background worker: send it before exit
    print(f"emitted {BASE_EVENT} for {folder.resolve()}", file=out)
    return EXIT_OK
