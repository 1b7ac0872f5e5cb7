"""Two runs of the same stage at once: one runs, the other waits for it and reuses its artifact;
the folder is never written by both (posttrain.store.locking, posttrain.store.claim)."""

from __future__ import annotations

import json
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

from flows.stage.supervise import supervise_stage
from posttrain.config.loader import validate_recipe
from posttrain.plan.planner import plan, spec_for
from posttrain.runtime.spec import PlannedStage, StageSpec
from posttrain.store.artifacts import read_manifest, stage_dir, verify, write_manifest
from posttrain.store.claim import claim_by_hand
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
    recipe = validate_recipe(
        {
            "run": {"workspace": str(workspace)},
            "infra": {"device": "cpu", "precision": "fp32"},
            "ingest": {"source": "from_config"},
            "sft": {"data": {"synthetic": {}}},
        }
    )
    return stage, spec_for(stage, recipe, {}), runs


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


def test_torchrun_ranks_wait_for_their_own_rank_0(tmp_path: Path) -> None:
    """Started by hand (no supervisor holds the lock): rank 1 of launch B must not touch the
    folder while launch A holds it, nor proceed before its own rank 0 has looked; it follows
    rank 0's decision. Other nodes look read-only and take no lock."""
    out = tmp_path / "artifacts" / "sft" / FP
    other_run = ArtifactLock(out)
    assert other_run.try_acquire({"launch": "A"})
    order: list[str] = []
    got: dict[str, Any] = {}

    def rank(r: int) -> None:
        env = {"RANK": str(r), "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "B"}
        got[r] = claim_by_hand(out, FP, "sft", env=env, poll_s=0.02)
        order.append(f"rank{r}")

    def both_ranks() -> None:
        order.clear()
        threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
        threads[0].start()
        time.sleep(0.2)
        threads[1].start()
        time.sleep(0.3)
        assert order == [], "both ranks of launch B wait while launch A holds the folder"
        other_run.release()
        for t in threads:
            t.join(5)
        assert sorted(order) == ["rank0", "rank1"]

    both_ranks()
    assert got[0].lock is not None and got[0].lock.held and got[1].lock is None
    assert (got[0].done, got[1].done) == (False, False), "nothing built yet: both build"
    assert got[0].lock.holder()["launch"] == f"B/{os.getppid()}"
    assert got[0].lock.holder()["decision"] == "build"
    got[0].release()
    # A complete artifact: rank 0 finds it (and its ref), rank 1 follows without looking.
    out.mkdir(parents=True)
    (out / "result.json").write_text("{}")
    write_manifest(out, stage="sft", fp=FP, parents=[], section={}, seed=0, summary={})
    assert other_run.try_acquire({"launch": "A"})
    both_ranks()
    assert (got[0].done, got[1].done) == (True, True)
    assert got[0].ref is not None and got[0].ref.fingerprint == FP and got[1].ref is None
    got[0].release()
    # Another node: no lock, a read-only look (the manifest of a damaged artifact stays for
    # node 0's rank 0 to deal with).
    other = claim_by_hand(out, FP, "sft", env={"GROUP_RANK": "1"})
    assert other.done and other.lock is None
    (out / "result.json").write_text("altered")
    assert not claim_by_hand(out, FP, "sft", env={"GROUP_RANK": "1"}).done
    assert (out / "manifest.json").exists()


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
def test_two_hand_launched_stage_processes_at_once(
    slow_stage: tuple[PlannedStage, StageSpec, Path],
) -> None:
    """`python -m <stage> --spec ...` twice, no supervisor: the stage processes lock
    themselves (the spec names no lock held for them)."""
    stage, spec, runs = slow_stage
    path = spec.write(runs.parent / "spec.json")
    cmd = [sys.executable, "-m", stage.module, "--spec", str(path)]
    env = dict(os.environ)
    logs = [runs.parent / "first.log", runs.parent / "second.log"]
    with open(logs[0], "wb") as log1, open(logs[1], "wb") as log2:
        first = subprocess.Popen(cmd, env=env, stdout=log1, stderr=subprocess.STDOUT)
        _wait_for("the first run to hold the lock", runs.exists)  # it runs: it holds the lock
        second = subprocess.Popen(cmd, env=env, stdout=log2, stderr=subprocess.STDOUT)
        try:
            _wait_for("the second run to wait", lambda: b"waiting for" in logs[1].read_bytes())
            (runs.parent / "release").touch()
            first.wait(timeout=120)
            second.wait(timeout=120)
        finally:
            for p in (first, second):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    out1, out2 = (p.read_bytes() for p in logs)
    assert (first.returncode, second.returncode) == (0, 0), (out1, out2)
    assert len(runs.read_text().split()) == 1, "the stage ran once"
    assert b"waiting for another run of the same stage" in out2
    refs = [
        json.loads(line.split(b"POSTTRAIN_ARTIFACT ", 1)[1])
        for line in (out1 + out2).splitlines()
        if b"POSTTRAIN_ARTIFACT " in line
    ]
    assert len(refs) == 2 and refs[0] == refs[1]
    _intact(stage.out_dir)


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
