"""bench/gpu_speed.py --cpu-smoke: every phase of the GPU bench, shrunk, on CPU - the stage's
step path at two step sizes, eager and compiled, both attention paths, and every sampling
engine - with the JSON written as it goes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import gpu_speed


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_cpu_smoke_runs_every_phase_and_writes_the_json(
    tmp_path: Path, capsys: pytest.CaptureFixture, fresh_dynamo: None
) -> None:
    out = tmp_path / "speed.json"
    got = gpu_speed.main(["--cpu-smoke", "--out", str(out)])
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["sft"] == got.sft and saved["sampling"] == got.sampling
    assert saved["env"]["device"] == "cpu" and saved["env"]["peak_tflops"] > 0
    rows = {r["config"]: r for r in got.sft}
    assert list(rows) == [c.name for c in gpu_speed.smoke_plan()]
    for row in got.sft:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 5, row
        assert row["kernels_per_step"] > 100 and row["gpu_busy"] is None, row
        assert row["config"] in text
    eager, compiled = got.sft[1], got.sft[2:4]
    assert eager["graphs_compiled"] == 0
    # The first compiled configuration traces the block; the next step size, other packed
    # layouts included, reuses the graph: nothing recompiles.
    assert compiled[0]["graphs_compiled"] > 0 and compiled[0]["compile_s"] > 0
    assert compiled[1]["graphs_compiled"] == 0
    # Fewer operators per step than eager: the elementwise work fused.
    assert compiled[1]["kernels_per_step"] < eager["kernels_per_step"]
    head = got.sft[4]  # the compiled head: its two graphs (forward, backward), then fewer ops
    assert head["head"] == "compiled" and head["graphs_compiled"] == 2
    assert head["kernels_per_step"] < compiled[1]["kernels_per_step"]
    assert [r["engine"] for r in got.sampling] == list(gpu_speed.ENGINES)
    for row in got.sampling:
        assert 0 < row["new_tokens"] <= 4 * 8 and row["tokens_per_s"] > 0, row
    assert "sampling 4 prompts x 8 tokens:" in text


def test_gpu_plan_measures_what_the_issue_asks() -> None:
    plan = gpu_speed.gpu_plan()
    shapes = {c.shape for c in plan}
    assert shapes == {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"}
    assert {c.tokens for c in plan} >= {4096, 16384, 32768}
    assert {c.compiled for c in plan} == {True, False} and {c.varlen for c in plan} == {True, False}
    assert {c.head for c in plan} == set(gpu_speed.HEADS)
    # Eager configurations of a shape come before its compiled ones (compiling is one-way).
    for shape in shapes:
        modes = [c.compiled for c in plan if c.shape == shape]
        assert modes == sorted(modes)
