"""The ranks' health samples (`<out_dir>/logs/health/rank<k>.json`, written by
`posttrain.telemetry.health`) as Prometheus samples: (series name, labels after the stage-level
ones, value). A source a rank does not have yields nothing but its
`posttrain_health_source_present` 0; a field its device cannot report yields nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.telemetry.health.sampler import read_health

Sample = tuple[str, list[str], float]

MHZ = 1e6
# gpu dict key -> (series, scale)
GPU_FIELDS = {
    "power_w": ("posttrain_gpu_power_watts", 1.0),
    "power_limit_w": ("posttrain_gpu_power_limit_watts", 1.0),
    "temperature_c": ("posttrain_gpu_temperature_celsius", 1.0),
    "sm_clock_mhz": ("posttrain_gpu_sm_clock_hertz", MHZ),
    "sm_clock_max_mhz": ("posttrain_gpu_sm_clock_max_hertz", MHZ),
    "memory_used_bytes": ("posttrain_gpu_memory_used_bytes", 1.0),
    "memory_total_bytes": ("posttrain_gpu_memory_total_bytes", 1.0),
}
# gpu dict key -> (series, extra label value)
GPU_LABELLED = {
    "ecc_corrected": ("posttrain_gpu_ecc_errors_total", "corrected"),
    "ecc_uncorrected": ("posttrain_gpu_ecc_errors_total", "uncorrected"),
    "pcie_tx_bytes_per_s": ("posttrain_gpu_pcie_bytes_per_second", "tx"),
    "pcie_rx_bytes_per_s": ("posttrain_gpu_pcie_bytes_per_second", "rx"),
    "nvlink_tx_bytes_per_s": ("posttrain_gpu_nvlink_bytes_per_second", "tx"),
    "nvlink_rx_bytes_per_s": ("posttrain_gpu_nvlink_bytes_per_second", "rx"),
}


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    return float(value) if isinstance(value, int | float) else None


def samples(out_dir: Path, since: float = 0.0) -> Iterator[Sample]:
    """Every rank's latest sample written at or after wall time `since`."""
    for rank, sample in sorted(read_health(out_dir).items()):
        if float(sample.get("time") or 0.0) < since:
            continue
        who = [str(rank), str(sample.get("node") or "")]
        for source, state in (sample.get("sources") or {}).items():
            present = float(str(state) == "present")
            yield "posttrain_health_source_present", [*who, str(source)], present
        io = sample.get("io") or {}
        if (rate := _num(io.get("read_bytes_per_s"))) is not None:
            yield "posttrain_data_read_bytes_per_second", who, rate
        for gpu in sample.get("gpus") or []:
            yield from _gpu([*who, str(gpu.get("index", 0))], gpu)
        for port in sample.get("ib_ports") or []:
            yield from _ib([*who, str(port.get("device", "")), str(port.get("port", ""))], port)


def _gpu(labels: list[str], gpu: dict[str, Any]) -> Iterator[Sample]:
    for key, (name, scale) in GPU_FIELDS.items():
        if (v := _num(gpu.get(key))) is not None:
            yield name, labels, v * scale
    for key, (name, extra) in GPU_LABELLED.items():
        if (v := _num(gpu.get(key))) is not None:
            yield name, [*labels, extra], v
    for reason, on in (gpu.get("throttle") or {}).items():
        if (v := _num(on)) is not None:
            yield "posttrain_gpu_throttle", [*labels, str(reason)], v


def _ib(labels: list[str], port: dict[str, Any]) -> Iterator[Sample]:
    for direction in ("tx", "rx"):
        if (v := _num(port.get(f"{direction}_bytes_per_s"))) is not None:
            yield "posttrain_ib_bytes_per_second", [*labels, direction], v
    for group in ("errors", "retransmits"):
        name = f"posttrain_ib_{group}_total"
        for counter, value in (port.get(group) or {}).items():
            if (v := _num(value)) is not None:
                yield name, [*labels, str(counter)], v
