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

LABEL_SETS = {"run": ("run", "recipe"), "stage": ("run", "recipe", "stage", "kind")}
LABEL_SETS["rank"] = (*LABEL_SETS["stage"], "rank", "node")
LABEL_SETS["gpu"] = (*LABEL_SETS["rank"], "gpu")
LABEL_SETS["ib"] = (*LABEL_SETS["rank"], "device", "port")


@dataclass(frozen=True)
class Series:
    name: str
    type: str  # "gauge" or "counter"
    help: str
    labels: tuple[str, ...]


# name | type | label set (+ extra labels) | help
_TABLE = """
posttrain_run_info | gauge | run+flow_run | 1 per pipeline run
posttrain_stage_status | gauge | stage+status | 1 for the stage's status (pending, running, ran, reused, failed), 0 for the others
posttrain_stage_step | gauge | stage | Last optimizer step recorded
posttrain_stage_total_steps | gauge | stage | Optimizer steps the stage runs
posttrain_stage_progress_ratio | gauge | stage | step / total_steps
posttrain_stage_eta_seconds | gauge | stage | Time left at the recent step rate
posttrain_hang_timeout_seconds | gauge | stage | The stage's hang timeout (infra.hang_timeout_s)
posttrain_step_seconds | gauge | stage | Wall time of the last optimizer step
posttrain_tokens_per_second | gauge | stage | Tokens per second, all devices
posttrain_tokens_per_second_per_device | gauge | stage | Tokens per second per device
posttrain_tflops_per_device | gauge | stage | Model TFLOP/s per device
posttrain_mfu_ratio | gauge | stage | Model FLOP utilisation (0..1)
posttrain_loss | gauge | stage | Training loss of the last step
posttrain_eval_loss | gauge | stage | Loss of the last evaluation
posttrain_grad_norm | gauge | stage | Gradient norm of the last step
posttrain_skipped_updates_total | counter | stage | Updates the guard skipped (non-finite loss or gradient, loss spike)
posttrain_nonfinite_updates_total | counter | stage | Updates skipped for a non-finite loss or gradient
posttrain_memory_allocated_bytes | gauge | stage | GPU memory allocated
posttrain_memory_reserved_bytes | gauge | stage | GPU memory reserved
posttrain_memory_peak_allocated_bytes | gauge | stage | Peak GPU memory allocated
posttrain_memory_peak_reserved_bytes | gauge | stage | Peak GPU memory reserved
posttrain_memory_reserved_minus_allocated_bytes | gauge | stage | Reserved but unallocated GPU memory (fragmentation)
posttrain_memory_rss_bytes | gauge | stage | Resident memory of rank 0 (CPU)
posttrain_memory_peak_rss_bytes | gauge | stage | Peak resident memory of rank 0 (CPU)
posttrain_data_wait_ratio | gauge | stage | Share of the last step spent waiting for data
posttrain_rl_phase_ratio | gauge | stage+phase | Share of an RL step per phase (generation, scoring, update)
posttrain_rl_reward | gauge | stage | Mean reward of the last RL step
posttrain_rl_kl | gauge | stage | KL to the reference of the last RL step, by the stage's kl.estimator
posttrain_heartbeat_age_seconds | gauge | rank | Seconds since the rank's heartbeat last advanced
posttrain_heartbeat_step | gauge | rank | Step of the rank's last heartbeat
posttrain_health_source_present | gauge | rank+source | 1 when the rank reads this health source (nvml, infiniband, io), 0 when absent
posttrain_data_read_bytes_per_second | gauge | rank | Bytes the rank read from storage per second
posttrain_gpu_power_watts | gauge | gpu | GPU power draw
posttrain_gpu_power_limit_watts | gauge | gpu | GPU enforced power limit
posttrain_gpu_temperature_celsius | gauge | gpu | GPU temperature
posttrain_gpu_sm_clock_hertz | gauge | gpu | GPU SM clock
posttrain_gpu_sm_clock_max_hertz | gauge | gpu | GPU maximum SM clock
posttrain_gpu_throttle | gauge | gpu+reason | 1 while the GPU's clocks are held down for this reason
posttrain_gpu_ecc_errors_total | counter | gpu+type | GPU ECC errors since the driver loaded (volatile)
posttrain_gpu_pcie_bytes_per_second | gauge | gpu+direction | GPU PCIe throughput
posttrain_gpu_nvlink_bytes_per_second | gauge | gpu+direction | GPU NVLink throughput
posttrain_gpu_memory_used_bytes | gauge | gpu | GPU memory used (NVML)
posttrain_gpu_memory_total_bytes | gauge | gpu | GPU memory total (NVML)
posttrain_ib_bytes_per_second | gauge | ib+direction | InfiniBand/RoCE port data rate
posttrain_ib_errors_total | counter | ib+counter | InfiniBand/RoCE port error counters
posttrain_ib_retransmits_total | counter | ib+counter | InfiniBand/RoCE retransmission and timeout counters
"""


def _series(row: str) -> Series:
    name, type_, labels, help_ = (cell.strip() for cell in row.split("|", 3))
    base, *extra = labels.split("+")
    return Series(name, type_, help_, (*LABEL_SETS[base], *extra))


SERIES: tuple[Series, ...] = tuple(_series(row) for row in _TABLE.strip().splitlines())
BY_NAME = {s.name: s for s in SERIES}
