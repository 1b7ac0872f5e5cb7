"""The run report's images, drawn once per content: a re-run of reused stages copies them.

A reused stage's metrics and a re-run's stage graph do not change, and drawing them costs ~1-2 s
per run (most of what a cached re-run's flow does). So each image is kept under
`<workspace>/.cache/plots/<key>.png`, keyed by a hash of its input, the drawing module's source
and matplotlib's version: any change draws anew; a deleted cache only costs the drawing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import ModuleType

from flows.report import graph_plot, plots
from flows.report.graph_plot import draw_stage_graph
from flows.report.plots import CurvePlot, plot_stage, write_beside
from flows.report.tables import StageRecord
from posttrain.telemetry.records import read_metrics


def cache_dir(workspace: str | os.PathLike[str]) -> Path:
    """Where a workspace keeps its drawn images (safe to delete)."""
    return Path(workspace) / ".cache" / "plots"


def _key(drawer: ModuleType, *inputs: bytes | str) -> str:
    """Hash of what an image is drawn from (inputs length-prefixed: no two lists hash alike)."""
    code = Path(str(drawer.__file__)).read_bytes()
    h = hashlib.sha256()
    for part in (code, metadata.version("matplotlib"), *inputs):
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:32]


def _put(dest: Path, src: Path | None = None, text: str = "") -> None:
    """Copy `src` (or write `text`) to `dest`, as the drawing code writes (`write_beside`)."""
    write_beside(dest, lambda tmp: shutil.copyfile(src, tmp) if src else tmp.write_text(text))


def curves(
    stages: Sequence[tuple[str, Path]], out_dir: Path, cache: Path
) -> tuple[list[CurvePlot], int]:
    """The curves of each (stage name, artifact folder) from its `metrics.jsonl`, drawn into
    `out_dir` in order through the cache (stages without training steps get no image): the
    plots, and how many were copied."""
    drawn, copied = [], 0
    for stage, folder in stages:
        metrics = Path(folder) / "metrics.jsonl"
        data = metrics.read_bytes() if metrics.is_file() else b""
        key = _key(plots, stage, data)
        image, meta = cache / f"{key}.png", cache / f"{key}.json"
        if image.is_file() and meta.is_file():
            saved = json.loads(meta.read_text())
            path = out_dir / saved["file"]
            _put(path, image)
            drawn.append(CurvePlot(stage, path, tuple(saved["panels"]), tuple(saved["series"])))
            copied += 1
            continue
        plot = plot_stage(stage, read_metrics(metrics), out_dir)
        if plot is None:
            continue
        drawn.append(plot)
        saved = {"file": plot.path.name, "panels": plot.panels, "series": plot.series}
        with contextlib.suppress(OSError):  # a cache that cannot be written costs only time
            _put(image, plot.path)
            _put(meta, text=json.dumps(saved))  # last: a hit needs both files
    return drawn, copied


def stage_graph(nodes: Sequence[StageRecord], path: Path, cache: Path) -> tuple[Path, bool]:
    """`graph_plot.draw_stage_graph` through the cache: the path, and whether it was copied."""
    shown = [
        (r.stage, r.kind, r.roles, graph_plot.shown_status(r), r.summary.headline) for r in nodes
    ]
    image = cache / f"{_key(graph_plot, repr(shown))}.png"
    if image.is_file():
        _put(path, image)
        return path, True
    drawn = draw_stage_graph(nodes, path)
    with contextlib.suppress(OSError):
        _put(image, drawn)
    return drawn, False
