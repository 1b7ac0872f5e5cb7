"""What keeps a re-run of reused stages cheap: the embedded server is launched early with Prefect's own
command (so its boot overlaps the CLI's imports), and the report's images are drawn once per
content (flows.report.images)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest

from flows.embedded_server import uvicorn_command
from flows.report.images import curves, stage_graph
from flows.report.tables import StageRecord
from posttrain.store.summary import Summary


def test_early_server_command_is_prefects_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """`uvicorn_command` rebuilds, without importing prefect.server, what Prefect's
    SubprocessASGIServer starts: the same arguments and the same environment."""
    import prefect.server.api.server as server_module

    started: dict[str, Any] = {}

    def popen(args: list[str], env: dict[str, str], **kwargs: Any) -> None:
        started.update(args=args, env=env, kwargs=kwargs)

    # Only Prefect's Popen is replaced: nothing starts, and Prefect's own code builds the call.
    monkeypatch.setattr(server_module, "subprocess", types.SimpleNamespace(Popen=popen))
    monkeypatch.setattr(server_module.SubprocessASGIServer, "_instances", {})
    server_module.SubprocessASGIServer(port=8123)._run_uvicorn_command()

    args, env = uvicorn_command(8123)
    assert args == started["args"]
    assert env == started["env"]
    assert started["kwargs"] == {}  # Prefect passes nothing else we would have to copy


def _metrics(folder: Path, losses: list[float]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "train", "step": i + 1, "loss": v} for i, v in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_report_images_are_drawn_once_per_content(tmp_path: Path) -> None:
    """A reused stage's curves and an unchanged stage graph are copied from the image cache,
    byte for byte what drawing gives; changed metrics are drawn anew."""
    cache = tmp_path / "cache"
    sft = _metrics(tmp_path / "sft", [2.0, 1.5, 1.2])
    ingest = _metrics(tmp_path / "ingest", [])  # nothing trained: no image, drawn or cached

    first, copied = curves([("ingest", ingest), ("sft", sft)], tmp_path / "run1", cache)
    assert copied == 0 and [p.stage for p in first] == ["sft"]
    second, copied = curves([("ingest", ingest), ("sft", sft)], tmp_path / "run2", cache)
    assert copied == 1 and second[0].path == tmp_path / "run2" / "curves-sft.png"
    assert (second[0].panels, second[0].series) == (first[0].panels, first[0].series)
    assert second[0].path.read_bytes() == first[0].path.read_bytes()

    _metrics(sft, [2.0, 1.5, 0.9])  # another run's metrics: another image
    third, copied = curves([("sft", sft)], tmp_path / "run3", cache)
    assert copied == 0 and third[0].path.read_bytes() != first[0].path.read_bytes()

    loss = Summary(headline={"loss": 1.2})
    nodes = [
        StageRecord("ingest", "a" * 16, "reused", 0.1),
        StageRecord("sft", "b" * 16, "reused", 0.2, roles={"base": "ingest"}, summary=loss),
    ]
    path, hit = stage_graph(nodes, tmp_path / "run1" / "graph.png", cache)
    # Another run reusing both: its durations differ, nothing drawn does.
    nodes[1] = StageRecord("sft", "b" * 16, "reused", 0.3, roles={"base": "ingest"}, summary=loss)
    again, hit_again = stage_graph(nodes, tmp_path / "run2" / "graph.png", cache)
    assert (hit, hit_again) == (False, True) and again.read_bytes() == path.read_bytes()
    nodes[1] = StageRecord("sft", "b" * 16, "ran", 9.0, roles={"base": "ingest"}, summary=loss)
    assert stage_graph(nodes, tmp_path / "run3" / "graph.png", cache)[1] is False
