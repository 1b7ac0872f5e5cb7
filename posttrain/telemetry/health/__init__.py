"""Per-rank device and host health: NVML (`nvml`), InfiniBand ports (`infiniband`), storage
reads (`io`), sampled by a thread per rank into logs/health/rank<k>.json (`sampler`)."""

from posttrain.telemetry.health.sampler import (
    HealthSampler,
    attach_writer,
    detach_writer,
    flatten_health,
    read_health,
    start,
    stop,
)

__all__ = [
    "HealthSampler",
    "attach_writer",
    "detach_writer",
    "flatten_health",
    "read_health",
    "start",
    "stop",
]
