"""The rank's own GPU through NVML (`pynvml`, package nvidia-ml-py): power, temperature, SM
clock and what holds it down, ECC errors, PCIe and NVLink traffic, memory.

A field NVML refuses on this device (NotSupported, or any other NVMLError) is left out of the
GPU's dict, never written as 0: a dashboard must show "no data", not a healthy-looking zero. The
NVML module is a parameter (default `pynvml`) so tests answer the same calls from a recording of
a real device (tests/data/health/).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

import pynvml

# NVML's "KB" (PCIe throughput, KB/s) and NVLink's KiB counters are both 1024 bytes.
KIB = 1024
# Field-value scope meaning "summed over every NVLink link" (nvml.h: a scopeId of UINT_MAX).
ALL_LINKS = 0xFFFFFFFF
# Reason -> clock-event bits (nvml.h names without the nvmlClocksEventReason prefix).
THROTTLE_BITS = {
    "thermal": ("SwThermalSlowdown", "HwThermalSlowdown"),
    "power": ("SwPowerCap", "HwPowerBrakeSlowdown"),
    "sync_boost": ("SyncBoost",),
    "hw_slowdown": ("HwSlowdown",),
}


def throttle_reasons(mask: int, nvml: Any = pynvml) -> dict[str, bool]:
    """The clock-event bitmask as {thermal, power, sync_boost, hw_slowdown}, with NVML's own bit
    values (the newer ClocksEvent names, else the older ClocksThrottle ones: same bits)."""
    new = hasattr(nvml, "nvmlClocksEventReasonSwThermalSlowdown")
    prefix = "nvmlClocksEventReason" if new else "nvmlClocksThrottleReason"
    out = {}
    for reason, names in THROTTLE_BITS.items():
        bits = 0
        for name in names:
            bits |= getattr(nvml, prefix + name)
        out[reason] = bool(mask & bits)
    return out


def cuda_pci_bus_id(cuda_index: int) -> str | None:
    """The PCI bus id of CUDA device `cuda_index` as NVML spells it, when torch exposes it. CUDA
    numbers devices fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID and NVML by PCI order, so
    the bus id is the one join that is always right."""
    import torch

    props = torch.cuda.get_device_properties(cuda_index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return f"{domain:08x}:{bus:02x}:{device:02x}.0"


def device_handle(nvml: Any, cuda_index: int, bus_id: str | None) -> Any:
    """NVML's handle of CUDA device `cuda_index`: by PCI bus id, else through
    CUDA_VISIBLE_DEVICES (an index or a GPU-/MIG- uuid per entry), else the same index."""
    if bus_id is not None:
        return nvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if visible != [""] and cuda_index < len(visible):
        entry = visible[cuda_index]
        if entry.isdigit():
            return nvml.nvmlDeviceGetHandleByIndex(int(entry))
        return nvml.nvmlDeviceGetHandleByUUID(entry)
    return nvml.nvmlDeviceGetHandleByIndex(cuda_index)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _field_number(nvml: Any, field: Any) -> float | None:
    """One nvmlFieldValue_t's value, None when NVML refused that field."""
    if field.nvmlReturn != nvml.NVML_SUCCESS:
        return None
    member = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
    }.get(field.valueType)
    return None if member is None else getattr(field.value, member)


class NvmlSource:
    """Reads one GPU. `status`: "present", or "absent: <why>" (then `sample` returns [])."""

    def __init__(
        self,
        cuda_index: int | None,
        nvml: Any = pynvml,
        bus_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.nvml, self.clock = nvml, clock
        self.handle: Any = None
        self.identity: dict[str, Any] = {}
        # (monotonic time, tx KiB, rx KiB) of the previous NVLink read: the counters are totals
        self._nvlink_prev: tuple[float, float, float] | None = None
        self.status = self._open(cuda_index, bus_id)

    def _open(self, cuda_index: int | None, bus_id: str | None) -> str:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except Exception as exc:  # NVMLError, or the library failing to load at all
            return f"absent: no NVIDIA driver (NVML: {exc})"
        if cuda_index is None:
            nvml.nvmlShutdown()
            return "absent: this rank uses no CUDA device"
        try:
            self.handle = device_handle(nvml, cuda_index, bus_id)
        except nvml.NVMLError as exc:
            nvml.nvmlShutdown()
            return f"absent: CUDA device {cuda_index} not found by NVML ({exc})"
        for key, fn in (
            ("index", nvml.nvmlDeviceGetIndex),
            ("name", lambda h: _text(nvml.nvmlDeviceGetName(h))),
            ("uuid", lambda h: _text(nvml.nvmlDeviceGetUUID(h))),
        ):
            self._put(self.identity, key, fn)
        return "present"

    def close(self) -> None:
        if self.handle is not None:
            self.handle = None
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()

    def _put(self, gpu: dict[str, Any], key: str, fn: Callable[..., Any], *args: Any) -> None:
        """gpu[key] = fn(handle, *args), or nothing when NVML refuses it."""
        # AttributeError: a binding older than the function
        with contextlib.suppress(self.nvml.NVMLError, AttributeError):
            gpu[key] = fn(self.handle, *args)

    def sample(self) -> list[dict[str, Any]]:
        """[the GPU's fields] (one GPU: this rank's), [] when absent."""
        if self.handle is None:
            return []
        nvml, gpu = self.nvml, dict(self.identity)
        put = self._put
        put(gpu, "power_w", lambda h: nvml.nvmlDeviceGetPowerUsage(h) / 1000)  # mW
        put(gpu, "power_limit_w", lambda h: nvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000)
        put(gpu, "temperature_c", nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        put(gpu, "sm_clock_mhz", nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
        put(gpu, "sm_clock_max_mhz", nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_SM)
        put(gpu, "throttle", lambda h: throttle_reasons(self._event_mask(h), nvml))
        for key, kind in (
            ("ecc_corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ("ecc_uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        ):
            put(gpu, key, nvml.nvmlDeviceGetTotalEccErrors, kind, nvml.NVML_VOLATILE_ECC)
        for key, counter in (
            ("pcie_tx_bytes_per_s", nvml.NVML_PCIE_UTIL_TX_BYTES),
            ("pcie_rx_bytes_per_s", nvml.NVML_PCIE_UTIL_RX_BYTES),
        ):
            # NVML's own rate (KB/s over its last 20 ms window): present from the first sample.
            put(gpu, key, lambda h, c=counter: nvml.nvmlDeviceGetPcieThroughput(h, c) * KIB)
        gpu.update(self._nvlink_rates())
        put(gpu, "memory_used_bytes", lambda h: nvml.nvmlDeviceGetMemoryInfo(h).used)
        put(gpu, "memory_total_bytes", lambda h: nvml.nvmlDeviceGetMemoryInfo(h).total)
        return [gpu]

    def _event_mask(self, handle: Any) -> int:
        fn = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        fn = fn or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(handle))

    def _nvlink_rates(self) -> dict[str, float]:
        """NVLink data bytes/s since the previous sample, {} on the first one or when the
        device has no NVLink counters."""
        nvml = self.nvml
        ids = [
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
            (nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        ]
        try:
            tx, rx = (
                _field_number(nvml, f) for f in nvml.nvmlDeviceGetFieldValues(self.handle, ids)
            )
        except (nvml.NVMLError, AttributeError, ValueError):
            return {}
        if tx is None or rx is None:
            return {}
        now, prev = self.clock(), self._nvlink_prev
        self._nvlink_prev = (now, tx, rx)
        if prev is None or now <= prev[0] or tx < prev[1] or rx < prev[2]:
            return {}  # first sample, or the counters were reset
        dt = now - prev[0]
        return {
            "nvlink_tx_bytes_per_s": (tx - prev[1]) * KIB / dt,
            "nvlink_rx_bytes_per_s": (rx - prev[2]) * KIB / dt,
        }
