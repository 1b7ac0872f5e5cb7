"""The three ways in, against a real `prefect server start` and a real `posttrain serve`.

One server and one serve process for the module (starting them costs ~30 s). The tests run in
file order and build on each other, as a user's day would:
  1. the server rejects an invalid recipe before a run exists;
  2. the scheduled deployment has its upcoming runs, in its time zone;
  3. served runs cannot widen their reach: reward code, or `run.allowed_paths: ["/"]` with a data
     path outside it, sent as the UI's Run form would, fails the run before any stage (serve is
     started with `--allow-path DIR`, and its log lists the folders runs may read);
  4. `posttrain submit` starts a run that waits while another holder has the devices, then
     completes (the served recipe as it is still runs under `--allow-path`); its report artifact
     is readable through the API; its ingest publishes the base;
  5. that event started the retraining deployment on that base; cancelling it mid-SFT (under
     torchrun) leaves no stage process and keeps its ingest artifact for the next run;
  6. the Prefect UI renders the report artifact of the finished run (headless Chromium);
  7. stopping `posttrain serve` does not pause the schedules;
  8. prefect.yaml deploys the same kind of deployments to a process work pool.
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prefect_server import cancel_from_ui, serving, start_serve, stop_group, wait_for
from stage_helpers import SMALL_EVALUATE, TINY, write_recipe

from posttrain.store.artifacts import verify

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
POSTTRAIN = [sys.executable, "-m", "flows.cli"]
SERVED = "served"
NIGHTLY = "nightly"
# Shared between the ordered tests of this module.
STATE: dict[str, Any] = {}


def _recipe(folder: Path, name: str, **changes: Any) -> Path:
    data = copy.deepcopy(TINY)
    data["run"]["name"] = name
    data["infra"]["threads_per_rank"] = 1
    data["sft"]["max_steps"] = 6
    # The tests read that each stage ran and what the report holds, not the model's quality: a
    # short warm-up and a small evaluate keep the completed run's stages short.
    data["ingest"]["from_config"]["pretrain_steps"] = 20
    data["evaluate"] = copy.deepcopy(SMALL_EVALUATE)
    data["promotion"] = {"enabled": True}
    for key, value in changes.items():
        data[key] = value if not isinstance(value, dict) else {**data.get(key, {}), **value}
    folder.mkdir(parents=True, exist_ok=True)
    return write_recipe(folder, data)


def _client(server: Any) -> Any:
    """A sync Prefect client bound to the test server, whatever the session's settings say."""
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(server.api_url)


def _flow_run_processes(flow_run_id: str) -> list[psutil.Process]:
    from flows.stage.procs import tagged_processes
    from posttrain.runtime.spec import tag_flow_run_id

    return tagged_processes(lambda tag: tag_flow_run_id(tag) == flow_run_id)


@pytest.fixture(scope="module")
def served(prefect_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """`posttrain serve` of two recipes: `served` (on request) and `nightly` (cron in
    Europe/Paris, retrains on a new base; its SFT is long and runs under torchrun on 2 ranks,
    so cancelling it has a process tree to clean up)."""
    tmp = tmp_path_factory.mktemp("served")
    recipes = {
        SERVED: _recipe(tmp / SERVED, SERVED),
        NIGHTLY: _recipe(
            tmp / NIGHTLY,
            NIGHTLY,
            # New bases come from the served pipeline's workspace: a folder this one must allow.
            run={"allowed_paths": [str(tmp)]},
            infra={"devices_per_node": 2},
            sft={"max_steps": 5000},
            schedule={"cron": "0 3 * * *", "timezone": "Europe/Paris", "on_new_base": True},
        ),
    }
    # A folder the operator lets served runs read (outside both recipes' folders).
    shared = tmp_path_factory.mktemp("worker-shared")
    log_path = tmp / "serve.log"
    args = [str(recipes[SERVED]), str(recipes[NIGHTLY]), "--allow-path", str(shared)]
    proc = start_serve(args, prefect_server.env, log_path)
    client = _client(prefect_server)

    def deployments() -> bool:
        # Only ours: fault tests on the same session server serve deployments of their own.
        names = {SERVED, NIGHTLY}
        return serving(proc, log_path, lambda: names <= {d.name for d in client.read_deployments()})

    try:
        wait_for("both deployments", deployments, 120)
        yield {
            "proc": proc,
            "recipes": recipes,
            "client": client,
            "log": log_path,
            "env": prefect_server.env,
            "shared": shared,
        }
    finally:
        stop_group(proc)
        for p in psutil.Process().children(recursive=True):
            # Nothing the serve process started may outlive the module.
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "serve" in p.cmdline():
                p.kill()


def _deployment(served: dict, name: str) -> Any:
    return served["client"].read_deployment_by_name(f"post-train/{name}")


def _runs_of(served: dict, name: str) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    dep = _deployment(served, name)
    return served["client"].read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))
    )


def test_server_rejects_an_invalid_recipe_before_a_run_exists(served: dict) -> None:
    from prefect.exceptions import PrefectHTTPStatusError

    dep = _deployment(served, SERVED)
    assert dep.enforce_parameter_schema
    # The UI form is the recipe schema: nested sections, Literal choices and limits.
    schema = dep.parameter_openapi_schema
    assert {"Recipe", "SFTConfig", "InfraConfig", "ScheduleConfig"} <= set(schema["definitions"])
    bad = copy.deepcopy(dep.parameters)
    bad["recipe"]["infra"]["device"] = "tpu"
    # Runs of this deployment only: the scheduler adds the nightly one's meanwhile.
    assert _runs_of(served, SERVED) == []
    with pytest.raises(PrefectHTTPStatusError, match="recipe.infra.device"):
        served["client"].create_flow_run_from_deployment(dep.id, parameters=bad)
    assert _runs_of(served, SERVED) == []
    # The CLI validates first, naming the field, and never reaches the server.
    out = subprocess.run(
        [*POSTTRAIN, "submit", str(served["recipes"][SERVED]), "sft.optim.lr=-1"],
        env=served["env"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "sft.optim.lr: must be > 0, got -1" in out.stderr


def test_scheduled_deployment_has_upcoming_runs_in_its_time_zone(served: dict) -> None:
    dep = _deployment(served, NIGHTLY)
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in dep.schedules] == [
        ("0 3 * * *", "Europe/Paris", True)
    ]

    def upcoming() -> list[Any]:
        return [r for r in _runs_of(served, NIGHTLY) if r.state and r.state.name == "Scheduled"]

    runs = wait_for("scheduled runs of the nightly deployment", upcoming, 60)
    from zoneinfo import ZoneInfo

    for run in runs:
        local = run.expected_start_time.astimezone(ZoneInfo("Europe/Paris"))
        assert (local.hour, local.minute) == (3, 0), local


def test_served_log_lists_the_worker_folders(served: dict) -> None:
    text = served["log"].read_text()
    assert f"served runs may read from: {served['shared']}" in text
    # The served recipe's own workspace.
    assert str(served["recipes"][SERVED].parent / "ws") in text


def test_ui_run_reaching_outside_the_worker_is_refused_before_any_stage(
    served: dict, tmp_path: Path
) -> None:
    """Parameters as the UI's Run form would send them: the served recipe with reward functions
    from a module of its own choosing and `os:system`, `run.allowed_paths` set to `/` and a data
    path at /etc/hostname. The server accepts them (a valid recipe), but the flow refuses the run
    before any stage starts, naming each field, and never imports the module: a served run may
    import reward functions only from posttrain.rewards and the worker's reward folders, and
    read only inside the worker's folders, and start no server command (a judge's here) the
    worker does not allow. (One run carries both refusals: the flow lists every
    field it refuses in one message, and each run costs a flow process.)"""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    marker = tmp_path / "imported"
    evil = tmp_path / "evil_rewards.py"
    evil.write_text(
        f"open({str(marker)!r}, 'w').close()\n\n"
        "def hit(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    dep = _deployment(served, SERVED)
    params = copy.deepcopy(dep.parameters)
    recipe = params["recipe"]
    started = tmp_path / "started"
    judge = {"command": f"touch {started}", "model": "m", "rubric": "Rate: {completion}"}
    recipe["grpo"] = {
        "data": {"synthetic": {"n_examples": 40}},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2},
        "rewards": [{"fn": f"{evil}:hit"}, {"fn": "os:system", "name": "shell"}, {"judge": judge}],
    }
    recipe["run"]["allowed_paths"] = ["/"]
    recipe["sft"]["data"].update(synthetic=None, path="/etc/hostname")
    client = served["client"]
    run = client.create_flow_run_from_deployment(dep.id, parameters=params)
    run = wait_for(
        "the refused run to end",
        lambda: (r := client.read_flow_run(run.id)).state.is_final() and r,
        180,
        every=2,
    )
    assert run.state.name == "Failed", run.state
    message = run.state.message or ""
    for i, fn in enumerate((f"{evil}:hit", "os:system")):
        assert f"grpo.rewards.{i}.fn: {fn} is not a built-in" in message, message
    assert "allows no reward code of its own" in message
    assert "run.allowed_paths.0: / is outside the folders this worker allows (" in message
    assert str(served["shared"]) in message
    assert "sft.data.path: /etc/hostname is outside this served run's" in message
    assert (
        f"grpo.rewards.2.judge.command: `touch {started}` is not a command this worker" in message
    )
    assert not marker.exists() and not started.exists()
    assert _flow_run_processes(str(run.id)) == []
    # Refused before anything ran: no task run (no stage) exists for it.
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert tasks == []


def test_submit_wait_prints_why_a_served_run_was_refused(served: dict, tmp_path: Path) -> None:
    """`posttrain submit ... run.workspace=<elsewhere> --wait`: the submitter reads the reason
    (not only `Failed`), and the worker's log has it as one line, with no Prefect traceback."""
    log = served["log"]
    before = len(log.read_text())
    elsewhere = tmp_path / "elsewhere"
    out = subprocess.run(
        [*POSTTRAIN, "submit", str(served["recipes"][SERVED]), f"run.workspace={elsewhere}"]
        + ["--wait"],
        env=served["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-2].startswith(f"{SERVED}-") and lines[-2].endswith(": Failed"), lines
    assert lines[-1].startswith(
        f"  recipe refused (no stage ran): run.workspace: {elsewhere} is outside the folders "
        "this worker allows ("
    ), lines
    assert str(served["shared"]) in lines[-1]
    # The worker's log: the reason once per line that says it, and no traceback for it.
    wait_for(
        "the worker's log of the run", lambda: "Finished in state" in log.read_text()[before:], 60
    )
    logged = log.read_text()[before:]
    assert f"run.workspace: {elsewhere} is outside the folders this worker allows (" in logged
    assert "Traceback" not in logged, logged


HOLD_DEVICES = """
import sys
from flows.devices import ensure_device_limit, hold_devices
ensure_device_limit(sys.argv[1])
with hold_devices(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
"""


def _waits_for_the_devices(served: dict, run_id: str, slot: str, since: int) -> None:
    """The run says it waits for the devices (its log in serve's, from offset `since`), and no
    stage of it ran meanwhile or runs shortly after: no process, no ingest launched."""
    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan

    recipe = load_recipe(served["recipes"][SERVED])
    ingest = next(s.out_dir for s in plan(recipe).stages if s.name == "ingest")
    said = f"waiting for the devices: {slot} is held by another run"

    def waiting() -> bool:
        # Checked at every poll: an ingest launched before the wait is caught while it runs.
        assert _flow_run_processes(run_id) == [], "a stage started without the devices"
        return said in served["log"].read_text()[since:]

    wait_for("the run to wait for the devices", waiting, 120)
    time.sleep(2)  # a launch right after the wait began would be a process by now
    assert _flow_run_processes(run_id) == [], "a stage started without the devices"
    assert not (ingest / "logs" / "spec.json").exists(), "the ingest was launched"


def test_submitted_run_waits_for_the_devices_then_completes(
    served: dict, prefect_server: Any
) -> None:
    from flows.devices import device_set_name
    from posttrain.config.loader import load_recipe

    recipe_path = served["recipes"][SERVED]
    slot = device_set_name(load_recipe(recipe_path))
    client = served["client"]
    # Another holder (as a second run would be) has the devices: the run must wait. It is a
    # process of its own, bound to this server only by its environment, as a second run is.
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_DEVICES, slot],
        cwd=ROOT,
        env=prefect_server.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        since = len(served["log"].read_text())
        out = subprocess.run(
            [*POSTTRAIN, "submit", str(recipe_path)],
            env=prefect_server.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        url = out.stdout.strip().splitlines()[-1]
        assert url.startswith(f"{prefect_server.ui_url}/runs/flow-run/"), url
        run_id = url.rsplit("/", 1)[1]
        wait_for(
            "the run to start", lambda: client.read_flow_run(run_id).state.name == "Running", 120
        )
        _waits_for_the_devices(served, run_id, slot, since)
        assert client.read_flow_run(run_id).state.name == "Running"
        limit = client.read_global_concurrency_limit_by_name(slot)
        assert (limit.limit, limit.active_slots) == (1, 1)
    finally:
        holder.communicate(timeout=30)  # closing stdin releases the slot
    assert holder.returncode == 0
    run = wait_for(
        "the run to finish",
        lambda: (r := client.read_flow_run(run_id)).state.is_final() and r,
        420,
        every=2,
    )
    # The served recipe as it is runs: `--allow-path` and the reach check refuse none of it.
    assert run.state.name == "Completed", served["log"].read_text()[-4000:]
    STATE["served_run"] = run_id

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
    )
    by_key = {a.key: a for a in artifacts if a.key}
    report = by_key[f"{SERVED}-report"].data
    assert report.startswith(f"# posttrain run `{SERVED}`")
    for stage in ("ingest", "sft", "evaluate", "export"):
        assert f"| {stage} | ran |" in report
    assert "## Promotion" in report and "first candidate" in report
    rows = by_key[f"{SERVED}-metrics"].data
    assert any(row["stage"] == "sft" and row["metric"] == "eval_loss" for row in _rows(rows))
    # The ingest ran, so the base it built was announced.
    events = client.request(
        "POST",
        "/events/filter",
        json={"filter": {"event": {"name": ["posttrain.base.published"]}}, "limit": 10},
    ).json()["events"]
    published = [e for e in events if e["resource"]["posttrain.plan.planner"] == SERVED]
    assert len(published) == 1
    base = Path(published[0]["resource"]["posttrain.base.path"])
    assert (base / "config.json").is_file() and (base / "tokenizer.json").is_file()
    STATE["base"] = str(base)


def _rows(data: Any) -> list[dict]:
    import json

    return json.loads(data) if isinstance(data, str) else data


def test_new_base_triggers_retraining_and_cancel_leaves_no_process(served: dict) -> None:

    assert "base" in STATE, "needs the submitted run of the previous test"
    client = served["client"]

    def triggered() -> Any:
        runs = [
            r
            for r in _runs_of(served, NIGHTLY)
            if r.parameters["recipe"]["ingest"].get("path") == STATE["base"]
        ]
        return runs[0] if runs else None

    run = wait_for("the event-triggered nightly run", triggered, 60)
    assert run.parameters["recipe"]["ingest"]["source"] == "path"

    # Wait for SFT under torchrun: the launcher and both ranks carry the flow run's id.
    def sft_running() -> list[psutil.Process]:
        procs = _flow_run_processes(str(run.id))
        return procs if len(procs) >= 3 else []

    procs = wait_for("the nightly SFT ranks", sft_running, 240)
    assert any("torch.distributed.run" in " ".join(p.cmdline()) for p in procs)
    cancel_from_ui(client, run.id)
    # Nothing of the run is left: not the flow process, not torchrun, not a rank.
    wait_for("every stage process to exit", lambda: not _flow_run_processes(str(run.id)), 30)
    assert served["proc"].poll() is None, "the serve process must survive a cancel"
    # The ingest it finished is intact, and a re-run would reuse it.
    from posttrain.config.loader import load_recipe
    from posttrain.plan.planner import plan

    recipe = load_recipe(
        served["recipes"][NIGHTLY], ["ingest.source=path", f"ingest.path={STATE['base']}"]
    )
    stages = {s.name: s for s in plan(recipe).stages}
    assert verify(stages["ingest"].out_dir)[0]
    assert not (stages["sft"].out_dir / "manifest.json").exists()


def test_ui_renders_the_report_artifact_of_a_finished_run(prefect_server: Any) -> None:
    assert "served_run" in STATE, "needs the completed run of an earlier test"
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium package is needed (scripts/dev.sh installs it)"
    from playwright.sync_api import sync_playwright

    url = f"{prefect_server.ui_url}/runs/flow-run/{STATE['served_run']}"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium,
            # This machine has no route out: Chromium's background fetches only add noise.
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        try:
            page = browser.new_page()
            page.goto(url)
            page.locator("li.p-tab", has_text="Artifacts").click()
            card = page.get_by_text(f"{SERVED}-report").first
            card.wait_for(timeout=60_000)
            card.click()
            # The markdown is rendered, not shown raw: its headings and tables are elements.
            page.locator("h1", has_text="posttrain run").first.wait_for(timeout=60_000)
            headings = page.locator("h2").all_inner_texts()
            assert "Promotion" in headings, headings
            assert page.locator("table tr", has_text="sft").count() >= 1
            assert "| sft |" not in page.inner_text("body")
        finally:
            browser.close()


def test_one_ctrl_c_stops_serve_and_keeps_the_schedules_active(served: dict) -> None:
    """A terminal's Ctrl-C (SIGINT to the foreground group) stops serve at once, saying so."""
    proc = served["proc"]
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=20)
    took = time.monotonic() - t0
    tail = served["log"].read_text()[-2000:]
    print(f"\nserve stopped {took:.1f} s after one SIGINT")
    assert took < 10, tail
    assert "posttrain serve: stopped; the deployments' schedules stay active" in tail, tail
    assert "Traceback" not in tail, tail
    dep = _deployment(served, NIGHTLY)
    assert not dep.paused
    assert [s.active for s in dep.schedules] == [True]


def test_prefect_yaml_deploys_to_a_process_work_pool(prefect_server: Any, served: dict) -> None:
    env = {**prefect_server.env, "POSTTRAIN_HOME": str(ROOT)}
    prefect = [sys.executable, "-m", "prefect"]
    # The deployment this test reads, not `--all`: each of prefect.yaml's 13 deployments goes
    # through the same steps (its parameters are not checked against the schema on create, and
    # test_docs checks they are the recipes'), and each sends the 200 KB recipe schema to a
    # SQLite server busy with the session's other runs (5-10 s each, with 503 retries).
    for cmd in (
        [*prefect, "work-pool", "create", "posttrain", "--type", "process"],
        [*prefect, "--no-prompt", "deploy", "--name", "quickstart"],
    ):
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    dep = _deployment(served, "quickstart")
    assert dep.work_pool_name == "posttrain" and dep.enforce_parameter_schema
    assert dep.entrypoint == "flows/post_train.py:post_train"
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in dep.schedules] == [
        ("0 3 * * *", "Europe/Paris", False)
    ]
    # Relative to $POSTTRAIN_HOME, where the process worker runs the flow.
    assert dep.parameters["recipe"]["run"]["workspace"] == "workspace"
    # `{{ $POSTTRAIN_HOME }}` is filled in when `prefect deploy` runs.
    assert dep.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
    ]
