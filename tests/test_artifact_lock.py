"""Two runs of the same stage at once: one runs, the other waits for it and reuses its artifact;
the folder is never written by both (posttrain.store.locking, flows.stage.supervise)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.stage.supervise import supervise_stage
from posttrain.config.loader import resolve, validate_recipe
from posttrain.plan.planner import plan, spec_for
from posttrain.runtime.spec import LaunchInfo, PlannedStage, StageSpec
from posttrain.store.artifacts import read_manifest, stage_dir, verify, write_manifest
from posttrain.store.locking import ArtifactLock, LockTimeout, lock_path

ROOT = Path(__file__).resolve().parents[1]
FP = "0123456789abcdef"

# A stage that writes its output in pieces, so two unsynchronised runs would interleave (a torn
# result.bin, two entries in runs.log). It starts writing only once $PT_RELEASE exists, so the
# test can first see the second run waiting, however slowly the machine starts processes.
SLOW_STAGE = """
import os
import time
from pathlib import Path

from posttrain.stages.common import stage_main


def run(ctx):
    with open(os.environ["PT_RUNS_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\n")
    release, deadline = Path(os.environ["PT_RELEASE"]), time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(ctx.stage.out_dir / "result.bin", "ab") as f:
        for i in range(20):
            f.write(bytes([i]) * 1000)
            f.flush()
            time.sleep(0.05)
    return {"headline": {"bytes": 20000}}


if __name__ == "__main__":
    stage_main(run, kind="ingest")
"""


@pytest.fixture
def slow_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[PlannedStage, StageSpec, Path]:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "pt_slow_stage.py").write_text(SLOW_STAGE)
    runs = tmp_path / "runs.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), str(ROOT)]))
    monkeypatch.setenv("PT_RUNS_LOG", str(runs))
    monkeypatch.setenv("PT_RELEASE", str(tmp_path / "release"))
    workspace = tmp_path / "ws"
    stage = PlannedStage(
        name="ingest",
        module="pt_slow_stage",
        fingerprint=FP,
        out_dir=stage_dir(workspace, "ingest", FP),
        parents={},
        nprocs=1,
        timeout_s=120,
        inputs={"section": {"source": "from_config"}},
    )
    return stage, spec_for(stage, resolve(validate_recipe(_recipe(workspace))), {}), runs


def _recipe(workspace: Path) -> dict[str, Any]:
    return {
        "run": {"workspace": str(workspace)},
        "infra": {"device": "cpu", "precision": "fp32"},
        "ingest": {"source": "from_config"},
        "sft": {"data": {"synthetic": {}}},
    }


def _intact(out_dir: Path) -> None:
    assert verify(out_dir) == (True, "")
    data = (out_dir / "result.bin").read_bytes()
    assert data == b"".join(bytes([i]) * 1000 for i in range(20)), "torn or doubled output"


def _wait_for(what: str, check: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _in_threads(*calls: Any, before_join: Any = None) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int, call: Any) -> None:
        try:
            results[i] = call()
        except BaseException as exc:  # reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for i, t in enumerate(threads):
        t.start()
        if i == 0:
            time.sleep(0.3)  # the first one takes the lock
    if before_join is not None:
        before_join()
    for t in threads:
        t.join(timeout=120)
    assert not any(isinstance(r, BaseException) for r in results), results
    return results


def test_lock_excludes_a_second_holder_and_records_the_owner(tmp_path: Path) -> None:
    out = tmp_path / "artifacts" / "sft" / FP
    first, second = ArtifactLock(out), ArtifactLock(out)
    assert first.path == lock_path(out) == out.with_name(f"{FP}.lock")
    assert first.try_acquire({"what": "first"})
    assert not second.try_acquire({"what": "second"})  # even from this same process
    assert first.holder()["what"] == "first" and first.holder()["pid"] == os.getpid()
    seen: list[Any] = []
    with pytest.raises(LockTimeout, match=r"still held by pid \d+ .*\(first, since"):
        second.acquire({}, on_wait=seen.append, timeout_s=0.3, poll_s=0.05)
    assert seen and seen[0]["what"] == "first"
    first.release()
    assert second.acquire({"what": "second"}, poll_s=0.05) is False  # no wait needed
    second.release()
    assert not out.exists(), "the lock lives beside the folder, never in it"


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    out = tmp_path / "artifacts" / "sft" / FP
    code = (
        "import sys, time; from posttrain.store.locking import ArtifactLock; "
        f"assert ArtifactLock({str(out)!r}).try_acquire({{}}); print('held', flush=True); "
        "time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert not ArtifactLock(out).try_acquire({})
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        lock = ArtifactLock(out)
        assert lock.acquire({}, timeout_s=5, poll_s=0.05) is False
        lock.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stage_process_refuses_a_spec_no_supervisor_holds(
    slow_stage: tuple[PlannedStage, StageSpec, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Only a supervisor that holds the artifact's lock has looked at the folder and may let a
    process write it: a spec without its launch record, or whose record names no lock, is
    refused in one line before anything is written."""
    from posttrain.stages.common import stage_main

    stage, spec, runs = slow_stage
    for bare in (spec, spec.model_copy(update={"launch": LaunchInfo(id="by-hand")})):
        path = bare.write(runs.parent / "spec.json")
        with pytest.raises(SystemExit) as refused:
            stage_main(lambda ctx: {}, kind="ingest", argv=["--spec", str(path)])
        assert str(refused.value) == (
            "stage ingest: its spec names no supervisor holding the artifact's lock; run one "
            "stage with `posttrain launch ingest RECIPE`"
        )
    assert not stage.out_dir.exists() and not runs.exists()


def test_another_nodes_supervisor_looks_without_the_lock(
    slow_stage: tuple[PlannedStage, StageSpec, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multi-node stage started by hand: node 0's supervisor holds the lock (on a file system
    the other nodes may not share); another node's looks without it, and reuses a complete
    artifact instead of starting an agent that would wait for a rendezvous that never comes."""
    stage, spec, runs = slow_stage
    out = stage.out_dir
    out.mkdir(parents=True)
    (out / "result.json").write_text("{}")
    write_manifest(out, stage="ingest", fp=FP, parents=[], section={}, seed=0, summary={})
    node_0 = ArtifactLock(out)
    assert node_0.try_acquire({"what": "node 0's supervisor"})
    try:
        monkeypatch.setenv("POSTTRAIN_NODE_RANK", "1")
        outcome = supervise_stage(stage, spec)
    finally:
        node_0.release()
    assert outcome.status == "reused" and outcome.ref.fingerprint == FP
    assert not runs.exists() and not (out / "logs").exists(), "nothing launched"


@pytest.mark.slow
def test_two_supervisors_at_once_one_runs_the_other_reuses(
    slow_stage: tuple[PlannedStage, StageSpec, Path], caplog: pytest.LogCaptureFixture
) -> None:
    stage, spec, runs = slow_stage
    caplog.set_level(logging.INFO, logger="posttrain.flows")

    def release_once_the_second_waits() -> None:
        _wait_for("the second supervisor to wait", lambda: "waiting for another run" in caplog.text)
        (runs.parent / "release").touch()

    first, second = _in_threads(
        lambda: supervise_stage(stage, spec),
        lambda: supervise_stage(stage, spec),
        before_join=release_once_the_second_waits,
    )
    assert (first.status, second.status) == ("ran", "reused")
    assert first.ref == second.ref
    assert len(runs.read_text().split()) == 1, "the stage ran once"
    log = (stage.out_dir / "logs" / "stage.log").read_text()
    assert log.count("=== ") == 1, "the second supervisor started no process"
    assert "waiting for another run of the same stage to finish" in caplog.text
    assert "stage ingest supervisor" in caplog.text
    _intact(stage.out_dir)


@pytest.mark.slow
def test_two_posttrain_launches_at_once(
    slow_stage: tuple[PlannedStage, StageSpec, Path], tmp_path: Path
) -> None:
    """`posttrain launch ingest recipe.yaml` twice at once, no Prefect: each is the stage's
    supervisor, so the second waits for the first's lock, then reuses what it made."""
    from tests.faults.fault_runs import Run

    _, _, runs = slow_stage
    data = _recipe(tmp_path / "ws")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PT_STAGE_MODULES": "ingest=pt_slow_stage"}
    first = Run(recipe, env, command=("launch", "ingest"))
    try:
        _wait_for("the first launch's stage to run", runs.exists)  # it holds the lock
        second = Run(recipe, env, command=("launch", "ingest"))
        try:
            second.wait_for("waiting for another run of the same stage to finish")
            (runs.parent / "release").touch()
            (rc1, out1), (rc2, out2) = first.finish(120), second.finish(120)
        finally:
            second.stop()
    finally:
        first.stop()
    assert (rc1, rc2) == (0, 0), (out1, out2)
    assert len(runs.read_text().split()) == 1, "the stage ran once"
    out = plan(resolve(validate_recipe(data))).stages[0].out_dir
    assert f"stage ingest: ran: {out}" in out1 and f"stage ingest: reused: {out}" in out2
    assert "the other run is done; this one reused" in out2
    _intact(out)


@pytest.mark.slow
def test_two_real_ingest_runs_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The real ingest stage (from_config, tiny) launched twice at once through the supervisor."""
    recipe = validate_recipe(
        {
            "run": {"workspace": str(tmp_path / "ws")},
            "infra": {"device": "cpu", "precision": "fp32", "devices_per_node": 1},
            "ingest": {
                "source": "from_config",
                "from_config": {
                    "hidden_size": 32,
                    "num_layers": 1,
                    "num_heads": 2,
                    "intermediate_size": 64,
                    "vocab_size": 300,
                    "max_position_embeddings": 64,
                    "corpus_examples": 100,
                },
            },
            "sft": {"data": {"synthetic": {}}},
        }
    )
    recipe = resolve(recipe)
    ingest = plan(recipe).stages[0]
    spec = spec_for(ingest, recipe, {})
    caplog.set_level(logging.INFO, logger="posttrain.flows")
    first, second = _in_threads(
        lambda: supervise_stage(ingest, spec), lambda: supervise_stage(ingest, spec)
    )
    assert (first.status, second.status) == ("ran", "reused")
    assert first.ref == second.ref and verify(ingest.out_dir) == (True, "")
    log = (ingest.out_dir / "logs" / "stage.log").read_text()
    assert log.count("=== ") == 1
    manifest = read_manifest(ingest.out_dir)
    assert manifest is not None and manifest["summary"]["num_params"] > 0
    assert "waiting for another run of the same stage to finish" in caplog.text
