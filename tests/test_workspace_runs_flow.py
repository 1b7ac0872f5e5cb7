"""`posttrain runs` and `posttrain clean` on a workspace the `post-train` flow wrote: a completed
run, then a failed one (tiny stand-in stage modules, as in tests/test_flow.py)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from test_flow import _recipe, _statuses, fake_stages  # noqa: F401 (a fixture)

from flows.cli import cmd_clean, cmd_runs
from flows.post_train import post_train
from flows.stage.failures import StageFailed

pytestmark = pytest.mark.slow


def test_runs_shows_the_flows_runs_and_clean_frees_the_failed_attempt(
    prefect_harness: None,
    fake_stages,  # noqa: F811 (the fixture imported above)
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    first = post_train(_recipe(ws))
    # Another SFT (its data changed), whose stage fails: ingest is reused, sft's folder is left
    # without a manifest.
    fake_stages(sft="fail")
    changed = _recipe(ws, sft={"data": {"synthetic": {"n_examples": 21}}})
    with pytest.raises(StageFailed):
        post_train(changed)

    out, err = io.StringIO(), io.StringIO()
    assert cmd_runs(None, [], out, err, workspace=str(ws)) == 0
    rows = [line.split() for line in out.getvalue().splitlines()[2:4]]
    assert [(r[1], r[2]) for r in rows] == [("flow-test", "failed"), ("flow-test", "completed")]
    assert rows[1][0] == Path(first.run_dir).name
    assert rows[1][-1] == "yes"  # the first candidate of the pipeline is promoted
    assert "stage 'sft' exited with code 1" in out.getvalue().splitlines()[4]

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
