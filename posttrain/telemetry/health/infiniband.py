"""InfiniBand (and RoCE) ports from sysfs: bytes/s each way, error totals, retransmit totals.

Reads `<root>/<device>/ports/<port>/counters/*`, `.../hw_counters/*` and `.../link_layer`
(root `/sys/class/infiniband`). The kernel's counters are totals since the port came up; rates
are deltas between two samples over the time between them, so the first sample has none.
Counters a driver does not expose are left out (never 0); a file that cannot be read or parsed
(some hw_counters fail their read on some firmware) is skipped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_ROOT = "/sys/class/infiniband"
# port_xmit_data / port_rcv_data count 4-byte words ("octets divided by 4", IBA spec): x4.
LANE_BYTES = 4
DATA = {"tx": "port_xmit_data", "rx": "port_rcv_data"}
ERRORS = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_xmit_discards",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
)
# hw_counters (mlx5): the transport retrying or timing out, what a flaky fabric shows first.
RETRANSMITS = (
    "local_ack_timeout_err",
    "packet_seq_err",
    "out_of_sequence",
    "implied_nak_seq_err",
    "duplicate_request",
    "rnr_nak_retry_err",
    "roce_slow_restart",
)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_group(folder: Path, names: tuple[str, ...]) -> dict[str, int]:
    """{name: value} of the counters in `folder` among `names` that exist and parse."""
    out = {}
    for name in names:
        value = _read_int(folder / name)
        if value is not None:
            out[name] = value
    return out


def find_ports(root: Path) -> list[tuple[str, str, Path]]:
    """(device, port, port folder) of every port under `root`, sorted."""
    return sorted(
        (port.parent.parent.name, port.name, port)
        for port in root.glob("*/ports/*")
        if port.is_dir()
    )


class InfinibandSource:
    """Reads every port of the host. `status`: "present" or "absent: <why>"."""

    def __init__(
        self, root: str | Path = DEFAULT_ROOT, clock: Callable[[], float] = time.monotonic
    ):
        self.root, self.clock = Path(root), clock
        self.ports: list[tuple[str, str, Path]] = []
        # (device, port) -> (time, tx bytes, rx bytes) of the previous sample
        self._prev: dict[tuple[str, str], tuple[float, int | None, int | None]] = {}
        if not self.root.is_dir():
            self.status = f"absent: no {self.root}"
            return
        self.ports = find_ports(self.root)
        self.status = "present" if self.ports else f"absent: no ports under {self.root}"

    def close(self) -> None:
        pass

    def sample(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [self._port(device, port, path, now) for device, port, path in self.ports]

    def _port(self, device: str, port: str, path: Path, now: float) -> dict[str, Any]:
        entry: dict[str, Any] = {"device": device, "port": port}
        with contextlib.suppress(OSError):
            entry["link_layer"] = (path / "link_layer").read_text().strip()
        counters = path / "counters"
        totals = {d: _read_int(counters / name) for d, name in DATA.items()}
        data = {d: None if v is None else v * LANE_BYTES for d, v in totals.items()}
        prev = self._prev.get((device, port))
        self._prev[(device, port)] = (now, data["tx"], data["rx"])
        if prev is not None and now > prev[0]:
            for i, direction in enumerate(("tx", "rx"), 1):
                before, after = prev[i], data[direction]
                # A counter that went down was reset (port reset, driver reload): no rate.
                if before is not None and after is not None and after >= before:
                    entry[f"{direction}_bytes_per_s"] = (after - before) / (now - prev[0])
        entry["errors"] = _read_group(counters, ERRORS)
        entry["retransmits"] = _read_group(path / "hw_counters", RETRANSMITS)
        return entry
