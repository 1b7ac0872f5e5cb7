"""`posttrain runs` and `posttrain clean` on a workspace the `post-train` flow wrote: a failed
run, then a completed one (tiny stand-in stage modules, as in tests/test_flow.py). The failed
run is also where a stage's failure is checked: its error names the stage, and the run folder
and report are written anyway.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest
from test_flow import _recipe, _statuses, fake_stages  # noqa: F401 (a fixture)

from flows.cli import cmd_clean, cmd_runs
from flows.post_train import post_train
from flows.stage.failures import StageFailed
from posttrain.config.schema import Recipe

pytestmark = pytest.mark.slow


def _fails_naming_the_stage(recipe: Recipe) -> str:
    """Run `recipe`, whose sft fails on a fresh workspace: the error names the stage and its
    output, the run folder still gets its report and lineage. The run's id."""
    with pytest.raises(StageFailed) as info:
        post_train(recipe)
    msg = str(info.value)
    assert "stage 'sft' exited with code 1" in msg and "boom" in msg
    notes = getattr(info.value, "__notes__", [])
    assert notes and notes[0].startswith("run folder: ")
    run_dir = Path(notes[0].removeprefix("run folder: "))
    report = (run_dir / "report.md").read_text()
    assert "**failed** at stage `sft`" in report and "boom" in report
    lineage = json.loads((run_dir / "lineage.json").read_text())
    assert [(a["stage"], a["status"]) for a in lineage["artifacts"]] == [
        ("ingest", "ran"), ("sft", "failed"),
    ]  # fmt: skip
    return run_dir.name


def test_runs_shows_the_flows_runs_and_clean_frees_the_failed_attempt(
    prefect_harness: None,
    fake_stages,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    # An SFT whose stage fails (its data differs from the completed run's, so it is another
    # artifact): ingest runs, sft's folder is left without a manifest. Then the completed run,
    # which reuses that ingest.
    fake_stages(sft="fail")
    failed = _fails_naming_the_stage(_recipe(ws, sft={"data": {"synthetic": {"n_examples": 21}}}))
    fake_stages(sft="ok")
    first = post_train(_recipe(ws))
    assert _statuses(first) == {
        "ingest": "reused", "sft": "ran", "evaluate": "ran", "export": "ran",
    }  # fmt: skip

    out, err = io.StringIO(), io.StringIO()
    assert cmd_runs(None, [], out, err, workspace=str(ws)) == 0
    rows = [line.split() for line in out.getvalue().splitlines()[2:4]]
    assert [(r[1], r[2]) for r in rows] == [("flow-test", "completed"), ("flow-test", "failed")]
    assert rows[0][0] == Path(first.run_dir).name and rows[1][0] == failed
    assert rows[0][-1] == "yes"  # the first candidate of the pipeline is promoted
    why = out.getvalue().splitlines()[4]
    assert why.startswith(f"{failed}: ") and "stage 'sft' exited with code 1" in why

    attempt = next(
        p
        for p in (ws / "artifacts" / "sft").iterdir()
        if p.is_dir() and not (p / "manifest.json").exists()
    )
    then = time.time() - 3600  # past clean's quiet period for unlocked writers
    for p in [attempt, *attempt.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)
    out = io.StringIO()
    assert cmd_clean(None, [], out, err, workspace=str(ws), yes=True) == 0
    text = out.getvalue()
    assert "failed attempt  " in text and f"artifacts/sft/{attempt.name}" in text
    assert "failed attempts:          1" in text and "unreferenced artifacts:   0" in text
    assert text.splitlines()[-1].startswith("freed ") and "(1 deleted)" in text
    assert not attempt.exists()
    # What the completed run used is all there: the same recipe reuses every stage.
    assert set(_statuses(post_train(_recipe(ws))).values()) == {"reused"}
