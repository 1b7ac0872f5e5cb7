"""Run report building: pure functions over per-stage records."""

from __future__ import annotations

import json

from flows.report.tables import (
    StageRecord,
    format_duration,
    format_value,
    lineage,
    markdown_report,
    metrics_table,
    summary_table,
)
from posttrain.store.summary import Summary


def _records() -> list[StageRecord]:
    return [
        StageRecord("ingest", "aaaa111122223333", "reused", 0.2, "/ws/artifacts/ingest/aaaa",
                    "c0ffee" * 10, [], Summary(headline={"params": 1_300_000})),
        StageRecord("sft", "bbbb111122223333", "ran", 125.0, "/ws/artifacts/sft/bbbb",
                    "beef" * 16, ["aaaa111122223333"],
                    Summary(headline={"eval_loss": 1.23456, "tokens_per_s": 5012.3, "mfu": 0.61})),
        StageRecord("evaluate", "cccc111122223333", "reused", 0.0, "/ws/artifacts/evaluate/cccc",
                    "", ["aaaa111122223333", "bbbb111122223333"]),
    ]  # fmt: skip


def test_format_helpers() -> None:
    assert format_duration(3.21) == "3.2 s"
    assert format_duration(125) == "2m 05s"
    assert format_duration(7322) == "2h 02m"
    assert format_value(1.23456) == "1.235"
    assert format_value(5) == "5"
    assert format_value(1.5e-5) == "1.500e-05"
    assert format_value(float("nan")) == "nan"


def test_markdown_report_one_row_per_stage_with_status_and_metrics() -> None:
    md = markdown_report("quick", "run-1", _records(), export_path="/ws/x/model", run_dir="/r")
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| stage | status | duration |")
    body = rows[1:]
    assert [r.split("|")[1].strip() for r in body] == ["ingest", "sft", "evaluate"]
    ingest, sft, evaluate = body
    assert "| reused | 0.2 s |" in ingest
    assert "| ran | 2m 05s |" in sft
    assert "eval_loss=1.235" in sft and "mfu=0.61" in sft and "`/ws/artifacts/sft/bbbb`" in sft
    assert "| reused | 0.0 s | - |" in evaluate
    assert "**completed**" in md and "/ws/x/model" in md
    # Lineage names each input by stage and fingerprint.
    assert "`evaluate@cccc111122223333` <- ingest@aaaa111122223333, sft@bbbb111122223333" in md


def test_markdown_report_shows_the_failure() -> None:
    records = _records()[:1] + [
        StageRecord("sft", "bbbb", "failed", 3.0, error="stage 'sft' exited with code 1\nboom|x")
    ]
    md = markdown_report("quick", "run-2", records)
    assert "**failed** at stage `sft`" in md
    assert "## `sft` failed" in md and "boom|x" in md
    assert "Exported model" not in md


def test_metrics_table_is_long_format() -> None:
    rows = metrics_table(_records())
    assert {"stage": "sft", "metric": "mfu", "value": 0.61} in rows
    assert {"stage": "sft", "metric": "duration_s", "value": 125.0} in rows
    assert [r["stage"] for r in rows if r["metric"] == "duration_s"] == [
        "ingest",
        "sft",
        "evaluate",
    ]
    assert all(set(r) == {"stage", "metric", "value"} for r in rows)


def test_lineage_lists_every_artifact() -> None:
    data = lineage({"run_id": "run-1"}, _records())
    json.dumps(data)
    assert data["run_id"] == "run-1"
    assert [a["stage"] for a in data["artifacts"]] == ["ingest", "sft", "evaluate"]
    sft = data["artifacts"][1]
    assert sft["parents"] == ["aaaa111122223333"] and sft["sha256"] == "beef" * 16
    assert sft["uri"] == "/ws/artifacts/sft/bbbb" and sft["status"] == "ran"


def test_summary_table_columns_line_up() -> None:
    lines = summary_table(_records()).splitlines()
    assert lines[0].split() == ["stage", "status", "duration", "headline", "metrics"]
    col = lines[0].index("status")
    assert [line[col:].split()[0] for line in lines[2:]] == ["reused", "ran", "reused"]
    assert "tokens_per_s=5012" in lines[3]


def test_the_report_names_the_kl_s_estimator_and_the_reference_s_stage() -> None:
    # SFT -> DPO -> GRPO: GRPO's reference is the DPO policy, its KL measured by k3.
    grpo = StageRecord(
        "grpo", "dddd111122223333", "ran", 90.0, "/ws/artifacts/grpo/dddd",
        parents=["eeee111122223333"],
        summary=Summary(
            headline={"eval_reward": 0.5, "eval_kl": 0.1266, "kl_estimator": "k3"},
            kl_estimator="k3",
        ),
        kind="grpo", roles={"policy": "dpo", "reference": "dpo", "reward_model": "reward"},
    )  # fmt: skip
    md = markdown_report("chain", "run-2", [*_records(), grpo])
    (row,) = [line for line in md.splitlines() if line.startswith("| grpo |")]
    assert "eval_kl=0.1266, kl_estimator=k3" in row  # beside the figure it names
    lines = md.splitlines()
    at = lines.index("## KL to the reference")
    assert lines[at + 4] == (
        "- `grpo`: KL (k3) to the reference, stage `dpo`: 0.1266 nats per held-out response"
    )
    # A run without an online-RL stage has no such section.
    assert "## KL to the reference" not in markdown_report("quick", "run-1", _records())
