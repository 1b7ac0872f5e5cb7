"""Per-rank health readers (posttrain.telemetry.health), fast and without a GPU:

- NVML against a recorded backend: the pynvml functions answered from values recorded on an
  H200 (tests/data/health/nvml_h200.json), pynvml's real constants and clock-event bits;
- InfiniBand against a sysfs tree written into tmp_path (two samples, the x4 data unit);
- storage reads of this very process, reading a file past the page cache;
- the sampler's rank files, its flat metrics.jsonl records, read_health, its one log line;
- and the real sources of this machine, which must report what is absent, never zeros.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from posttrain.telemetry import health, heartbeat
from posttrain.telemetry.health import nvml as nvml_mod
from posttrain.telemetry.health.infiniband import InfinibandSource
from posttrain.telemetry.health.io import IoSource
from posttrain.telemetry.health.nvml import NvmlSource, throttle_reasons
from posttrain.telemetry.health.sampler import (
    HealthSampler,
    cuda_index_of,
    flatten_health,
    interval_from_env,
    read_health,
    sources_line,
)
from posttrain.telemetry.metrics import MetricsWriter
from posttrain.telemetry.records import read_metrics

RECORDING = Path(__file__).parent / "data" / "health" / "nvml_h200.json"
KIB = 1024


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- a recorded NVML backend ------------------------------------------------------------------


class RecordedNvml:
    """Answers the pynvml calls the reader makes from a recording: `read` selects which of each
    value list answers (the last one repeats). Constants, error classes and structs are
    pynvml's own, so the reader's bit and field handling meets the real values."""

    def __init__(self, recording: dict[str, Any], init_error: int | None = None):
        self.rec, self.init_error, self.read = recording, init_error, 0
        self.inits = 0

    def __getattr__(self, name: str) -> Any:  # constants, NVMLError*, c_nvmlFieldValue_t
        return getattr(pynvml, name)

    def _value(self, dev: dict[str, Any], name: str, *path: str) -> Any:
        if name in dev["not_supported"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        values = dev[name]
        for key in path:
            values = values[key]
        return values[min(self.read, len(values) - 1)] if isinstance(values, list) else values

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def _find(self, key: str, value: Any) -> dict[str, Any]:
        for dev in self.rec["devices"]:
            if str(dev[key]).lower() == str(value).lower():
                return dev
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> dict[str, Any]:
        return self._find("pci_bus_id", bus_id)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.rec["devices"]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.rec["devices"][index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> dict[str, Any]:
        return self._find("uuid", uuid)

    def nvmlDeviceGetIndex(self, dev: dict[str, Any]) -> int:
        return self._value(dev, "nvmlDeviceGetIndex")

    def nvmlDeviceGetName(self, dev: dict[str, Any]) -> str:
        return self._value(dev, "nvmlDeviceGetName")

    def nvmlDeviceGetUUID(self, dev: dict[str, Any]) -> str:
        return dev["uuid"]

    def nvmlDeviceGetPowerUsage(self, dev: dict[str, Any]) -> int:
        return self._value(dev, "nvmlDeviceGetPowerUsage")

    def nvmlDeviceGetEnforcedPowerLimit(self, dev: dict[str, Any]) -> int:
        return self._value(dev, "nvmlDeviceGetEnforcedPowerLimit")

    def nvmlDeviceGetTemperature(self, dev: dict[str, Any], sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._value(dev, "nvmlDeviceGetTemperature")

    def nvmlDeviceGetClockInfo(self, dev: dict[str, Any], clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._value(dev, "nvmlDeviceGetClockInfo")

    def nvmlDeviceGetMaxClockInfo(self, dev: dict[str, Any], clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._value(dev, "nvmlDeviceGetMaxClockInfo")

    def nvmlDeviceGetCurrentClocksEventReasons(self, dev: dict[str, Any]) -> int:
        return self._value(dev, "nvmlDeviceGetCurrentClocksEventReasons")

    def nvmlDeviceGetTotalEccErrors(self, dev: dict[str, Any], kind: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        name = {0: "corrected", 1: "uncorrected"}[kind]
        assert kind == getattr(pynvml, f"NVML_MEMORY_ERROR_TYPE_{name.upper()}")
        return self._value(dev, "nvmlDeviceGetTotalEccErrors", name)

    def nvmlDeviceGetPcieThroughput(self, dev: dict[str, Any], counter: int) -> int:
        direction = {pynvml.NVML_PCIE_UTIL_TX_BYTES: "tx", pynvml.NVML_PCIE_UTIL_RX_BYTES: "rx"}
        return self._value(dev, "nvmlDeviceGetPcieThroughput", direction[counter])

    def nvmlDeviceGetMemoryInfo(self, dev: dict[str, Any]) -> SimpleNamespace:
        total = self._value(dev, "nvmlDeviceGetMemoryInfo", "total")
        used = self._value(dev, "nvmlDeviceGetMemoryInfo", "used")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetFieldValues(self, dev: dict[str, Any], ids: list[tuple[int, int]]) -> Any:
        """Real c_nvmlFieldValue_t structs, as pynvml returns them; a field the device lacks
        carries NVML_ERROR_NOT_SUPPORTED in its nvmlReturn (the call itself succeeds)."""
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        direction = {
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "tx",
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "rx",
        }
        for v, (field, scope) in zip(values, ids, strict=True):
            v.fieldId, v.scopeId = field, scope
            assert scope == 0xFFFFFFFF  # summed over links
            if "nvlink" in dev["not_supported"]:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            v.nvmlReturn = pynvml.NVML_SUCCESS
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            v.value.ullVal = self._value(dev, "nvlink_kib", direction[field])
        return values


def recording() -> dict[str, Any]:
    return json.loads(RECORDING.read_text())


def h200_source(rec: dict[str, Any] | None = None, **kw: Any) -> tuple[NvmlSource, Any, Clock]:
    backend, clock = RecordedNvml(rec or recording()), Clock()
    source = NvmlSource(0, nvml=backend, bus_id="00000000:19:00.0", clock=clock, **kw)
    return source, backend, clock


# --- NVML -------------------------------------------------------------------------------------


def test_nvml_reads_the_recorded_h200_in_contract_units() -> None:
    source, backend, clock = h200_source()
    assert source.status == "present"
    [gpu] = source.sample()
    assert gpu == {
        "index": 0,
        "name": "NVIDIA H200",
        "uuid": "GPU-5b3f4a5e-7c1d-2e8f-9a0b-1c2d3e4f5a6b",
        "power_w": 480.213,
        "power_limit_w": 700.0,
        "temperature_c": 58,
        "sm_clock_mhz": 1980,
        "sm_clock_max_mhz": 1980,
        "throttle": {"thermal": False, "power": False, "sync_boost": False, "hw_slowdown": False},
        "ecc_corrected": 0,
        "ecc_uncorrected": 0,
        "pcie_tx_bytes_per_s": 1171875 * KIB,  # 1.2e9: KB/s from NVML
        "pcie_rx_bytes_per_s": 332031 * KIB,
        # no NVLink rate yet: its counters are totals, the first sample has nothing to diff
        "memory_used_bytes": 101283971072,
        "memory_total_bytes": 150754820096,
    }
    backend.read, clock.now = 1, clock.now + 1.0
    [gpu] = source.sample()
    # 48,828,125 KiB in one second over all links, each way
    assert gpu["nvlink_tx_bytes_per_s"] == pytest.approx(5e10)
    assert gpu["nvlink_rx_bytes_per_s"] == pytest.approx(5e10)
    # the second read holds nvmlClocksEventReasonHwThermalSlowdown (0x40): the clock came down
    assert gpu["throttle"] == {
        "thermal": True,
        "power": False,
        "sync_boost": False,
        "hw_slowdown": False,
    }
    assert (gpu["sm_clock_mhz"], gpu["temperature_c"], gpu["power_w"]) == (1755, 61, 512.337)
    source.close()
    assert backend.inits == 0


@pytest.mark.parametrize(
    ("bit", "reason"),
    [
        ("SwThermalSlowdown", "thermal"),
        ("HwThermalSlowdown", "thermal"),
        ("SwPowerCap", "power"),
        ("HwPowerBrakeSlowdown", "power"),
        ("SyncBoost", "sync_boost"),
        ("HwSlowdown", "hw_slowdown"),
        ("GpuIdle", None),
        ("ApplicationsClocksSetting", None),
    ],
)
def test_clock_event_bits_map_to_reasons(bit: str, reason: str | None) -> None:
    new = getattr(pynvml, f"nvmlClocksEventReason{bit}")
    old = getattr(pynvml, f"nvmlClocksThrottleReason{bit}")
    expected = {r: r == reason for r in ("thermal", "power", "sync_boost", "hw_slowdown")}
    assert throttle_reasons(new, pynvml) == expected
    # a binding with the older names only reads the same bits
    older = SimpleNamespace(
        **{k: getattr(pynvml, k) for k in dir(pynvml) if k.startswith("nvmlClocksThrottle")}
    )
    assert throttle_reasons(old, older) == expected


def test_fields_nvml_refuses_are_left_out_never_zero() -> None:
    rec = recording()
    rec["devices"][0]["not_supported"] = [
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetPowerUsage",
        "nvlink",
    ]
    source, backend, clock = h200_source(rec)
    source.sample()
    backend.read, clock.now = 1, clock.now + 1.0
    [gpu] = source.sample()
    for key in ("ecc_corrected", "ecc_uncorrected", "power_w", "nvlink_tx_bytes_per_s"):
        assert key not in gpu
    assert gpu["power_limit_w"] == 700.0 and gpu["throttle"]["thermal"] is True


def test_nvml_without_a_driver_is_absent_with_its_reason(tmp_path: Path) -> None:
    backend = RecordedNvml(recording(), init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    source = NvmlSource(0, nvml=backend)
    assert source.status == "absent: no NVIDIA driver (NVML: NVML Shared Library Not Found)"
    assert source.sample() == []
    sampler = HealthSampler(tmp_path, 0, 1.0, sources={"nvml": source})
    sample = sampler.sample()
    assert sample["gpus"] == [] and sample["sources"]["nvml"].startswith("absent: no NVIDIA")
    assert flatten_health(sample) == {}


def test_the_rank_s_device_is_found_by_bus_id_then_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = recording()
    by_bus = NvmlSource(0, nvml=RecordedNvml(rec), bus_id="00000000:2a:00.0")
    assert by_bus.identity["index"] == 1  # NVML's index, not the CUDA one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert NvmlSource(0, nvml=RecordedNvml(rec)).identity["index"] == 1
    assert NvmlSource(1, nvml=RecordedNvml(rec)).identity["index"] == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", rec["devices"][1]["uuid"])
    assert NvmlSource(0, nvml=RecordedNvml(rec)).identity["index"] == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert NvmlSource(1, nvml=RecordedNvml(rec)).identity["index"] == 1
    lost = RecordedNvml(rec)
    missing = NvmlSource(0, nvml=lost, bus_id="00000000:99:00.0")
    assert missing.status.startswith("absent: CUDA device 0 not found by NVML")
    assert missing.sample() == [] and lost.inits == 0
    no_gpu = NvmlSource(None, nvml=RecordedNvml(rec))
    assert no_gpu.status == "absent: this rank uses no CUDA device"


def test_cuda_index_of_a_cpu_rank_is_none() -> None:
    import torch

    assert cuda_index_of(torch.device("cpu")) is None
    assert cuda_index_of(torch.device("cuda", 3)) == 3
    if not torch.cuda.is_initialized():
        assert cuda_index_of(None) is None  # and CUDA was not started to find out
        assert not torch.cuda.is_initialized()


# --- InfiniBand -------------------------------------------------------------------------------


def write_port(root: Path, device: str, port: str, counters: dict[str, Any], hw: dict[str, Any]):
    folder = root / device / "ports" / port
    (folder / "counters").mkdir(parents=True, exist_ok=True)
    (folder / "hw_counters").mkdir(exist_ok=True)
    (folder / "link_layer").write_text("InfiniBand\n")
    for name, value in counters.items():
        (folder / "counters" / name).write_text(f"{value}\n")
    for name, value in hw.items():
        (folder / "hw_counters" / name).write_text(f"{value}\n")
    return folder


def test_infiniband_rates_use_4_byte_units_and_read_the_counters_present(tmp_path: Path) -> None:
    root = tmp_path / "infiniband"
    errors = {"symbol_error": 2, "port_rcv_errors": 1, "link_downed": 0}
    retrans = {"local_ack_timeout_err": 3, "packet_seq_err": 0, "out_of_sequence": 5}
    port = write_port(
        root, "mlx5_0", "1", {"port_xmit_data": 1000, "port_rcv_data": 500, **errors}, retrans
    )
    write_port(root, "mlx5_1", "1", {"port_xmit_data": 0}, {})  # a port with data counters only
    # unreadable or garbled counter files are skipped, not reported as 0
    (port / "counters" / "port_xmit_discards").write_text("N/A\n")
    (port / "hw_counters" / "rnr_nak_retry_err").mkdir()
    clock = Clock()
    source = InfinibandSource(root, clock=clock)
    assert source.status == "present"
    first = source.sample()
    assert first[0] == {
        "device": "mlx5_0",
        "port": "1",
        "link_layer": "InfiniBand",
        "errors": errors,
        "retransmits": retrans,
    }
    # 2 s later: 250,000 more words sent (1 MB), 125,000 received
    (port / "counters" / "port_xmit_data").write_text("251000\n")
    (port / "counters" / "port_rcv_data").write_text("125500\n")
    clock.now += 2.0
    second = source.sample()
    assert second[0]["tx_bytes_per_s"] == 500_000.0  # 250,000 x 4 bytes / 2 s
    assert second[0]["rx_bytes_per_s"] == 250_000.0
    assert second[1] == {
        "device": "mlx5_1",
        "port": "1",
        "link_layer": "InfiniBand",
        "tx_bytes_per_s": 0.0,
        "errors": {},
        "retransmits": {},
    }
    flat = flatten_health({"ib_ports": second})
    assert flat == {
        "ib_mlx5_0_1_tx_bytes_per_s": 500_000.0,
        "ib_mlx5_0_1_rx_bytes_per_s": 250_000.0,
        "ib_mlx5_0_1_errors": 3,
        "ib_mlx5_0_1_retransmits": 8,
        "ib_mlx5_1_1_tx_bytes_per_s": 0.0,
    }


def test_infiniband_counter_reset_gives_no_rate(tmp_path: Path) -> None:
    root = tmp_path / "ib"
    port = write_port(root, "mlx5_0", "1", {"port_xmit_data": 9000, "port_rcv_data": 9000}, {})
    clock = Clock()
    source = InfinibandSource(root, clock=clock)
    source.sample()
    (port / "counters" / "port_xmit_data").write_text("10\n")  # reset: the port went down
    clock.now += 1.0
    [entry] = source.sample()
    assert "tx_bytes_per_s" not in entry and entry["rx_bytes_per_s"] == 0.0


def test_no_infiniband_is_absent_with_its_reason(tmp_path: Path) -> None:
    missing = InfinibandSource(tmp_path / "nothing")
    assert missing.status == f"absent: no {tmp_path / 'nothing'}" and missing.sample() == []
    (tmp_path / "empty" / "mlx5_0").mkdir(parents=True)
    empty = InfinibandSource(tmp_path / "empty")
    assert empty.status == f"absent: no ports under {tmp_path / 'empty'}"


# --- storage reads ----------------------------------------------------------------------------


def test_io_rate_is_the_delta_over_the_elapsed_time() -> None:
    totals, clock = iter([1000, 1000, 5_001_000]), Clock()
    source = IoSource(read_bytes=lambda: next(totals), clock=clock)  # 1st read: the probe
    assert source.status == "present"
    assert source.sample() == {"read_bytes_total": 1000}
    clock.now += 0.5
    assert source.sample() == {"read_bytes_total": 5_001_000, "read_bytes_per_s": 10_000_000.0}

    def unsupported() -> int:
        raise AttributeError("'Process' object has no attribute 'io_counters'")

    absent = IoSource(read_bytes=unsupported)
    assert absent.status.startswith("absent: no per-process I/O counters (AttributeError")
    assert absent.sample() is None


def test_io_counts_this_process_reading_a_file_from_storage(tmp_path: Path) -> None:
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise to drop the file from the page cache")
    path, size = tmp_path / "shard.bin", 4 << 20
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    source = IoSource()
    if source.status != "present":
        pytest.skip(source.status)
    first = source.sample()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read goes to storage
        while os.read(fd, 1 << 20):
            pass
    finally:
        os.close(fd)
    second = source.sample()
    grown = second["read_bytes_total"] - first["read_bytes_total"]
    if grown == 0:
        pytest.skip("tmp_path's filesystem does no block I/O (tmpfs?)")
    assert grown >= size and second["read_bytes_per_s"] > 0


# --- the sampler ------------------------------------------------------------------------------


class Fixed:
    """A source answering one value."""

    def __init__(self, value: Any, status: str = "present"):
        self.value, self.status, self.closed = value, status, False

    def sample(self) -> Any:
        if isinstance(self.value, Exception):
            raise self.value
        return copy.deepcopy(self.value)

    def close(self) -> None:
        self.closed = True


def recorded_sources(tmp_path: Path) -> dict[str, Any]:
    root = tmp_path / "sys_ib"
    write_port(root, "mlx5_0", "1", {"port_xmit_data": 0, "symbol_error": 0}, {})
    return {
        "nvml": h200_source()[0],
        "infiniband": InfinibandSource(root),
        "io": Fixed({"read_bytes_total": 7, "read_bytes_per_s": 1.5e7}),
    }


def test_sampler_writes_the_rank_file_and_rank_0_s_flat_records(tmp_path: Path) -> None:
    out = tmp_path / "stage"
    writer = MetricsWriter(out.parent / "metrics.jsonl")
    rank0 = HealthSampler(out, 0, 0.05, writer, sources=recorded_sources(tmp_path))
    rank1 = HealthSampler(out, 1, 0.05, writer, sources=recorded_sources(tmp_path))
    rank0.start(), rank1.start()
    time.sleep(0.3)
    rank0.stop(), rank1.stop()
    writer.close()
    assert all(s.closed for s in (rank0.sources["io"], rank1.sources["io"]))
    files = read_health(out)
    assert sorted(files) == [0, 1]
    sample = files[0]
    assert set(sample) == {
        "rank",
        "node",
        "pid",
        "time",
        "interval_s",
        "sources",
        "gpus",
        "ib_ports",
        "io",
    }
    assert (sample["node"], sample["pid"], sample["interval_s"]) == (
        socket.gethostname(),
        os.getpid(),
        0.05,
    )
    assert sample["sources"] == {"nvml": "present", "infiniband": "present", "io": "present"}
    assert (
        sample["gpus"][0]["name"] == "NVIDIA H200" and sample["ib_ports"][0]["device"] == "mlx5_0"
    )
    assert sample["io"] == {"read_bytes_total": 7, "read_bytes_per_s": 1.5e7}
    assert not list((out / "logs" / "health").glob(".*.tmp"))

    records = read_metrics(out.parent / "metrics.jsonl", "health")
    assert len(records) >= 2 and {r["rank"] for r in records} == {0}  # rank 1 never appends
    last = records[-1]
    assert all(isinstance(v, int | float) for k, v in last.items() if k != "kind")
    assert last["gpu0_power_w"] == 480.213 and last["gpu0_throttle_thermal"] == 0
    assert last["gpu0_memory_total_bytes"] == 150754820096
    assert last["io_read_bytes_per_s"] == 1.5e7
    assert last["ib_mlx5_0_1_tx_bytes_per_s"] == 0.0 and last["ib_mlx5_0_1_errors"] == 0
    assert "gpu0_name" not in last and "gpu0_index" not in last


def test_stage_writer_attaches_itself_after_truncating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module-level sampler (stage_main's) gets rank 0's MetricsWriter when the stage opens
    it; records before that would be truncated away, so none are written to the old file."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"kind": "train", "step": 1}\n')  # an earlier launch's file
    monkeypatch.setenv("POSTTRAIN_HEALTH_INTERVAL_S", "0.05")
    sampler = health.start(tmp_path, 0)
    try:
        assert sampler is not None
        sampler.sources = {"io": Fixed({"read_bytes_total": 1, "read_bytes_per_s": 2.0})}
        time.sleep(0.15)
        assert metrics.read_text() == '{"kind": "train", "step": 1}\n'
        beat = heartbeat.start(tmp_path, 0)
        beat.beat(step=7, phase="train")  # the trackers plot records by step: the rank's own
        writer = MetricsWriter(metrics)
        writer.write("start", step=0)
        deadline = time.monotonic() + 5
        while not read_metrics(metrics, "health") and time.monotonic() < deadline:
            time.sleep(0.02)
        writer.close()
        n = len(read_metrics(metrics, "health"))
        time.sleep(0.15)  # closed: detached, nothing more is appended
        assert len(read_metrics(metrics, "health")) == n >= 1
        assert read_metrics(metrics)[0]["kind"] == "start"
        assert read_metrics(metrics, "health")[0]["io_read_bytes_per_s"] == 2.0
        assert read_metrics(metrics, "health")[-1]["step"] == 7
    finally:
        health.stop()
        heartbeat.stop()
    assert health.sampler._current is None


def test_interval_zero_disables_and_bad_values_fall_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSTTRAIN_HEALTH_INTERVAL_S", "0")
    assert health.start(tmp_path, 0) is None
    assert not (tmp_path / "logs" / "health").exists()
    monkeypatch.setenv("POSTTRAIN_HEALTH_INTERVAL_S", "often")
    assert interval_from_env() == 5.0
    monkeypatch.delenv("POSTTRAIN_HEALTH_INTERVAL_S")
    assert interval_from_env() == 5.0


def test_read_health_skips_torn_and_foreign_files(tmp_path: Path) -> None:
    folder = tmp_path / "logs" / "health"
    folder.mkdir(parents=True)
    (folder / "rank0.json").write_text(json.dumps({"rank": 0, "gpus": []}))
    (folder / "rank1.json").write_text('{"rank": 1, "gpus": [{"ind')  # torn mid-write
    (folder / "rank2.json").write_text('{"gpus": []}')  # no rank
    (folder / ".rank3.json.tmp").write_text(json.dumps({"rank": 3}))
    assert read_health(tmp_path) == {0: {"rank": 0, "gpus": []}}
    assert read_health(tmp_path / "elsewhere") == {}


def test_sources_logged_once_by_rank_0(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sources = {
        "nvml": Fixed([], "absent: no NVIDIA driver (NVML: NVML Shared Library Not Found)"),
        "infiniband": Fixed([], "absent: no /sys/class/infiniband"),
        "io": Fixed({"read_bytes_total": 0}),
    }
    with caplog.at_level(logging.INFO, logger="posttrain.health"):
        for rank in (0, 1):
            s = HealthSampler(tmp_path, rank, 10.0, sources=dict(sources))
            s.start()
            s.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "health: nvml absent (no NVIDIA driver (NVML: NVML Shared Library Not Found)), "
        "infiniband absent (no /sys/class/infiniband), io present"
    ]
    assert sources_line({"io": "present"}) == "health: io present"


def test_a_failing_source_costs_only_itself_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sources = {
        "nvml": Fixed(RuntimeError("GPU is lost")),
        "io": Fixed({"read_bytes_total": 3}),
    }
    sampler = HealthSampler(tmp_path, 1, 0.02, sources=sources)
    with caplog.at_level(logging.WARNING, logger="posttrain.health"):
        sampler.start()
        time.sleep(0.15)
        sampler.stop()
    sample = read_health(tmp_path)[1]
    assert sample["gpus"] == [] and sample["io"] == {"read_bytes_total": 3}
    assert sample["sources"]["nvml"] == "absent: read failed (RuntimeError: GPU is lost)"
    assert sum("GPU is lost" in r.getMessage() for r in caplog.records) == 1


def test_this_cpu_machine_reports_its_absent_sources_and_no_entries(tmp_path: Path) -> None:
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is installed here")
    except pynvml.NVMLError:
        pass
    if Path("/sys/class/infiniband").exists():
        pytest.skip("this machine has /sys/class/infiniband")
    sampler = HealthSampler(tmp_path, 0, 1.0, cuda_index=cuda_index_of(None))
    sampler.start()
    sampler.stop()
    sample = read_health(tmp_path)[0]
    assert sample["sources"]["nvml"].startswith("absent: no NVIDIA driver (NVML: ")
    assert sample["sources"]["infiniband"] == "absent: no /sys/class/infiniband"
    assert sample["gpus"] == [] and sample["ib_ports"] == []
    assert not any(k.startswith(("gpu", "ib_")) for k in flatten_health(sample))
    assert nvml_mod.pynvml is pynvml  # the real binding is the default
