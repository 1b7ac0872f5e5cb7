"""The Prometheus series posttrain exports: one table, read by the exporter (flows/trackers/
prometheus.py), the dashboard test and docs/monitoring.md.

Names follow Prometheus conventions: base units (seconds, bytes, hertz, watts, ratios 0..1),
`_total` for counters (prometheus_client appends it to a counter family's name; the table holds
the name Prometheus stores). Every series carries the stage-level labels `run, recipe, stage,
kind` except `posttrain_run_info`; per-rank series add `rank, node`, GPU series `gpu`, InfiniBand
series `device, port`. A series is absent when its source is: never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass

RUN_LABELS = ("run", "recipe")
STAGE_LABELS = ("run", "recipe", "stage", "kind")
RANK_LABELS = (*STAGE_LABELS, "rank", "node")
GPU_LABELS = (*RANK_LABELS, "gpu")
IB_LABELS = (*RANK_LABELS, "device", "port")


@dataclass(frozen=True)
class Series:
    name: str
    type: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...]


def _s(name: str, type_: str, help_: str, labels: tuple[str, ...]) -> Series:
    return Series(name, type_, help_, labels)


SERIES: tuple[Series, ...] = (
    _s("posttrain_run_info", "gauge", "1 per pipeline run", (*RUN_LABELS, "flow_run")),
    _s(
        "posttrain_stage_status",
        "gauge",
        "1 for the stage's status (pending, running, ran, reused, failed), 0 for the others",
        (*STAGE_LABELS, "status"),
    ),
    _s("posttrain_stage_step", "gauge", "Last optimizer step recorded", STAGE_LABELS),
    _s("posttrain_stage_total_steps", "gauge", "Optimizer steps the stage runs", STAGE_LABELS),
    _s("posttrain_stage_progress_ratio", "gauge", "step / total_steps", STAGE_LABELS),
    _s("posttrain_stage_eta_seconds", "gauge", "Time left at the recent step rate", STAGE_LABELS),
    _s(
        "posttrain_hang_timeout_seconds",
        "gauge",
        "The stage's hang timeout (infra.hang_timeout_s)",
        STAGE_LABELS,
    ),
    _s("posttrain_step_seconds", "gauge", "Wall time of the last optimizer step", STAGE_LABELS),
    _s("posttrain_tokens_per_second", "gauge", "Tokens per second, all devices", STAGE_LABELS),
    _s(
        "posttrain_tokens_per_second_per_device",
        "gauge",
        "Tokens per second per device",
        STAGE_LABELS,
    ),
    _s("posttrain_tflops_per_device", "gauge", "Model TFLOP/s per device", STAGE_LABELS),
    _s("posttrain_mfu_ratio", "gauge", "Model FLOP utilisation (0..1)", STAGE_LABELS),
    _s("posttrain_loss", "gauge", "Training loss of the last step", STAGE_LABELS),
    _s("posttrain_eval_loss", "gauge", "Loss of the last evaluation", STAGE_LABELS),
    _s("posttrain_grad_norm", "gauge", "Gradient norm of the last step", STAGE_LABELS),
    _s(
        "posttrain_skipped_updates_total",
        "counter",
        "Updates the guard skipped (non-finite loss or gradient, loss spike)",
        STAGE_LABELS,
    ),
    _s(
        "posttrain_nonfinite_updates_total",
        "counter",
        "Updates skipped for a non-finite loss or gradient",
        STAGE_LABELS,
    ),
    _s("posttrain_memory_allocated_bytes", "gauge", "GPU memory allocated", STAGE_LABELS),
    _s("posttrain_memory_reserved_bytes", "gauge", "GPU memory reserved", STAGE_LABELS),
    _s(
        "posttrain_memory_peak_allocated_bytes",
        "gauge",
        "Peak GPU memory allocated",
        STAGE_LABELS,
    ),
    _s(
        "posttrain_memory_peak_reserved_bytes",
        "gauge",
        "Peak GPU memory reserved",
        STAGE_LABELS,
    ),
    _s(
        "posttrain_memory_reserved_minus_allocated_bytes",
        "gauge",
        "Reserved but unallocated GPU memory (fragmentation)",
        STAGE_LABELS,
    ),
    _s("posttrain_memory_rss_bytes", "gauge", "Resident memory of rank 0 (CPU)", STAGE_LABELS),
    _s(
        "posttrain_memory_peak_rss_bytes",
        "gauge",
        "Peak resident memory of rank 0 (CPU)",
        STAGE_LABELS,
    ),
    _s(
        "posttrain_data_wait_ratio",
        "gauge",
        "Share of the last step spent waiting for data",
        STAGE_LABELS,
    ),
    _s(
        "posttrain_rl_phase_ratio",
        "gauge",
        "Share of an RL step per phase (generation, scoring, update)",
        (*STAGE_LABELS, "phase"),
    ),
    _s("posttrain_rl_reward", "gauge", "Mean reward of the last RL step", STAGE_LABELS),
    _s("posttrain_rl_kl", "gauge", "KL to the reference of the last RL step", STAGE_LABELS),
    _s(
        "posttrain_heartbeat_age_seconds",
        "gauge",
        "Seconds since the rank's heartbeat last advanced",
        RANK_LABELS,
    ),
    _s("posttrain_heartbeat_step", "gauge", "Step of the rank's last heartbeat", RANK_LABELS),
    _s(
        "posttrain_health_source_present",
        "gauge",
        "1 when the rank reads this health source (nvml, infiniband, io), 0 when absent",
        (*RANK_LABELS, "source"),
    ),
    _s(
        "posttrain_data_read_bytes_per_second",
        "gauge",
        "Bytes the rank read from storage per second",
        RANK_LABELS,
    ),
    _s("posttrain_gpu_power_watts", "gauge", "GPU power draw", GPU_LABELS),
    _s("posttrain_gpu_power_limit_watts", "gauge", "GPU enforced power limit", GPU_LABELS),
    _s("posttrain_gpu_temperature_celsius", "gauge", "GPU temperature", GPU_LABELS),
    _s("posttrain_gpu_sm_clock_hertz", "gauge", "GPU SM clock", GPU_LABELS),
    _s("posttrain_gpu_sm_clock_max_hertz", "gauge", "GPU maximum SM clock", GPU_LABELS),
    _s(
        "posttrain_gpu_throttle",
        "gauge",
        "1 while the GPU's clocks are held down for this reason",
        (*GPU_LABELS, "reason"),
    ),
    _s(
        "posttrain_gpu_ecc_errors_total",
        "counter",
        "GPU ECC errors since the driver loaded (volatile)",
        (*GPU_LABELS, "type"),
    ),
    _s(
        "posttrain_gpu_pcie_bytes_per_second",
        "gauge",
        "GPU PCIe throughput",
        (*GPU_LABELS, "direction"),
    ),
    _s(
        "posttrain_gpu_nvlink_bytes_per_second",
        "gauge",
        "GPU NVLink throughput",
        (*GPU_LABELS, "direction"),
    ),
    _s("posttrain_gpu_memory_used_bytes", "gauge", "GPU memory used (NVML)", GPU_LABELS),
    _s("posttrain_gpu_memory_total_bytes", "gauge", "GPU memory total (NVML)", GPU_LABELS),
    _s(
        "posttrain_ib_bytes_per_second",
        "gauge",
        "InfiniBand/RoCE port data rate",
        (*IB_LABELS, "direction"),
    ),
    _s(
        "posttrain_ib_errors_total",
        "counter",
        "InfiniBand/RoCE port error counters",
        (*IB_LABELS, "counter"),
    ),
    _s(
        "posttrain_ib_retransmits_total",
        "counter",
        "InfiniBand/RoCE retransmission and timeout counters",
        (*IB_LABELS, "counter"),
    ),
)

BY_NAME = {s.name: s for s in SERIES}
