"""Experiment trackers (flows/trackers): the dispatcher's isolation of a failing or stalled
tracker, the metrics feed, and TensorBoard event files read back with TensorBoard's reader."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import flows.trackers as trackers_mod
from flows.report.tables import RunResult, StageRecord
from flows.trackers import Sink, Trackers, headline_metrics, numeric_fields
from flows.trackers.mlflow import PARAM_VALUE_MAX, flatten
from flows.trackers.tensorboard import TensorBoardSink
from posttrain.store.summary import Summary

# A recorded run, for `finish`: the sinks here read nothing of it.
DONE = RunResult("r1", Path("runs/r1"), [])


class Recorder(Sink):
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def start_stage(self, stage: str, fingerprint: str) -> None:
        self.calls.append(("start_stage", (stage, fingerprint)))

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        self.calls.append(("log", (stage, [r["step"] for r in records])))

    def end_stage(self, record: StageRecord) -> None:
        self.calls.append(("end_stage", (record.stage, record.status)))


class Broken(Sink):
    name = "broken"

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        raise ConnectionError("connection refused")


class Stalled(Sink):
    name = "stalled"

    def __init__(self) -> None:
        self.release = threading.Event()

    def log(self, stage: str, records: list[dict[str, Any]]) -> None:
        self.release.wait(30)


def _train(step: int, loss: float) -> dict[str, Any]:
    return {"kind": "train", "step": step, "total_steps": 3, "loss": loss, "time": 1.0e9 + step}


def test_numeric_fields_keep_metrics_only() -> None:
    rec = {**_train(2, 1.5), "lr": 1e-4, "ok": True, "note": "x", "grad_norm": 3}
    assert numeric_fields(rec) == {"train/loss": 1.5, "train/lr": 1e-4, "train/grad_norm": 3.0}
    assert headline_metrics({"nll": 2, "name": "a", "flag": False}) == {"headline/nll": 2.0}


def test_a_failing_tracker_warns_once_and_the_others_get_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    good, bad = Recorder(), Broken()
    t = Trackers([good, bad])
    with caplog.at_level(logging.WARNING, logger="posttrain.flows"):
        t.start_stage("sft", "fp1", Path("/nonexistent/metrics.jsonl")).stop()
        for step in (1, 2, 3):
            t.log("sft", [_train(step, 1.0)])
        t.end_stage(StageRecord("sft", "f" * 16, "ran", 1.0))
        t.finish(DONE, timeout_s=5)
    assert good.calls == [
        ("start_stage", ("sft", "fp1")),
        ("log", ("sft", [1])),
        ("log", ("sft", [2])),
        ("log", ("sft", [3])),
        ("end_stage", ("sft", "ran")),
    ]
    warnings = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "connection refused" in warnings[0] and "dropped from here on" in warnings[0]
    lines = t.report_lines()
    assert lines[0] == "- recorder"
    assert "broken — **failed** (log: ConnectionError: connection refused)" in lines[1]
    assert lines[1].endswith("2 metrics records dropped")  # steps 2 and 3


def test_a_stalled_tracker_is_given_up_and_finish_waits_a_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trackers_mod, "CALL_TIMEOUT_S", 0.2)
    stalled, good = Stalled(), Recorder()
    t = Trackers([stalled, good])
    try:
        t.log("sft", [_train(1, 1.0)])
        time.sleep(0.4)  # the stalled sink is still in its first call
        t.log("sft", [_train(2, 1.0)])
        t0 = time.monotonic()
        t.finish(DONE, timeout_s=1.0)
        assert time.monotonic() - t0 < 3
        assert ("log", ("sft", [2])) in good.calls
        assert "has not returned for 0.2 s" in t.report_lines()[0]
    finally:
        stalled.release.set()


def test_records_already_sent_are_not_sent_again() -> None:
    """A resumed stage rewrites metrics.jsonl with the records up to its checkpoint."""
    rec = Recorder()
    t = Trackers([rec])
    t.log("sft", [_train(1, 2.0), _train(2, 1.0)])
    t.log("sft", [_train(1, 2.0), _train(2, 1.0), _train(3, 0.5)])
    t.log("dpo", [_train(1, 2.0)])  # another stage's step 1
    t.finish(DONE, timeout_s=5)
    assert [c for c in rec.calls if c[0] == "log"] == [
        ("log", ("sft", [1, 2])),
        ("log", ("sft", [3])),
        ("log", ("dpo", [1])),
    ]


def test_the_feed_follows_a_growing_file_and_reads_the_rest_at_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trackers_mod, "POLL_S", 0.05)
    path = tmp_path / "metrics.jsonl"
    rec = Recorder()
    t = Trackers([rec])
    feed = t.start_stage("sft", "fp", path)
    with open(path, "a") as f:
        f.write(json.dumps(_train(1, 2.0)) + "\n")
        f.flush()
        deadline = time.monotonic() + 5
        while not any(c[0] == "log" for c in rec.calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        f.write(json.dumps(_train(2, 1.0)) + "\n" + '{"kind": "train", "st')  # torn last line
    feed.stop()
    t.finish(DONE, timeout_s=5)
    assert [c for c in rec.calls if c[0] == "log"] == [("log", ("sft", [1])), ("log", ("sft", [2]))]


def test_tensorboard_event_files_hold_each_stage_curve(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "runs" / "r1"
    sink = TensorBoardSink(run_dir)
    t = Trackers([sink])
    t.start_stage("sft", "fp", tmp_path / "none")
    t.log("sft", [{**_train(s, 2.0 / s), "lr": 0.1 * s} for s in (1, 2, 3)])
    t.log("sft", [{"kind": "eval", "step": 3, "nll": 0.25}])
    t.end_stage(
        StageRecord("evaluate", "e" * 16, "ran", 1.0, summary=Summary(headline={"nll": 1.5}))
    )
    t.finish(DONE, timeout_s=10)
    assert sink.link == f"tensorboard --logdir {tmp_path / 'runs'}"
    acc = EventAccumulator(str(run_dir / "sft")).Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([2.0, 1.0, 2.0 / 3])
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([0.1, 0.2, 0.3])
    assert [(e.step, e.value) for e in acc.Scalars("eval/nll")] == [(3, 0.25)]
    headline = EventAccumulator(str(run_dir / "evaluate")).Reload().Scalars("headline/nll")
    assert [(e.step, e.value) for e in headline] == [(0, 1.5)]


def test_mlflow_params_are_dotted_and_cut_to_the_limit() -> None:
    params = flatten({"run": {"name": "a", "seed": 0}, "sft": {"x": "y" * 7000, "l": [1, 2]}})
    assert params["run.name"] == "a" and params["run.seed"] == "0"
    assert params["sft.l"] == "[1, 2]"
    assert len(params["sft.x"]) == PARAM_VALUE_MAX and params["sft.x"].endswith("...")


RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_tracking_is_in_no_fingerprint(path: Path) -> None:
    """Every shipped recipe plans the same stages with the same fingerprints, trackers or not."""
    from posttrain.config.loader import RecipeError, load_recipe
    from posttrain.plan.planner import plan

    try:
        plain = {s.name: s.fingerprint for s in plan(load_recipe(path)).stages}
    except RecipeError as exc:
        if "not in the cache" not in str(exc):
            raise
        pytest.skip("a hub recipe: its model and data are not in the offline cache")
    tracked = load_recipe(
        path,
        [
            "tracking.tensorboard=false",
            "tracking.mlflow.uri=http://127.0.0.1:5000",
            "tracking.wandb.project=p",
        ],
    )
    assert tracked.tracking.mlflow is not None and not tracked.tracking.tensorboard
    assert {s.name: s.fingerprint for s in plan(tracked).stages} == plain


def test_mlflow_metric_names_are_ones_the_server_accepts() -> None:
    from flows.trackers.mlflow import metric_key

    assert metric_key("headline/pass@1") == "headline/pass_1"
    assert metric_key("train/tokens_per_s") == "train/tokens_per_s"
    assert metric_key("headline/decode_tok/s") == "headline/decode_tok/s"
