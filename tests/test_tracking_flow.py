"""The `post-train` flow feeding real trackers: TensorBoard (on by default), a real `mlflow
server` on a free loopback port, W&B in offline mode read back from its run files, and an MLflow
server that is down. Tiny stand-in stage modules (tests/stage_modules.py) write the metrics."""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prefect_server import free_port
from test_flow import _recipe, fake_stages  # noqa: F401  (fixture)

from flows.post_train import post_train
from posttrain.telemetry.records import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1:<free port> with a SQLite store; stopped by PID."""
    port = free_port()
    home = tmp_path / "mlflow"
    home.mkdir()
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
        "--artifacts-destination", str(home / "artifacts"),
        "--workers", "1",
    ]  # fmt: skip
    log = open(home / "server.log", "w")  # noqa: SIM115 (closed in finally)
    # Without its job runner (LLM-judge jobs, trace rollups: nothing posttrain calls), a third
    # process importing mlflow at start, and the one that held the server's stop for 10-25 s.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=home, start_new_session=True, env=env
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start:\n{(home / 'server.log').read_text()}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` run file (LevelDB-style log: a 7-byte file header,
    32 KiB blocks, each chunk with a 7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pos, block, pending = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
            pending = b""
    return records


def _wandb_history(run_file: Path) -> tuple[str, dict[str, str], list[dict[str, float]]]:
    """(job type, group, the history rows) of one offline run."""
    job_type, group, rows = "", "", []
    for rec in wandb_records(run_file):
        which = rec.WhichOneof("record_type")
        if which == "run":
            job_type, group = rec.run.job_type, rec.run.run_group
        elif which == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in rec.history.item
                }
            )
    return job_type, group, rows


def _same_curve(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """Same steps, values equal to float32 precision (TensorBoard stores float32)."""
    got = sorted(got)
    return [s for s, _ in got] == [s for s, _ in want] and [v for _, v in got] == pytest.approx(
        [v for _, v in want], rel=1e-6
    )


def _wandb_children() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "wandb" in " ".join(p.cmdline() if p.is_running() else [])
    ]


def test_one_run_feeds_tensorboard_mlflow_and_wandb(
    prefect_harness: None,
    fake_stages,  # noqa: F811
    tmp_path: Path,
    mlflow_server: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    ws = tmp_path / "ws"
    tracking = {"mlflow": {"uri": mlflow_server}, "wandb": {"project": "pt-test"}}
    recipe = _recipe(ws, tracking=tracking)
    first = post_train(recipe)
    run_id, run_dir = first.run_id, Path(first.run_dir)
    uris = {s.stage: Path(s.uri) for s in first.stages}
    sft_loss = [
        (r["step"], r["loss"]) for r in read_metrics(uris["sft"] / "metrics.jsonl", "train")
    ]
    assert sft_loss == [(1, 2.0), (2, 1.0), (3, 2.0 / 3)]
    lineage = json.loads((run_dir / "lineage.json").read_text())

    # TensorBoard, by default: one run per stage under <workspace>/runs/<run-id>/<stage>.
    acc = EventAccumulator(str(run_dir / "sft")).Reload()
    assert _same_curve([(e.step, e.value) for e in acc.Scalars("train/loss")], sft_loss)
    report = (run_dir / "report.md").read_text()
    assert f"- tensorboard: tensorboard --logdir {ws / 'runs'}" in report

    # MLflow: the parent run, nested stage runs, the curves, the champion alias.
    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    exp = client.get_experiment_by_name("flow-test")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent = next(r for r in runs if r.info.run_name == run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == lineage["flow_run_id"]
    assert parent.data.params["run.name"] == "flow-test"
    assert parent.data.params["sft.data.synthetic.n_examples"] == "20"
    arts = {a["stage"]: a["fingerprint"] for a in lineage["artifacts"]}
    assert {k: parent.data.tags[f"posttrain.fingerprint.{k}"] for k in arts} == arts
    stages = {
        r.data.tags["posttrain.stage"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    assert set(stages) == set(arts)
    sft = stages["sft"]
    assert sft.data.tags["posttrain.fingerprint"] == arts["sft"]
    assert sft.data.tags["posttrain.reused"] == "false"
    history = client.get_metric_history(sft.info.run_id, "train/loss")
    assert _same_curve(sorted((m.step, m.value) for m in history), sft_loss)
    assert stages["evaluate"].data.metrics["headline/loss"] == pytest.approx(0.667)
    listed = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "curves", "model"} <= listed
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "curves")] == [
        "curves/curves-evaluate.png", "curves/curves-export.png", "curves/curves-ingest.png",
        "curves/curves-sft.png", "curves/graph.png",
    ]  # fmt: skip
    champion = client.get_model_version_by_alias("flow-test", "champion")
    assert champion.run_id == parent.info.run_id
    assert champion.tags["posttrain.export_path"] == first.export_path
    link = f"{mlflow_server}/#/experiments/{exp.experiment_id}/runs/{parent.info.run_id}"
    assert f"- mlflow: {link}" in report

    # W&B offline: one run per stage, grouped by the pipeline run, with the stage's metrics.
    run_files = sorted((tmp_path / "wandb-dir" / "wandb").glob("offline-run-*/run-*.wandb"))
    offline = {job: (group, rows) for job, group, rows in map(_wandb_history, run_files)}
    assert set(offline) == set(arts)
    group, rows = offline["sft"]
    assert group == run_id
    assert _same_curve([(r["_step"], r["train/loss"]) for r in rows], sft_loss)
    assert "- wandb: project pt-test, group " + run_id in report
    assert not _wandb_children(), "no wandb process outlives the run"

    # A re-run: every stage is reused, its kept curve is logged at once, tagged reused;
    # the same export is not registered again.
    second = post_train(recipe)
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parent2 = next(r for r in runs if r.info.run_name == second.run_id)
    sft2 = next(
        r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent2.info.run_id
        and r.data.tags["posttrain.stage"] == "sft"
    )
    assert sft2.data.tags["posttrain.reused"] == "true"
    history = client.get_metric_history(sft2.info.run_id, "train/loss")
    assert _same_curve(sorted((m.step, m.value) for m in history), sft_loss)
    assert client.get_model_version_by_alias("flow-test", "champion").version == champion.version
    acc = EventAccumulator(str(Path(second.run_dir) / "sft")).Reload()
    assert _same_curve([(e.step, e.value) for e in acc.Scalars("train/loss")], sft_loss)


def test_a_tracker_that_is_down_neither_fails_nor_stalls_the_run(
    prefect_harness: None,
    fake_stages,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    recipe = _recipe(tmp_path / "ws", tracking={"mlflow": {"uri": closed}})
    t0 = time.monotonic()
    # Ingest alone: the tracker fails at the run's start (the connection is refused at once:
    # no retries, no timeout to wait out), before any stage, so every stage only adds records
    # it drops; sft, evaluate and export would be three more stage processes of the same.
    with caplog.at_level(logging.WARNING):
        result = post_train(recipe, until=["ingest"])
    assert time.monotonic() - t0 < 90
    assert {s.status for s in result.stages} == {"ran"}
    warned = [r.getMessage() for r in caplog.records if "tracker mlflow failed" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "dropped from here on" in warned[0]
    report = (Path(result.run_dir) / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("- mlflow:"))
    assert closed in line and "**failed** (start_pipeline:" in line
    assert "metrics records dropped" in line
    # TensorBoard, on by default, still got everything.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(result.run_dir) / "ingest")).Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
