"""The flow's stage scheduler (flows/schedule.py): dependency order, N at a time, device slots,
and what a failure does. Plain callables stand in for the Prefect task: what is under test is
the ordering and concurrency, not the launcher."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from flows.schedule import device_slots, run_stages
from posttrain.runtime.spec import PlannedStage
from posttrain.store.artifacts import ArtifactRef


def _stage(name: str, *parents: str) -> PlannedStage:
    return PlannedStage(
        name=name,
        module="m",
        fingerprint=name * 4,
        out_dir=Path("/tmp") / name,
        parents={p: p * 4 for p in parents},
        nprocs=1,
        timeout_s=60,
    )


# ingest -> (sft, reward) in parallel -> dpo (needs sft) ; evaluate needs dpo and reward.
GRAPH = [
    _stage("ingest"),
    _stage("sft", "ingest"),
    _stage("reward", "ingest"),
    _stage("dpo", "ingest", "sft"),
    _stage("evaluate", "ingest", "dpo", "reward"),
]


class Recorder:
    def __init__(self, sleep: float = 0.2, fail: str = "") -> None:
        self.lock = threading.Lock()
        self.spans: dict[str, tuple[float, float]] = {}
        self.seen: dict[str, set[str]] = {}
        self.slots: dict[str, str | None] = {}
        self.sleep, self.fail = sleep, fail

    def __call__(self, stage: PlannedStage, refs: dict[str, ArtifactRef]) -> ArtifactRef:
        t0 = time.monotonic()
        assert set(stage.parents) <= set(refs), f"{stage.name} started before its parents"
        time.sleep(self.sleep)
        with self.lock:
            self.spans[stage.name] = (t0, time.monotonic())
            self.seen[stage.name] = set(refs)
            self.slots[stage.name] = stage.visible_devices
        if stage.name == self.fail:
            raise RuntimeError(f"{stage.name} broke")
        return ArtifactRef(
            stage=stage.name, uri=str(stage.out_dir), fingerprint=stage.fingerprint, sha256="0" * 64
        )


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_one_at_a_time_keeps_plan_order() -> None:
    rec = Recorder(sleep=0.01)
    refs = run_stages(list(GRAPH), rec, 1)
    order = sorted(rec.spans, key=lambda name: rec.spans[name][0])
    assert order == [s.name for s in GRAPH] and set(refs) == set(order)
    assert not any(_overlap(rec.spans["sft"], rec.spans["reward"]) for _ in [0])


def test_independent_branches_run_together_and_dependencies_wait() -> None:
    rec = Recorder()
    stages = [_stage(s.name, *s.parents) for s in GRAPH]
    run_stages(stages, rec, 2, ["0,1", "2,3"])
    assert _overlap(rec.spans["sft"], rec.spans["reward"])  # the two branches side by side
    assert rec.spans["dpo"][0] >= rec.spans["sft"][1]
    assert rec.spans["evaluate"][0] >= max(rec.spans["dpo"][1], rec.spans["reward"][1])
    # Stages side by side never share a device set.
    assert {rec.slots["sft"], rec.slots["reward"]} == {"0,1", "2,3"}


def test_a_failure_stops_new_launches_and_lets_running_stages_finish() -> None:
    rec = Recorder(fail="sft")
    stages = [_stage(s.name, *s.parents) for s in GRAPH]
    with pytest.raises(RuntimeError, match="sft broke"):
        run_stages(stages, rec, 2)
    assert "reward" in rec.spans  # ran beside sft and finished
    assert "dpo" not in rec.spans and "evaluate" not in rec.spans


def test_device_slots_split_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert device_slots(2, 2, cuda=True) == ["4,5", "6,7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_slots(2, 1, cuda=True) == ["0", "1"]
    assert device_slots(2, 4, cuda=False) == [None, None]
    assert device_slots(1, 8, cuda=True) == [None]
