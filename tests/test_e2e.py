"""`posttrain run` end to end on the real stages with a tiny recipe, on a Prefect test server:
a first run builds every stage, a re-run is all cache hits, and a change to the evaluate section
re-runs evaluate and export only."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from stage_helpers import TINY, write_recipe

from flows.cli import cmd_run

pytestmark = pytest.mark.slow

# Smaller than the stage tests' recipe: this checks orchestration, not learning.
FAST = ["ingest.from_config.pretrain_steps=5", "sft.max_steps=3"]


def _run(recipe: Path, *overrides: str) -> dict[str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cmd_run(str(recipe), [*FAST, *overrides], out, err)
    assert code == 0, err.getvalue()[-3000:]
    text = out.getvalue()
    rows = text.split("\n\n")[0].splitlines()[2:]
    statuses = {row.split()[0]: row.split()[1] for row in rows}
    model = Path(text.split("exported model:")[1].split()[0])
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    return statuses


def test_run_then_cached_then_downstream_only(prefect_harness: None, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, TINY)
    assert _run(recipe) == dict.fromkeys(("ingest", "sft", "evaluate", "export"), "ran")
    assert _run(recipe) == dict.fromkeys(("ingest", "sft", "evaluate", "export"), "cached")
    assert _run(recipe, "evaluate.max_eval_rows=12") == {
        "ingest": "cached", "sft": "cached", "evaluate": "ran", "export": "ran",
    }  # fmt: skip
    assert len(list((tmp_path / "ws" / "runs").iterdir())) == 3
