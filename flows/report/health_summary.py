"""What an SRE wants to know about a stage once it has ended, from its metrics.jsonl (train and
health records) and its ranks' health sources: the share of time waiting for data, memory
headroom (reserved over allocated on GPUs, peak RSS on CPU), MFU and step time, GPU throttling,
power and temperature, network errors, storage reads — each with its worst moment.

`summarize` gives the figures (the run report's SRE section); `health_line` one line of them
(the terminal summary). A source the stage did not have is said to be absent, never "fine".
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GIB = 1024**3
THROTTLE_KEY = re.compile(r"^gpu(\d+)_throttle_(\w+)$")
MEMORY_USED_KEY = re.compile(r"^gpu(\d+)_memory_used_bytes$")
ALERTING_THROTTLE = ("thermal", "power", "hw_slowdown")
# A GPU under these shares of its power limit, MFU and memory is waiting on the host (launching
# kernels, Python), not computing: on the one H200 lent, 0.5B SFT at 8 rows a step drew 28% of
# its limit on average at 3% MFU with 12% of its memory, and its step took as long as 1.5B's.
UNDERFED = {"power": 0.6, "mfu": 0.2, "memory": 0.5}


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _worst(rows: Sequence[tuple[float, float]], high: bool = True) -> dict[str, float] | None:
    """(value, step) rows -> their median and the worst one (highest, or lowest)."""
    if not rows:
        return None
    value, step = (max if high else min)(rows, key=lambda r: r[0])
    return {"median": statistics.median(v for v, _ in rows), "worst": value, "worst_step": step}


def _train_series(train: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    waits, mfus, steps, ratios, rss = [], [], [], [], []
    wait_total = step_total = 0.0  # the mean share is time-weighted: total wait / total time
    for r in train:
        step = _num(r.get("step")) or 0.0
        st, wait = _num(r.get("step_time_s")), _num(r.get("data_wait_s"))
        if st and wait is not None:
            waits.append((wait / st, step))
            wait_total, step_total = wait_total + wait, step_total + st
        if st:
            steps.append((st, step))
        if (m := _num(r.get("mfu"))) is not None:
            mfus.append((m, step))
        alloc, res = _num(r.get("mem_allocated_gib")), _num(r.get("mem_reserved_gib"))
        if alloc and res is not None:
            ratios.append((res / alloc, step))
        if (p := _num(r.get("mem_peak_rss_gib"))) is not None:
            rss.append((p, step))
    if waits:
        out["data_wait"] = {**(_worst(waits) or {}), "mean": wait_total / step_total}
    out["mfu"] = _worst(mfus, high=False)
    out["step_time"] = _worst(steps)
    out["reserved_over_allocated"] = _worst(ratios)
    out["peak_rss_gib"] = _worst(rss)
    out["skipped_updates"] = sum(_num(r.get("skipped_updates")) or 0 for r in train)
    out["nonfinite_updates"] = sum(_num(r.get("nonfinite_updates")) or 0 for r in train)
    return {k: v for k, v in out.items() if v is not None}


def _health_series(health: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: dict[str, float] = {}  # throttle reason -> seconds into the stage it was first seen
    # Every sample's power, power limit, temperature, read rate and each GPU's share of its memory.
    power, limits, temps, reads, used = (list[float]() for _ in range(5))
    ib_err: dict[str, list[float]] = {}
    for r in health:
        at = (_num(r.get("time")) or t0) - t0
        for key, value in r.items():
            if (m := THROTTLE_KEY.match(key)) and value and m.group(2) not in seen:
                seen[m.group(2)] = at
            elif (m := MEMORY_USED_KEY.match(key)) and (
                total := _num(r.get(f"gpu{m.group(1)}_memory_total_bytes"))
            ):
                used.append(float(value) / total)
            elif key.endswith("_power_w") and key.startswith("gpu"):
                power.append(float(value))
            elif key.endswith("_power_limit_w"):
                limits.append(float(value))
            elif key.endswith("_temperature_c"):
                temps.append(float(value))
            elif key.startswith("ib_") and key.endswith(("_errors", "_retransmits")):
                ib_err.setdefault(key, []).append(float(value))
        if (v := _num(r.get("io_read_bytes_per_s"))) is not None:
            reads.append(v)
    if power:
        out["gpu"] = {
            "throttle_first_s": seen,
            "power_min_w": min(power),
            "power_mean_w": statistics.fmean(power),
            "power_limit_w": max(limits, default=None),
            "temperature_max_c": max(temps, default=None),
            "memory_used_max_frac": max(used, default=None),
        }
    if ib_err:
        out["ib_increase"] = {k: v[-1] - v[0] for k, v in ib_err.items()}
    if reads:
        out["read_bytes_per_s"] = {"mean": statistics.fmean(reads), "max": max(reads)}
    return out


def summarize(
    records: Sequence[dict[str, Any]], sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """The stage's SRE figures. `sources`: rank 0's health sources (`present` or `absent: why`)."""
    train = [r for r in records if r.get("kind") == "train"]
    health = [r for r in records if r.get("kind") == "health"]
    t0 = min((t for r in records if (t := _num(r.get("time"))) is not None), default=0.0)
    out = {**_train_series(train), **_health_series(health, t0)}
    if sources:
        out["sources"] = dict(sources)
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 or x == 0 else f"{100 * x:.1f}%"


def health_line(s: dict[str, Any]) -> str:
    """One line: `data-wait 3% (worst 12% at step 40), reserved/allocated 1.12, no throttling
    seen`; empty when the stage recorded no training step."""
    parts = []
    if (w := s.get("data_wait")) is not None:
        parts.append(
            f"data-wait {_pct(w['mean'])} (worst {_pct(w['worst'])} at step {w['worst_step']:.0f})"
        )
    if (m := s.get("reserved_over_allocated")) is not None:
        at = f"at step {m['worst_step']:.0f}"
        parts.append(f"reserved/allocated {m['median']:.2f} (worst {m['worst']:.2f} {at})")
    elif (rss := s.get("peak_rss_gib")) is not None:
        parts.append(f"peak RSS {rss['worst']:.2f} GiB")
    if (mfu := s.get("mfu")) is not None:
        at = f"at step {mfu['worst_step']:.0f}"
        parts.append(f"MFU {_pct(mfu['median'])} median (lowest {_pct(mfu['worst'])} {at})")
    if underfed := underfed_text(s):
        parts.append(underfed)
    if s.get("nonfinite_updates"):
        parts.append(f"{s['nonfinite_updates']:.0f} non-finite updates skipped")
    parts.append(_throttle_text(s))
    if inc := {k: v for k, v in (s.get("ib_increase") or {}).items() if v > 0}:
        parts.append("network errors: " + ", ".join(f"{k} +{v:.0f}" for k, v in inc.items()))
    return ", ".join(p for p in parts if p) if len(parts) > 1 or s.get("data_wait") else ""


def underfed_text(s: dict[str, Any]) -> str:
    """`GPU underfed: ...` when the GPU drew under UNDERFED's share of its power limit at a low
    median MFU with most of its memory free; else (also without readings) empty."""
    gpu, mfu = s.get("gpu") or {}, s.get("mfu")
    limit, mem = gpu.get("power_limit_w"), gpu.get("memory_used_max_frac")
    if mfu is None or not limit or mem is None:
        return ""
    power = gpu["power_mean_w"] / limit
    if power >= UNDERFED["power"] or mfu["median"] >= UNDERFED["mfu"] or mem >= UNDERFED["memory"]:
        return ""
    return (
        f"GPU underfed: {_pct(power)} of its power limit, at most {_pct(mem)} of its memory, "
        f"MFU {_pct(mfu['median'])}; more tokens a step (batch.micro_batch_size) would use it"
    )


def absent_reason(s: dict[str, Any], source: str = "nvml") -> str:
    """Why `source` was not read, short: `no NVIDIA driver` (the library's own words stay in
    the rank's health file)."""
    why = str((s.get("sources") or {}).get(source, "absent")).removeprefix("absent: ")
    return why.split(" (", 1)[0]


def _throttle_text(s: dict[str, Any]) -> str:
    gpu = s.get("gpu")
    if gpu is None:
        return f"GPU health not read ({absent_reason(s)})" if s.get("sources") else ""
    seen = {k: v for k, v in gpu["throttle_first_s"].items() if k in ALERTING_THROTTLE}
    if not seen:
        return "no throttling seen"
    return "throttled: " + ", ".join(f"{k} from {v:.0f} s" for k, v in sorted(seen.items()))


def stage_health(out_dir: Path) -> dict[str, Any]:
    """`summarize` of a stage folder: its metrics.jsonl and rank 0's health sources. Empty when
    unreadable: the summary is a report, never a reason to fail."""
    from posttrain.telemetry.health.sampler import read_health
    from posttrain.telemetry.records import read_metrics

    try:
        records = read_metrics(Path(out_dir) / "metrics.jsonl")
        sources = (read_health(Path(out_dir)).get(0) or {}).get("sources")
    except (OSError, ValueError):
        return {}
    return summarize(records, sources) if records else {}
