"""The shipped Prometheus alert rules (docs/monitoring/alerts.yml): promtool accepts them, their
unit tests (docs/monitoring/alerts_test.yml) pass, and they only name exported series."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from monitoring_queries import promtool

from flows.trackers.prom_names import BY_NAME

MONITORING = Path(__file__).resolve().parents[1] / "docs" / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts_test.yml"
# Metric names only: a series name never ends in "_" (the regex would otherwise cut a name at a
# label or function boundary).
METRIC = re.compile(r"\bposttrain_[a-z_]*[a-z]\b")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=MONITORING
    )


def test_promtool_checks_the_rules() -> None:
    proc = _run("check", "rules", RULES.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_unit_tests_pass() -> None:
    proc = _run("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_every_alert_names_exported_series_only() -> None:
    used = {name for rule in _rules() for name in METRIC.findall(rule["expr"])}
    assert used, "no posttrain_ series found in alerts.yml"
    unknown = sorted(used - BY_NAME.keys())
    assert not unknown, f"not in flows.trackers.prom_names: {unknown}"


def test_every_alert_has_severity_summary_and_runbook_and_a_unit_test() -> None:
    rules = _rules()
    assert [g["name"] for g in yaml.safe_load(RULES.read_text())["groups"]] == ["posttrain"]
    for rule in rules:
        assert rule["labels"]["severity"] in {"page", "warn"}, rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["runbook"].strip(), rule["alert"]
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for group in tests:
        for case in group.get("alert_rule_test", []):
            counts = fired if case.get("exp_alerts") else quiet
            counts[case["alertname"]] = counts.get(case["alertname"], 0) + 1
            for alert in case.get("exp_alerts") or []:
                assert alert.get("exp_annotations"), case["alertname"]
                assert alert.get("exp_labels"), case["alertname"]
    names = {rule["alert"] for rule in rules}
    assert names - fired.keys() == set(), "alerts never tested firing"
    assert names - quiet.keys() == set(), "alerts never tested quiet"
