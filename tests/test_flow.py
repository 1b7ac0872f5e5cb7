"""The `post-train` flow on a Prefect test server, with tiny stand-in stage modules.

The stage registry is pointed at modules written by the test (same stage names, same harness,
same spec/manifest contract), so this checks the orchestration itself in about a minute:
reusing artifacts across runs, re-running only downstream of a change, rebuilding an artifact
whose files were altered, and the run folder. The end-to-end test against the real stages
lives with them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from uuid import UUID

import pytest
from stage_modules import write_stage_modules

import posttrain.plan.planner
from flows.devices import device_set_name
from flows.post_train import post_train
from flows.report.tables import RunResult
from posttrain.config.schema import Recipe
from posttrain.kinds import KINDS
from posttrain.runtime.device_lock import DIR_ENV, DeviceLock

pytestmark = pytest.mark.slow

NAMES = tuple(KINDS)
# The stages a recipe without reward/dpo sections runs.
PLANNED = ("ingest", "sft", "evaluate", "export")


def _stand_ins(folder: Path, mp: pytest.MonkeyPatch, kinds: dict[str, str]) -> None:
    """Point the stage registry at stand-in modules written into `folder`: same graph
    (parents, optional stages), one process each; `kinds` picks ok/fail/hang per stage."""
    write_stage_modules(folder, NAMES)
    mp.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    registry = {
        s.name: dataclasses.replace(s, module=f"pt_{kinds[s.name]}_{s.name}", distributed=False)
        for s in KINDS.values()
    }
    mp.setattr(posttrain.plan.planner, "KINDS", registry)


@pytest.fixture
def fake_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    kinds = {name: "ok" for name in NAMES}

    def use(**overrides: str) -> None:
        kinds.update(overrides)
        _stand_ins(tmp_path / "mods", monkeypatch, kinds)

    use()
    return use  # type: ignore[return-value]


def _recipe(workspace: Path, **sections: dict) -> Recipe:
    data = {
        "run": {"name": "flow-test", "workspace": str(workspace)},
        "infra": {"device": "cpu", "precision": "fp32"},
        "ingest": {"source": "from_config"},
        "sft": {"data": {"synthetic": {"n_examples": 20}}},
        **sections,
    }
    return Recipe.model_validate(data)


def _prefect_view(run_dir: str) -> tuple[str, dict[str, list], dict[str, str]]:
    """(flow run name, {artifact type: [(key, data)]}, {task run name: its state's name}) of
    the flow run that wrote `run_dir`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    flow_run_id = UUID(json.loads((Path(run_dir) / "lineage.json").read_text())["flow_run_id"])
    only_this_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(flow_run_id).name
        artifacts = client.read_artifacts(artifact_filter=only_this_run)
        tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    by_type: dict[str, list] = {}
    for a in artifacts:
        by_type.setdefault(a.type, []).append((a.key, a.data))
    states = {t.name: t.state.name for t in tasks if t.state is not None}
    return name, by_type, states


def _flow_log(run_dir: str, timeout_s: float = 60) -> str:
    """The log lines the flow run that wrote `run_dir` sent to the Prefect server: waits for
    its last line (Prefect ships logs in batches, after the flow has returned)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    flow_run_id = UUID(json.loads((Path(run_dir) / "lineage.json").read_text())["flow_run_id"])
    only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=only_this_run)
            # The flow's own last line (its tasks log one of their own, with a task run id).
            done = any(x.task_run_id is None and "Finished in state" in x.message for x in logs)
            if done or time.monotonic() > deadline:
                return "\n".join(x.message for x in logs)
            time.sleep(0.5)


def _statuses(result: RunResult) -> dict[str, str]:
    return {r.stage: r.status for r in result.stages}


class _FlowLines(logging.Handler):
    """The lines the flow run logger logs in this process, each with when it was logged."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic(), record.getMessage()))

    def when(self, needle: str) -> float | None:
        return next((t for t, line in list(self.lines) if needle in line), None)


def _run_while_held(
    busy: DeviceLock, recipe: Recipe, hold_s: float, until: str | None = None
) -> tuple[RunResult, bool]:
    """The flow's result on `recipe` while `busy` holds the devices for up to `hold_s`, and
    whether the run finished while they were held (a run that waits for them cannot). With
    `until`, they are released as soon as the run logs a line holding it, and the run must
    then take them only after that release: a fixed window would wait out its whole length."""
    assert busy.try_acquire({"what": "posttrain run", "flow_run_name": "busy-run"})
    lines, logger = _FlowLines(), logging.getLogger("prefect.flow_runs")
    logger.addHandler(lines)
    results: list[RunResult] = []
    run = threading.Thread(target=lambda: results.append(post_train(recipe)))
    try:
        run.start()
        deadline = time.monotonic() + hold_s
        while run.is_alive() and time.monotonic() < deadline:
            if until is not None and lines.when(until) is not None:
                break
            run.join(timeout=0.1)
        finished = not run.is_alive()
    finally:
        busy.release()
        released = time.monotonic()
        run.join(timeout=300)
        logger.removeHandler(lines)
    if until is not None and not finished:
        took = lines.when("holding posttrain-devices")
        assert took is not None and took > released, "the run took the devices while held"
    return results[0], finished


def _launches(workspace: Path) -> int:
    logs = workspace.glob("artifacts/*/*/logs/stage.log")
    return sum(p.read_text().count("=== ") for p in logs)


def test_flow_caches_reruns_downstream_and_records_runs(
    prefect_harness: None, fake_stages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "device-locks"))  # not the machine's own
    busy = DeviceLock(device_set_name("cpu"))  # another run's hold on the devices
    ws = tmp_path / "ws"
    recipe = _recipe(ws)

    first = post_train(recipe)
    # reward and dpo are optional and this recipe has no sections for them: they do not run.
    assert _statuses(first) == dict.fromkeys(PLANNED, "ran")
    assert _launches(ws) == 4
    export = next(s for s in first.stages if s.stage == "export")
    assert first.export_path == str(Path(export.uri) / "model")
    assert export.summary.headline == {"loss": 0.667, "steps": 3}
    run_dir = Path(first.run_dir)
    assert run_dir.parent == ws / "runs"
    lineage = json.loads((run_dir / "lineage.json").read_text())
    arts = {a["stage"]: a for a in lineage["artifacts"]}
    assert arts["evaluate"]["parents"] == [
        arts["ingest"]["fingerprint"],
        arts["sft"]["fingerprint"],
    ]
    assert all(len(a["sha256"]) == 64 for a in arts.values())
    assert "| sft | ran |" in (run_dir / "report.md").read_text()
    assert "name: flow-test" in (run_dir / "recipe.resolved.yaml").read_text()
    assert not (ws / ".prefect").exists(), "no Prefect result cache: the artifacts are the cache"
    name, artifacts, states = _prefect_view(first.run_dir)
    assert states == dict.fromkeys(PLANNED, "Completed")
    assert name.startswith("flow-test-")
    progress = sorted(artifacts["progress"])
    assert [k for k, _ in progress] == [f"{n}-progress" for n in sorted(PLANNED)]
    assert all(float(data) == 100.0 for _, data in progress)
    assert [k for k, _ in artifacts["markdown"]] == ["flow-test-report"]
    assert [k for k, _ in artifacts["table"]] == ["flow-test-metrics"]

    # Same recipe while another run holds the devices: every artifact is found complete, so the
    # run reuses them without waiting, and nothing is launched; the Prefect UI shows each
    # stage's task in a state named with the report's word.
    # Generous: a run that waits for the devices never finishes while they are held.
    second, finished = _run_while_held(busy, recipe, hold_s=300)
    assert finished, "a run that trains nothing waited for the devices"
    assert _statuses(second) == dict.fromkeys(PLANNED, "reused")
    log = _flow_log(second.run_dir)
    assert "every stage's artifact is complete: reusing them without waiting for" in log
    assert "held by another run" not in log and "holding posttrain-devices" not in log
    assert _launches(ws) == 4
    assert second.run_dir != first.run_dir
    assert "| export | reused |" in (Path(second.run_dir) / "report.md").read_text()
    # The report is made at flow level, so it exists although no stage ran.
    _, artifacts, states = _prefect_view(second.run_dir)
    assert states == dict.fromkeys(PLANNED, "Reused")
    assert "progress" not in artifacts
    report = artifacts["markdown"][0][1]
    assert "| export | reused |" in report

    # A change to evaluate's section re-runs evaluate and what depends on it, nothing upstream.
    changed = _recipe(ws, evaluate={"max_eval_rows": 7})
    third = post_train(changed)
    assert _statuses(third) == {
        "ingest": "reused", "sft": "reused", "evaluate": "ran", "export": "ran",
    }  # fmt: skip
    assert _launches(ws) == 6

    # An artifact whose files were deleted is rebuilt, and found complete the next time.
    export_dir = Path(third.export_path).parent
    (export_dir / "model" / "weights.txt").unlink()
    fourth = post_train(changed)
    assert _statuses(fourth)["export"] == "ran"
    assert _launches(ws) == 7
    assert _statuses(post_train(changed))["export"] == "reused"

    # The same size with other bytes: the look before the run (sizes) passes, the supervisor's
    # (hashes) does not. The run stops before launching anything, waits for the devices, and
    # rebuilds the export once they are free.
    weights = export_dir / "model" / "weights.txt"
    weights.write_text(weights.read_text().upper())
    # Held until the run says it waits for them (a run that does not wait finishes instead);
    # the log's order below shows the wait whatever the machine's load.
    outcome, finished = _run_while_held(busy, changed, hold_s=120, until="held by another run")
    assert not finished, "the export was rebuilt without waiting for the devices"
    assert _statuses(outcome)["export"] == "ran" and _launches(ws) == 8
    log = _flow_log(outcome.run_dir)
    assert "stage export has no complete artifact in" in log
    assert "waiting for the devices after all" in log and "busy-run" in log
    assert log.index("after all") < log.index("holding posttrain-devices")

    # A bounded wait (`--wait-devices`): while the other run holds the devices, training a stage
    # of its own at step 3 of 10 at one step a second, a run with an edit to train fails after
    # infra.wait_devices_s, naming the holder, its stage, step and ETA, and starts nothing.
    _bounded_wait_names_the_holder(busy, ws, tmp_path / "holder-sft")
    assert _launches(ws) == 8


def _bounded_wait_names_the_holder(busy: DeviceLock, ws: Path, holder_stage: Path) -> None:
    from flows.devices import DevicesBusy
    from flows.failure_block import known_block

    holder_stage.mkdir()
    train = [{"kind": "train", "step": k, "total_steps": 10, "time": 100.0 + k} for k in (1, 2, 3)]
    (holder_stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    assert busy.try_acquire({"what": "posttrain run", "flow_run_name": "busy-run"})
    busy.update(stage="sft", out_dir=str(holder_stage))
    infra = {"device": "cpu", "precision": "fp32", "wait_devices_s": 2}
    t0 = time.monotonic()
    try:
        with pytest.raises(DevicesBusy) as info:
            post_train(_recipe(ws, evaluate={"max_eval_rows": 5}, infra=infra))
    finally:
        busy.release()
    assert time.monotonic() - t0 < 90  # bounded: 2 s of waiting and the run's own start
    what = str(info.value)
    assert "stayed held for 2.0 s by another run: pid" in what and "busy-run" in what
    assert what.endswith(": stage sft, step 3/10, ETA 7.0 s")
    block = known_block(info.value)
    assert block is not None and block.head == "posttrain: the devices stayed busy (no stage ran)"
    assert "--wait-devices SECONDS" in block.fix


@pytest.fixture(scope="module")
def handed_side_by_side(
    prefect_harness: None, tmp_path_factory: pytest.TempPathFactory
) -> RunResult:
    """One run that two tests read: `posttrain run`'s way (the plan made before the flow and
    handed to it, `--until evaluate`) of a recipe with a reward model trained beside the SFT
    (`from: ingest`) and infra.parallel_stages 2. Planning inside the flow raises."""
    import flows.post_train
    from posttrain.config.loader import resolve

    tmp = tmp_path_factory.mktemp("side-by-side")
    rm = {"kind": "reward", "name": "rm", "from": "ingest", "data": {"synthetic": {}}}
    recipe = _recipe(tmp / "ws", stages=[rm])
    recipe.infra.parallel_stages = 2

    def planned_again(recipe: object) -> None:
        raise AssertionError("the flow planned the run again")

    with pytest.MonkeyPatch.context() as mp:
        _stand_ins(tmp / "mods", mp, {name: "ok" for name in NAMES})
        # Only the two branches last long enough to show they overlap, whatever the load.
        mp.setenv("PT_OK_SLEEP_S", "3")
        mp.setenv("PT_OK_SLEEP_STAGES", "sft,reward")
        run_plan = posttrain.plan.planner.plan(resolve(recipe))
        mp.setattr(flows.post_train, "plan", planned_again)
        with flows.post_train.handing(run_plan):
            return post_train(run_plan.recipe, until=["evaluate"])


def test_a_run_handed_its_plan_does_not_plan_again(handed_side_by_side: RunResult) -> None:
    """`posttrain run` plans before Prefect starts and hands the flow that plan: Prefect passes
    the very recipe object through, so the flow runs the handed plan (its --until too) and plans
    nothing."""
    assert _statuses(handed_side_by_side) == dict.fromkeys(
        ["ingest", "sft", "rm", "evaluate"], "ran"
    )
    lineage = json.loads((Path(handed_side_by_side.run_dir) / "lineage.json").read_text())
    assert lineage["not_selected"] == ["export"]


def test_independent_branches_run_side_by_side_when_allowed(
    handed_side_by_side: RunResult,
) -> None:
    """A reward model trained beside the SFT (`from: ingest`) runs at the same time as it with
    infra.parallel_stages 2; evaluate waits for both; the report draws the graph."""
    result = handed_side_by_side
    assert _statuses(result) == dict.fromkeys(["ingest", "sft", "rm", "evaluate"], "ran")
    uris = {s.stage: Path(s.uri) for s in result.stages}
    span = {n: json.loads((uris[n] / "logs" / "span.json").read_text()) for n in uris}
    assert span["sft"][0] < span["rm"][1] and span["rm"][0] < span["sft"][1], span
    assert span["evaluate"][0] >= max(span["sft"][1], span["rm"][1])
    run_dir = Path(result.run_dir)
    assert (run_dir / "graph.png").stat().st_size > 5_000
    assert "![stage graph](graph.png)" in (run_dir / "report.md").read_text()
