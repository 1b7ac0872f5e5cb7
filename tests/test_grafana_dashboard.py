"""The shipped Grafana dashboard (docs/monitoring/grafana-posttrain.json) imports as is and
covers every exported series (flows.trackers.prom_names)."""

from __future__ import annotations

import json
import re
import subprocess

from monitoring_queries import DASHBOARD, dashboard_panels, panel_queries, promtool

from flows.trackers.prom_names import BY_NAME, SERIES

METRIC = re.compile(r"\bposttrain_[a-z_]*[a-z]\b")
VARIABLE = re.compile(r"\$\{?(\w+)")
# Grafana's own variables, defined by Grafana rather than by the dashboard.
BUILTIN = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_is_importable_json_with_a_datasource_input() -> None:
    dash = _dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["id"] is None, "an exported dashboard has no id: import assigns one"
    inputs = {i["name"]: i for i in dash["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["run"]["query"]["query"] == "label_values(posttrain_run_info, run)"
    stage = variables["stage"]
    assert stage["query"]["query"] == 'label_values(posttrain_stage_status{run="$run"}, stage)'
    assert stage["multi"] and stage["includeAll"]
    for panel in dashboard_panels():
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_rows_are_expanded_and_panels_have_unique_ids_and_places() -> None:
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    ids += [p["id"] for row in dash["panels"] for p in row.get("panels", [])]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == [
        "Throughput & MFU",
        "Training",
        "Memory",
        "GPU health",
        "Network",
        "Data",
        "Liveness",
        "RL",
    ]
    assert all(r["collapsed"] is False for r in rows)
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))


def test_every_panel_has_targets_a_unit_and_filters_by_run_and_stage() -> None:
    for panel in dashboard_panels():
        assert panel["type"] in {"timeseries", "stat", "table"}, panel["title"]
        assert panel["targets"], f"{panel['title']} has no targets"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']} has no unit"
        for target in panel["targets"]:
            expr = target["expr"]
            assert METRIC.search(expr), expr
            # Every series selector of the panel is narrowed to the chosen run and stages.
            for name in METRIC.findall(expr):
                assert f'{name}{{run="$run", stage=~"$stage"' in expr, (panel["title"], expr)


def test_every_metric_and_variable_used_exists() -> None:
    dash = _dashboard()
    defined = {v["name"] for v in dash["templating"]["list"]} | BUILTIN
    texts = [t["expr"] for p in dashboard_panels() for t in p["targets"]]
    texts += [v["query"]["query"] for v in dash["templating"]["list"]]
    for text in texts:
        unknown = set(METRIC.findall(text)) - BY_NAME.keys()
        assert not unknown, f"not in flows.trackers.prom_names: {sorted(unknown)} ({text})"
        undefined = set(VARIABLE.findall(text)) - defined
        assert not undefined, f"undefined variables {sorted(undefined)} in {text}"


def test_the_dashboard_covers_every_exported_series() -> None:
    shown = {name for _, expr in panel_queries() for name in METRIC.findall(expr)}
    missing = [s.name for s in SERIES if s.name != "posttrain_run_info" and s.name not in shown]
    assert not missing, f"exported but on no panel: {missing}"


def test_panel_queries_fill_in_the_variables() -> None:
    queries = panel_queries(run="run-1", stage="sft|dpo", rate_interval="30s")
    assert len(queries) == sum(len(p["targets"]) for p in dashboard_panels())
    for title, expr in queries:
        assert "$" not in expr, (title, expr)
        assert 'run="run-1", stage=~"sft|dpo"' in expr, (title, expr)
    assert any("[30s]" in expr for _, expr in queries)


def test_every_panel_query_parses(tmp_path) -> None:
    # promtool parses each query as a recording rule; the lead's slow test runs them for real.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(panel_queries(run="r1"))
                ],
            }
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(json.dumps(rules))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
