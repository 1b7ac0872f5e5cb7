"""A Prefect server outage during a served run: a real `prefect server start` is stopped while
the run's SFT stage trains, and started again on the same port and database.

What must hold: the stage keeps training while the server is away (its supervisor makes no call
the stage depends on: logs and progress to the server are decoration), and the run ends
Completed once the server is back, its stages' artifacts complete.

The outage is OUTAGE_S seconds (default 25, to keep the test short; POSTTRAIN_OUTAGE_S=60 runs
the ~60 s case of docs/reliability.md). Prefect's client retries a failed request 5 times with
2, 4, 8, 16, 32 s back-off (~62 s); calls made during the outage wait inside those retries.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import pytest
from prefect_server import serving, start_serve, start_server, stop_group, wait_for

from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan
from posttrain.store.artifacts import verify
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import TINY, write_recipe

pytestmark = pytest.mark.slow

OUTAGE_S = float(os.environ.get("POSTTRAIN_OUTAGE_S", "25"))
NAME = "outage"


def _train_steps(out: Path) -> int:
    """The newest logged training step (read_metrics drops the line being written)."""
    return max((r["step"] for r in read_metrics(out / "metrics.jsonl", "train")), default=0)


def test_served_run_survives_a_server_outage_mid_stage(tmp_path: Path) -> None:
    from prefect.client.orchestration import SyncPrefectClient

    data = copy.deepcopy(TINY)
    data["run"]["name"] = NAME
    data["infra"]["threads_per_rank"] = 1
    data["ingest"]["from_config"]["pretrain_steps"] = 20
    # Long enough to train through the outage: ~OUTAGE_S + 40 s of steps on this box.
    data["sft"].update(max_steps=int(os.environ.get("POSTTRAIN_OUTAGE_STEPS", "1500")))
    data["sft"]["checkpoint_every"] = 50
    # No evaluate stage: export still starts after the outage (a stage launched through the
    # restarted server); evaluate would only add a process start and its generations.
    data["evaluate"] = None
    recipe_path = write_recipe(tmp_path, data)
    dirs = {s.name: s.out_dir for s in plan(load_recipe(recipe_path)).stages}
    sft_dir = dirs["sft"]

    server = start_server(tmp_path / "prefect-home")
    serve = None
    try:
        log_path = tmp_path / "serve.log"
        serve = start_serve([str(recipe_path)], server.env, log_path)
        client = SyncPrefectClient(server.api_url)

        def deployed() -> Any:
            return serving(
                serve, log_path, lambda: client.read_deployment_by_name(f"post-train/{NAME}")
            )

        dep = wait_for("the deployment", deployed, 120)
        run = client.create_flow_run_from_deployment(dep.id, parameters=dep.parameters)
        wait_for("sft to train", lambda: _train_steps(sft_dir) >= 3, 300)

        server.stop()
        down_at, step_down = time.monotonic(), _train_steps(sft_dir)
        time.sleep(OUTAGE_S)
        step_back = _train_steps(sft_dir)
        assert serve.poll() is None, "posttrain serve died during the outage"
        server = start_server(server.home, server.port)
        back_at = time.monotonic()
        print(
            f"outage {back_at - down_at:.0f} s (server healthy again included); sft trained "
            f"steps {step_down} -> {step_back} while the server was down"
        )
        assert step_back > step_down, "the stage stopped training while the server was down"

        client = SyncPrefectClient(server.api_url)
        final = wait_for(
            "the run to end",
            lambda: (r := client.read_flow_run(run.id)).state.is_final() and r,
            600,
            every=2,
        )
        print(f"run ended {final.state.name} {time.monotonic() - back_at:.0f} s after the restart")
        assert final.state.name == "Completed", (final.state, log_path.read_text()[-4000:])
        assert verify(sft_dir)[0] and verify(dirs["export"])[0]
        assert "resumed from" not in (sft_dir / "logs" / "stage.log").read_text()
    finally:
        if serve is not None:
            stop_group(serve)
        server.stop()
