"""Deployments built from recipes, the schedule section, and the commands that need a server
(fast: no server is started; tests/test_server.py runs them against a real one)."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from stage_helpers import TINY, write_recipe

from flows.cli import EXIT_INVALID, cmd_publish_base, cmd_serve, cmd_submit
from flows.deploy import (
    base_trigger,
    check_unique,
    deployment_for,
    describe,
    recipe_parameters,
    schedules_for,
)
from flows.events import BASE_EVENT, BASE_PATH_LABEL, PIPELINE_LABEL
from flows.stage.procs import kill_flow_run_processes, tagged_processes
from posttrain.config.loader import RecipeError, load_for_deployment, load_recipe, validate_recipe
from posttrain.plan.selection import Selection
from posttrain.runtime.spec import LAUNCH_TAG_ENV, tag_flow_run_id


def _recipe(tmp_path: Path, **schedule: object) -> Path:
    data = copy.deepcopy(TINY)
    if schedule:
        data["schedule"] = schedule
    return write_recipe(tmp_path, data)


def test_schedule_section_errors_name_the_field() -> None:
    base = copy.deepcopy(TINY)
    cases = {
        "schedule.cron": {"cron": "0 3 * *"},
        "schedule.interval_s": {"interval_s": 5},
        "schedule.timezone": {"timezone": "Mars/Olympus"},
        "schedule: give cron or interval_s, not both": {
            "cron": "0 3 * * *",
            "interval_s": 3600,
        },
    }
    for field, schedule in cases.items():
        with pytest.raises(RecipeError) as err:
            validate_recipe({**base, "schedule": schedule})
        assert any(line.startswith(field) for line in err.value.errors), err.value.errors


def test_cron_and_interval_become_prefect_schedules(tmp_path: Path) -> None:
    cron = load_recipe(_recipe(tmp_path, cron="30 2 * * 1", timezone="Europe/Paris"))
    [s] = schedules_for(cron)
    assert (s.cron, s.timezone, s.active) == ("30 2 * * 1", "Europe/Paris", True)
    every = load_recipe(_recipe(tmp_path, interval_s=7200, active=False))
    [s] = schedules_for(every)
    assert (s.interval.total_seconds(), s.active) == (7200, False)
    assert schedules_for(load_recipe(_recipe(tmp_path))) == []
    assert describe(cron) == "serving post-train/tiny, cron '30 2 * * 1' Europe/Paris"


def test_deployment_takes_the_recipe_as_its_validated_parameter(tmp_path: Path) -> None:
    recipe = load_for_deployment(_recipe(tmp_path, cron="0 3 * * *", on_new_base=True))
    dep = deployment_for(recipe)
    assert dep.name == "tiny" and dep.entrypoint == "flows.post_train.post_train"
    assert dep.enforce_parameter_schema
    assert dep.parameters["recipe"]["sft"]["max_steps"] == TINY["sft"]["max_steps"]
    # Unresolved devices travel as written: the machine that runs the flow resolves them.
    assert dep.parameters["recipe"]["infra"]["precision"] == "auto"
    assert Path(dep.parameters["recipe"]["run"]["workspace"]).is_absolute()
    props = dep._parameter_openapi_schema.model_dump()["properties"]
    # The stage selection a run may be given (`posttrain submit --until/--only`).
    assert list(props) == ["recipe", "until", "only"]
    assert "until" not in recipe_parameters(recipe)
    chosen = recipe_parameters(recipe, Selection(until=("sft",), only=("dpo",)))
    assert (chosen["until"], chosen["only"]) == (["sft"], ["dpo"])
    assert [t.expect for t in dep.triggers] == [{BASE_EVENT}]


def test_new_base_trigger_excludes_its_own_pipeline_and_templates_the_path(
    tmp_path: Path,
) -> None:
    recipe = load_for_deployment(_recipe(tmp_path, on_new_base=True))
    trigger = base_trigger(recipe)
    assert trigger.match.model_dump() == {PIPELINE_LABEL: "!tiny"}
    ingest = trigger.parameters["recipe"]["ingest"]
    assert ingest["source"] == "path"
    assert ingest["path"] == "{{ event.resource['" + BASE_PATH_LABEL + "'] }}"
    # The deployment's own default parameter is untouched.
    assert recipe.ingest.source == "from_config"


def test_two_recipes_cannot_serve_the_same_name(tmp_path: Path) -> None:
    r = load_recipe(_recipe(tmp_path))
    assert check_unique([("a.yaml", r), ("b.yaml", r)]) == [
        "b.yaml: run.name 'tiny' is already served from a.yaml"
    ]


def test_server_commands_explain_a_missing_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    recipe = str(_recipe(tmp_path))
    for call in (
        lambda out, err: cmd_serve([recipe], out, err),
        lambda out, err: cmd_submit(recipe, [], out, err, wait=False),
    ):
        out, err = io.StringIO(), io.StringIO()
        assert call(out, err) == EXIT_INVALID
        assert "needs a Prefect server: set PREFECT_API_URL" in err.getvalue()
    out, err = io.StringIO(), io.StringIO()
    assert cmd_publish_base(str(tmp_path), "x", out, err) == EXIT_INVALID
    assert "is not a model folder (no config.json)" in err.getvalue()


def test_flow_run_processes_are_found_and_killed_by_their_tag() -> None:
    env = {**os.environ, LAUNCH_TAG_ENV: "launch-1@run-123"}
    # One ignores SIGTERM (so SIGKILL is needed), one runs in a session of its own.
    ignoring = subprocess.Popen(
        [sys.executable, "-c", "import signal,time; signal.signal(15, signal.SIG_IGN); "
         "print(1, flush=True); time.sleep(60)"],
        env=env, stdout=subprocess.PIPE,
    )  # fmt: skip
    detached = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert ignoring.stdout is not None and ignoring.stdout.readline().strip() == b"1"
        found = {p.pid for p in tagged_processes(lambda t: tag_flow_run_id(t) == "run-123")}
        assert found == {ignoring.pid, detached.pid}
        t0 = time.monotonic()
        assert kill_flow_run_processes("run-123", grace_s=1.0) == 2
        assert time.monotonic() - t0 < 10
        assert ignoring.wait(timeout=5) == -9 and detached.wait(timeout=5) == -15
        assert other.poll() is None
    finally:
        for p in (ignoring, detached, other):
            p.kill()
            p.wait()
