"""The PromQL queries of the shipped Grafana dashboard (docs/monitoring/grafana-posttrain.json),
with its variables filled in, so a test can run each against a real Prometheus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "monitoring" / "grafana-posttrain.json"


def dashboard_panels(path: Path = DASHBOARD) -> list[dict]:
    """Every panel that is not a row, including those nested in collapsed rows."""
    out: list[dict] = []
    for panel in json.loads(Path(path).read_text())["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def panel_queries(
    path: Path = DASHBOARD, run: str = ".*", stage: str = ".*", rate_interval: str = "1m"
) -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, `$run` replaced by `run` (the
    dashboard matches it exactly: run="$run"), `$stage` by `stage` (a regex, as Grafana writes
    a multi-value or All selection: stage=~"$stage") and Grafana's `$__rate_interval` by
    `rate_interval`."""
    out = []
    for panel in dashboard_panels(path):
        for target in panel.get("targets", []):
            expr = (
                target["expr"]
                .replace("$__rate_interval", rate_interval)
                .replace("$stage", stage)
                .replace("$run", run)
            )
            out.append((panel["title"], expr))
    return out


def promtool() -> str:
    """promtool's path; a test that needs it fails (never skips) where it is missing."""
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is missing: run `bash scripts/dev.sh test` (or test-fast), which installs "
            "Debian's prometheus package, or install it by hand (apt-get install prometheus)"
        )
    return path
