"""The run's series as Prometheus reads them (flows.trackers.exposition): records in, the
text exposition out through prometheus_client's own writer and parser; heartbeat ages from the
real heartbeat writer; health files in the shape the samplers write. The tracker serves them on
a real port, and pushes them to a real Pushgateway where Debian's package is installed."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flows.report.tables import RunResult, StageRecord
from flows.trackers.exposition import RunSeries
from flows.trackers.prom_names import BY_NAME
from flows.trackers.prometheus import PrometheusSink
from posttrain.sections.run import PrometheusTracking
from posttrain.telemetry.heartbeat import Heartbeat

GIB = 1024**3


def scrape(series: RunSeries) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape, read back by Prometheus's parser."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(series)
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(hits) == 1, (name, labels, [k for k in samples if k[0] == name])
    return hits[0]


def names(samples: dict) -> set[str]:
    return {n for n, _ in samples}


def write(folder: Path, records: list[dict], mode: str = "a") -> None:
    """Records appended to the stage's metrics.jsonl, as its rank 0 writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _series(tmp_path: Path, hang: float | None = 60.0) -> RunSeries:
    series = RunSeries("run-1", "quickstart", "flow-1")
    series.add_stage("sft", "sft", tmp_path / "sft", hang)
    series.add_stage("grpo", "grpo", tmp_path / "grpo", hang)
    return series


TRAIN = {
    "kind": "train",
    "step": 4,
    "total_steps": 10,
    "loss": 2.5,
    "grad_norm": 1.25,
    "tokens_per_s": 2000.0,
    "tokens_per_s_per_device": 1000.0,
    "tflops_per_device": 0.5,
    "mfu": 0.25,
    "step_time_s": 2.0,
    "data_wait_s": 0.5,
    "mem_allocated_gib": 2.0,
    "mem_reserved_gib": 3.0,
    "mem_peak_allocated_gib": 2.5,
    "mem_peak_reserved_gib": 3.5,
    "skipped_updates": 1,
    "nonfinite_updates": 1,
}


def test_a_train_record_becomes_its_series_in_base_units(tmp_path: Path) -> None:
    series = _series(tmp_path)
    series.set_status("sft", "running")
    write(tmp_path / "sft", [{**TRAIN, "time": 100.0, "step": 2}, {**TRAIN, "time": 104.0}])
    s = scrape(series)
    sft = {"stage": "sft", "kind": "sft", "run": "run-1", "recipe": "quickstart"}
    assert value(s, "posttrain_loss", **sft) == 2.5
    assert value(s, "posttrain_mfu_ratio", **sft) == 0.25
    assert value(s, "posttrain_tokens_per_second_per_device", **sft) == 1000.0
    assert value(s, "posttrain_memory_reserved_bytes", **sft) == 3 * GIB
    assert value(s, "posttrain_memory_reserved_minus_allocated_bytes", **sft) == 1 * GIB
    assert value(s, "posttrain_data_wait_ratio", **sft) == 0.25
    # counters add up record by record
    assert value(s, "posttrain_skipped_updates_total", **sft) == 2
    assert value(s, "posttrain_nonfinite_updates_total", **sft) == 2
    # 2 steps in 4 s: 6 steps left take 12 s
    assert value(s, "posttrain_stage_eta_seconds", **sft) == pytest.approx(12.0)
    assert value(s, "posttrain_stage_progress_ratio", **sft) == 0.4
    assert value(s, "posttrain_hang_timeout_seconds", **sft) == 60.0
    assert value(s, "posttrain_stage_status", status="running", **sft) == 1
    assert value(s, "posttrain_stage_status", status="pending", stage="grpo") == 1
    assert value(s, "posttrain_run_info", flow_run="flow-1") == 1
    # a CPU record has no GPU memory, so no GPU memory series (never a made-up zero)
    series.set_status("grpo", "running")
    write(tmp_path / "grpo", [{"kind": "train", "step": 1, "mem_rss_gib": 0.5}])
    s = scrape(series)
    assert value(s, "posttrain_memory_rss_bytes", stage="grpo") == 0.5 * GIB
    assert not any(
        n == "posttrain_memory_reserved_bytes" and ("stage", "grpo") in ls for n, ls in s
    )


def test_rl_records_give_phase_shares_reward_and_kl(tmp_path: Path) -> None:
    series = _series(tmp_path)
    series.set_status("grpo", "running")
    record = {
        "kind": "train",
        "step": 1,
        "step_time_s": 4.0,
        "generation_share": 0.5,
        "scoring_s": 0.4,
        "update_share": 0.4,
        "score_mean": 0.75,
        "approx_kl": 0.02,  # the update's distance from the sampling policy: not the gauge's
        "kl": 0.03,
    }
    write(tmp_path / "grpo", [record])
    s = scrape(series)
    assert value(s, "posttrain_rl_phase_ratio", stage="grpo", phase="generation") == 0.5
    assert value(s, "posttrain_rl_phase_ratio", stage="grpo", phase="scoring") == 0.1
    assert value(s, "posttrain_rl_phase_ratio", stage="grpo", phase="update") == 0.4
    assert value(s, "posttrain_rl_reward", stage="grpo") == 0.75
    assert value(s, "posttrain_rl_kl", stage="grpo") == 0.03
    # A step that did not score its KL to the reference (kl.coef 0) leaves the gauge as it was.
    unscored = {k: v for k, v in record.items() if k != "kl"}
    write(tmp_path / "grpo", [record, {**unscored, "step": 2}])
    assert value(scrape(series), "posttrain_rl_kl", stage="grpo") == 0.03


def test_a_resumed_stage_s_rewritten_file_counts_each_step_once(tmp_path: Path) -> None:
    series = _series(tmp_path)
    series.set_status("sft", "running")
    skip = {"kind": "train", "skipped_updates": 1}
    write(tmp_path / "sft", [{**skip, "step": n} for n in (1, 2, 3)])
    assert value(scrape(series), "posttrain_skipped_updates_total", stage="sft") == 3
    # killed after step 3, resumed from the checkpoint of step 2: the file is rewritten up to
    # step 2 (posttrain.telemetry.metrics.MetricsWriter), then steps 3 and 4 come again
    write(tmp_path / "sft", [{**skip, "step": n} for n in (1, 2)], mode="w")
    scrape(series)
    write(tmp_path / "sft", [{**skip, "step": n} for n in (3, 4)])
    assert value(scrape(series), "posttrain_skipped_updates_total", stage="sft") == 4
    assert value(scrape(series), "posttrain_stage_step", stage="sft") == 4


def test_an_ended_stage_s_last_records_are_read_and_a_reused_one_s_never(tmp_path: Path) -> None:
    series = _series(tmp_path)
    series.set_status("sft", "running")
    write(tmp_path / "sft", [{**TRAIN, "step": 9}])
    series.set_status("sft", "ran")  # its last record, written after the last scrape
    assert value(scrape(series), "posttrain_stage_step", stage="sft") == 9
    write(tmp_path / "grpo", [{**TRAIN, "step": 5}])  # an earlier run's
    series.set_status("grpo", "running")
    series.set_status("grpo", "reused")
    assert not any(
        n == "posttrain_stage_step" and ("stage", "grpo") in ls for n, ls in scrape(series)
    )


def test_heartbeat_age_grows_while_a_rank_is_silent_and_only_while_its_stage_runs(
    tmp_path: Path,
) -> None:
    series = _series(tmp_path)
    series.set_status("sft", "running")
    beats = [Heartbeat(tmp_path / "sft", rank) for rank in (0, 1)]
    for b in beats:
        b.beat(step=3, phase="train")
    first = scrape(series)
    assert value(first, "posttrain_heartbeat_step", rank="1") == 3
    time.sleep(1.2)
    beats[0].beat(step=4)  # rank 0 advances; rank 1 stays silent
    s = scrape(series)
    assert value(s, "posttrain_heartbeat_age_seconds", rank="0") < 0.5
    assert value(s, "posttrain_heartbeat_age_seconds", rank="1") >= 1.1
    node = dict(next(ls for n, ls in s if n == "posttrain_heartbeat_age_seconds"))["node"]
    assert node == socket.gethostname()
    series.set_status("sft", "ran")  # ended: its last beats would only age into a false alarm
    assert "posttrain_heartbeat_age_seconds" not in names(scrape(series))


def _health(rank: int, gpus: list[dict], sources: dict[str, str]) -> dict:
    return {
        "rank": rank,
        "node": "node-a",
        "pid": 1,
        "time": time.time(),
        "interval_s": 5.0,
        "sources": sources,
        "gpus": gpus,
        "ib_ports": [],
        "io": {"read_bytes_per_s": 1.5e7, "read_bytes_total": 10},
    }


def test_health_files_become_gpu_series_and_absent_sources_none(tmp_path: Path) -> None:
    series = _series(tmp_path)
    series.set_status("sft", "running")
    folder = tmp_path / "sft" / "logs" / "health"
    folder.mkdir(parents=True)
    gpu = {
        "index": 3,
        "power_w": 480.0,
        "power_limit_w": 700.0,
        "sm_clock_mhz": 1980,
        "throttle": {"thermal": True, "power": False},
        "ecc_uncorrected": 0,
        "pcie_rx_bytes_per_s": 2e8,
    }
    present = {"nvml": "present", "infiniband": "absent: no /sys/class/infiniband", "io": "present"}
    (folder / "rank0.json").write_text(json.dumps(_health(0, [gpu], present)))
    cpu = {"nvml": "absent: no NVIDIA driver", "infiniband": "absent: none", "io": "present"}
    (folder / "rank1.json").write_text(json.dumps(_health(1, [], cpu)))
    (folder / "rank2.json").write_text('{"rank": 2, "node"')  # torn: skipped
    earlier = {**_health(3, [gpu], present), "time": time.time() - 3600}  # an earlier launch's
    (folder / "rank3.json").write_text(json.dumps(earlier))
    s = scrape(series)
    g = {"rank": "0", "gpu": "3", "node": "node-a"}
    assert value(s, "posttrain_gpu_power_watts", **g) == 480.0
    assert value(s, "posttrain_gpu_sm_clock_hertz", **g) == 1.98e9
    assert value(s, "posttrain_gpu_throttle", reason="thermal", **g) == 1
    assert value(s, "posttrain_gpu_throttle", reason="power", **g) == 0
    assert value(s, "posttrain_gpu_ecc_errors_total", type="uncorrected", **g) == 0
    assert value(s, "posttrain_gpu_pcie_bytes_per_second", direction="rx", **g) == 2e8
    assert value(s, "posttrain_health_source_present", rank="1", source="nvml") == 0
    assert value(s, "posttrain_data_read_bytes_per_second", rank="1") == 1.5e7
    # what NVML did not give is not there: no temperature, no rank 1 GPU series at all
    assert "posttrain_gpu_temperature_celsius" not in names(s)
    assert not any(n.startswith("posttrain_gpu_") and ("rank", "1") in ls for n, ls in s)
    assert not any(("rank", "3") in ls or ("rank", "2") in ls for _, ls in s)


def test_the_config_needs_somewhere_to_send_and_a_port_to_name() -> None:
    with pytest.raises(ValueError, match="set `port`"):
        PrometheusTracking()
    with pytest.raises(ValueError, match="`file_sd_dir` names the endpoint"):
        PrometheusTracking(pushgateway="http://gw:9091", file_sd_dir="/tmp/x")
    with pytest.raises(ValueError, match="linger_s"):
        PrometheusTracking(port=1, linger_s=60)


def test_every_exported_name_is_in_the_table(tmp_path: Path) -> None:
    series = _series(tmp_path)
    series.set_status("sft", "running")
    write(tmp_path / "sft", [TRAIN, {"kind": "eval", "step": 4, "eval_loss": 2.0}])
    for name in names(scrape(series)):
        base = name.removesuffix("_created")
        assert base in BY_NAME or f"{base}_total" in BY_NAME, name


def _get(url: str) -> str:
    return httpx.get(url, timeout=5).text


def test_the_tracker_serves_metrics_on_a_free_port_and_stops_at_finish(tmp_path: Path) -> None:
    targets = tmp_path / "file_sd"
    cfg = PrometheusTracking(port=0, host="127.0.0.1", file_sd_dir=str(targets))
    stage = SimpleNamespace(name="sft", kind="sft", out_dir=tmp_path, hang_timeout_s=30.0)
    sink = PrometheusSink(cfg, [stage])
    sink.start_pipeline("run-9", None, {"run": {"name": "demo"}})
    port = sink._server.server_port
    assert sink.link == f"http://127.0.0.1:{port}/metrics"
    # Prometheus finds it through file_sd while it serves
    target = json.loads((targets / "run-9.json").read_text())
    assert target == [{"targets": [f"127.0.0.1:{port}"]}]
    sink.start_stage("sft", "abc")
    write(tmp_path, [{**TRAIN, "loss": 1.5}])
    text = _get(f"http://127.0.0.1:{port}/metrics")
    assert 'posttrain_loss{kind="sft",recipe="demo",run="run-9",stage="sft"} 1.5' in text
    # a second run cannot take the same port: the tracker is given up, naming it
    taken = PrometheusSink(cfg.model_copy(update={"port": port, "file_sd_dir": None}), [stage])
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
        taken.start_pipeline("run-10", None, {"run": {"name": "demo"}})
    sink.end_stage(StageRecord("sft", "f" * 16, "failed", 1.0))
    sink.finish(RunResult("run-9", tmp_path, []))
    with pytest.raises(httpx.ConnectError):
        _get(f"http://127.0.0.1:{port}/metrics")
    assert list(targets.iterdir()) == []  # gone with the endpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_tracker_pushes_how_the_run_ended_to_a_real_pushgateway(tmp_path: Path) -> None:
    binary = shutil.which("prometheus-pushgateway")
    # scripts/dev.sh installs it for both tiers: missing, this fails rather than skips.
    assert binary, "Debian's prometheus-pushgateway is not installed (scripts/dev.sh installs it)"
    port = _free_port()
    gateway = subprocess.Popen(
        [binary, f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{url}/-/ready", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        cfg = PrometheusTracking(pushgateway=url, push_every_s=60)
        stage = SimpleNamespace(name="dpo", kind="dpo", out_dir=tmp_path, hang_timeout_s=None)
        sink = PrometheusSink(cfg, [stage])
        sink.start_pipeline("run-p", None, {"run": {"name": "pushed"}})
        sink.start_stage("dpo", "f")
        sink.end_stage(StageRecord("dpo", "f" * 16, "failed", 1.0))
        sink.finish(RunResult("run-9", tmp_path, []))
        pushed = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(_get(f"{url}/metrics"))
            for s in f.samples
        }
        # grouped by job and run; the gateway adds an empty `instance`
        assert value(pushed, "posttrain_stage_status", job="posttrain", status="failed") == 1
        assert value(pushed, "posttrain_stage_status", run="run-p", status="running") == 0
    finally:
        gateway.kill()
        gateway.wait()
