"""The stage's health line and SRE figures (flows.report.health_summary), held to
hand-computed values; the report's SRE section built from them."""

from __future__ import annotations

import json
from pathlib import Path

from flows.report.health_summary import health_line, summarize, underfed_text
from flows.report.tables import StageRecord, health_lines, sre_markdown

CPU_SOURCES = {"nvml": "absent: no NVIDIA driver", "infiniband": "absent: none", "io": "present"}


def _train(step: int, step_s: float, wait_s: float, mfu: float, **extra: float) -> dict:
    return {
        "kind": "train",
        "time": 100.0 + step,
        "step": step,
        "step_time_s": step_s,
        "data_wait_s": wait_s,
        "mfu": mfu,
        **extra,
    }


def test_cpu_stage_figures_and_line() -> None:
    records = [
        {"kind": "start", "time": 100.0},
        _train(1, 1.0, 0.0, 0.30, mem_peak_rss_gib=0.5),
        _train(2, 2.0, 1.0, 0.10, mem_peak_rss_gib=0.75),
        _train(3, 1.0, 0.2, 0.20, mem_peak_rss_gib=0.75, nonfinite_updates=1),
    ]
    s = summarize(records, CPU_SOURCES)
    # time-weighted: (0 + 1 + 0.2) s of waiting in (1 + 2 + 1) s of steps = 30%
    assert s["data_wait"]["mean"] == 0.3
    assert (s["data_wait"]["worst"], s["data_wait"]["worst_step"]) == (0.5, 2)
    assert s["mfu"] == {"median": 0.2, "worst": 0.1, "worst_step": 2}
    assert s["step_time"] == {"median": 1.0, "worst": 2.0, "worst_step": 2}
    assert s["peak_rss_gib"]["worst"] == 0.75
    assert s["nonfinite_updates"] == 1
    assert "gpu" not in s and "reserved_over_allocated" not in s
    assert health_line(s) == (
        "data-wait 30% (worst 50% at step 2), peak RSS 0.75 GiB, "
        "MFU 20% median (lowest 10% at step 2), 1 non-finite updates skipped, "
        "GPU health not read (no NVIDIA driver)"
    )


def _health(t: float, power: float, thermal: int, ib_errors: float) -> dict:
    return {
        "kind": "health",
        "time": t,
        "rank": 0,
        "gpu0_power_w": power,
        "gpu0_power_limit_w": 700.0,
        "gpu0_temperature_c": 60 + t - 100,
        "gpu0_throttle_thermal": thermal,
        "gpu0_throttle_sync_boost": 1,
        "ib_mlx5_0_1_errors": ib_errors,
        "io_read_bytes_per_s": 1e6 * (t - 100),
    }


def test_gpu_stage_throttling_power_and_network_errors() -> None:
    records = [
        _train(1, 1.0, 0.01, 0.4, mem_allocated_gib=10.0, mem_reserved_gib=11.0),
        _health(100.0, 500.0, 0, 2.0),
        _train(2, 1.0, 0.01, 0.4, mem_allocated_gib=10.0, mem_reserved_gib=15.0),
        _health(110.0, 300.0, 1, 2.0),
        _health(120.0, 400.0, 1, 5.0),
        _train(3, 1.0, 0.01, 0.4, mem_allocated_gib=10.0, mem_reserved_gib=12.0),
    ]
    s = summarize(records, {"nvml": "present"})
    gpu = s["gpu"]
    # seconds from the stage's first record (at 100): thermal first seen at 110
    assert gpu["throttle_first_s"] == {"sync_boost": 0.0, "thermal": 10.0}
    assert (gpu["power_min_w"], gpu["power_mean_w"], gpu["power_limit_w"]) == (300, 400, 700)
    assert gpu["temperature_max_c"] == 80.0
    assert s["ib_increase"] == {"ib_mlx5_0_1_errors": 3.0}
    assert s["reserved_over_allocated"] == {"median": 1.2, "worst": 1.5, "worst_step": 2}
    assert s["read_bytes_per_s"] == {"mean": 1e7, "max": 2e7}
    line = health_line(s)
    assert line.startswith("data-wait 1% (worst 1% at step 1), reserved/allocated 1.20 (worst")
    # sync boost is the driver's business, not a throttle the SRE must act on
    assert "throttled: thermal from 10 s" in line and "sync_boost" not in line
    assert line.endswith("network errors: ib_mlx5_0_1_errors +3")


def test_a_gpu_that_never_throttled_says_so() -> None:
    s = summarize([_train(1, 1.0, 0.0, 0.5), _health(100.0, 500.0, 0, 0.0)], {"nvml": "present"})
    assert health_line(s).endswith("no throttling seen")


def test_a_stage_without_steps_has_no_line() -> None:
    assert health_line(summarize([{"kind": "start", "time": 1.0}], CPU_SOURCES)) == ""


def test_the_report_s_sre_section() -> None:
    records = [_train(1, 1.0, 0.0, 0.30), _train(2, 3.0, 1.5, 0.10, mem_peak_rss_gib=0.5)]
    ran = StageRecord("sft", "f", "ran", 5.0, health=summarize(records, CPU_SOURCES))
    reused = StageRecord("ingest", "g", "reused", 0.0)
    lines = sre_markdown([reused, ran])
    assert lines[1] == "## SRE"
    row = next(x for x in lines if x.startswith("| sft |"))
    assert "2 (worst 3 at step 2)" in row  # step time median 2 s, worst 3 s at step 2
    assert "25.0% (worst 50.0% at step 2)" in row  # data-wait median of 0 and 50%
    assert "not read: no NVIDIA driver |" in row
    assert health_lines([reused, ran]) == [f"sft: {health_line(ran.health)}"]
    assert sre_markdown([reused]) == []


def test_a_gpu_waiting_on_the_host_is_called_underfed() -> None:
    """Real records: 0.5B-shaped SFT at 8 rows a step on one H200 (docs/benchmarks.md, "One
    H200"). Its 17 health samples average 196.3 W of 700 W (28%), its memory peaked at 11.7%
    in use, its median MFU is 3.1%."""
    path = Path(__file__).parent / "data" / "health" / "h200_sft_0.5b_metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    s = summarize(records, {"nvml": "present"})
    assert round(s["gpu"]["memory_used_max_frac"], 3) == 0.117
    assert underfed_text(s) == (
        "GPU underfed: 28% of its power limit, at most 12% of its memory, MFU 3%; "
        "more tokens a step (batch.micro_batch_size) would use it"
    )
    assert underfed_text(s) in health_line(s)


def test_a_busy_gpu_or_one_without_readings_is_not_underfed() -> None:
    def stage(power: float, mfu: float, used: float) -> dict:
        health = {**_health(100.0, power, 0, 0.0), "gpu0_memory_total_bytes": 100.0}
        return summarize([_train(1, 1.0, 0.0, mfu), health | {"gpu0_memory_used_bytes": used}])

    assert underfed_text(stage(300.0, 0.05, 10.0)).startswith("GPU underfed: 43% ")
    assert underfed_text(stage(500.0, 0.05, 10.0)) == ""  # 71% of its power: computing
    assert underfed_text(stage(300.0, 0.35, 10.0)) == ""  # MFU 35%
    assert underfed_text(stage(300.0, 0.05, 80.0)) == ""  # memory full: no room for more
    no_memory = summarize([_train(1, 1.0, 0.0, 0.05), _health(100.0, 300.0, 0, 0.0)])
    assert underfed_text(no_memory) == ""
