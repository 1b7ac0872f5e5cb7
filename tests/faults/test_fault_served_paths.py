"""Served recipes cannot widen their own reach: against a real `prefect server start` and a real
`posttrain serve --allow-path DIR`.

A parameter set as the UI's Run form would send it (the served recipe with `run.allowed_paths`
set to `/` and a data path at /etc/hostname) is accepted by the server (it is a valid recipe) but
the flow refuses it before any stage starts, naming the fields; the served recipe as it is still
completes.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from prefect_server import serving, start_serve, wait_for

from tests.stage_helpers import TINY, write_recipe

pytestmark = pytest.mark.slow

NAME = "reach"


@pytest.fixture(scope="module")
def served(prefect_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    from prefect.client.orchestration import SyncPrefectClient

    tmp = tmp_path_factory.mktemp("reach")
    data = copy.deepcopy(TINY)
    data["run"]["name"] = NAME
    data["infra"]["threads_per_rank"] = 1
    data["ingest"]["from_config"]["pretrain_steps"] = 20
    data["sft"]["max_steps"] = 4
    recipe = write_recipe(tmp, data)
    shared = tmp / "shared"
    shared.mkdir()
    log_path = tmp / "serve.log"
    proc = start_serve([str(recipe), "--allow-path", str(shared)], prefect_server.env, log_path)
    client = SyncPrefectClient(prefect_server.api_url)

    def deployed() -> Any:
        return serving(proc, log_path, lambda: client.read_deployment_by_name(f"post-train/{NAME}"))

    try:
        dep = wait_for("the deployment", deployed, 120)
        yield {"client": client, "deployment": dep, "log": log_path, "shared": shared, "tmp": tmp}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _run(served: dict, parameters: dict, timeout: float) -> Any:
    client = served["client"]
    run = client.create_flow_run_from_deployment(served["deployment"].id, parameters=parameters)
    return wait_for(
        "the run to end",
        lambda: (r := client.read_flow_run(run.id)).state.is_final() and r,
        timeout,
    )


def test_served_log_lists_the_worker_folders(served: dict) -> None:
    text = wait_for("serve's first lines", lambda: served["log"].read_text(), 30)
    assert f"served runs may read from: {served['shared']}" in text
    assert str(served["tmp"] / "ws") in text  # the served recipe's own workspace


def test_ui_parameters_allowing_root_are_refused_before_any_stage(served: dict) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    params = copy.deepcopy(served["deployment"].parameters)
    recipe = params["recipe"]
    recipe["run"]["allowed_paths"] = ["/"]
    recipe["sft"]["data"].update(synthetic=None, path="/etc/hostname")
    run = _run(served, params, 180)
    assert run.state.name == "Failed", run.state
    message = run.state.message or ""
    shared = served["shared"]
    assert "run.allowed_paths.0: / is outside the folders this worker allows (" in message
    assert str(shared) in message
    assert "sft.data.path: /etc/hostname is outside this served run's" in message
    # Refused before anything ran: no task run (no stage) exists for it.
    tasks = served["client"].read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
    )
    assert tasks == []


def test_the_served_recipe_as_it_is_still_runs(served: dict) -> None:
    run = _run(served, copy.deepcopy(served["deployment"].parameters), 600)
    assert run.state.name == "Completed", served["log"].read_text()[-4000:]
