"""`posttrain runs` and `posttrain clean` on workspaces built with the project's own writers:
`artifacts.write_manifest`, the run record (`run_status.RunJournal`), the promotion registry
(`promotion.record_decision`), checkpoint integrity records and artifact locks."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.cli import cmd_clean, cmd_runs, main
from flows.workspace_report import human
from posttrain.store.artifacts import stage_dir, write_manifest
from posttrain.store.locking import ArtifactLock
from posttrain.store.status import status
from posttrain.train.integrity import hash_files, listing, write_record
from posttrain.workspace.clean import DAMAGED, FAILED, TRASH, UNREFERENCED, plan_clean
from posttrain.workspace.promotion import Decision, record_decision
from posttrain.workspace.run_status import RunJournal, read_run
from posttrain.workspace.runs import compact_headline, list_runs
from posttrain.workspace.trash import delete

KIB = 1024


def artifact(ws: Path, stage: str, fp: str, complete: bool = True, size: int = 64 * KIB) -> Path:
    folder = stage_dir(ws, stage, fp)
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.bin").write_bytes(os.urandom(size))
    if complete:
        write_manifest(
            folder, stage=stage, fp=fp, parents=[], section={}, seed=0, summary={"headline": {}}
        )
    return folder


def arts(*pairs: tuple[str, str]) -> list[dict]:
    return [{"stage": s, "fingerprint": fp, "status": "ran"} for s, fp in pairs]


def completed_run(ws: Path, run_id: str, used: list[dict], headline: dict, promoted: bool) -> None:
    with RunJournal(ws, run_id, "quickstart") as journal:
        journal.stages(used)
        journal.outcome(headline, promoted, ["tuned_loss", "exact_match", "win_rate"])


def failed_run(ws: Path, run_id: str, used: list[dict]) -> None:
    with pytest.raises(RuntimeError), RunJournal(ws, run_id, "quickstart") as journal:
        journal.stages(used)
        raise RuntimeError("stage 'dpo' exited with code 1: boom\nTraceback ...")


def killed_run(ws: Path, run_id: str) -> None:
    """A run whose process is SIGKILLed while it runs: no final record, the kernel drops its
    lock."""
    code = textwrap.dedent(f"""
        import os, signal
        from posttrain.workspace.run_status import RunJournal
        with RunJournal({str(ws)!r}, {run_id!r}, "chain") as journal:
            journal.stages([{{"stage": "sft", "fingerprint": "sft1", "status": "reused"}}])
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL


def age(folder: Path, seconds: float) -> None:
    """Make everything under `folder` look written `seconds` ago."""
    then = time.time() - seconds
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (then, then), follow_symlinks=False)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """Two pipelines' worth of history: a promoted run, a failed one, a killed one, a newer
    completed one that was not promoted, and the artifacts they left."""
    ws = tmp_path / "ws"
    for stage, fp in [("ingest", "ing1"), ("sft", "sft1"), ("dpo", "dpo1"), ("export", "exp1")]:
        artifact(ws, stage, fp)
    completed_run(
        ws, "20260101T000001Z-a", arts(("ingest", "ing1"), ("sft", "sft1"), ("dpo", "dpo1"),
        ("export", "exp1")), {"base_loss": 6.47, "exact_match": 0.31, "wins": 9, "win_rate": 0.5625,
        "ppl": 6.9}, True,
    )  # fmt: skip
    record_decision(
        ws,
        "quickstart",
        {
            "run_id": "20260101T000001Z-a",
            "metrics": {"exact_match": 0.31},
            "export_path": str(stage_dir(ws, "export", "exp1") / "model"),
            "export_fingerprint": "exp1",
            "lineage": {"ingest": "ing1", "sft": "sft1", "dpo": "dpo1", "export": "exp1"},
        },
        Decision(True, "first candidate of this pipeline"),
    )
    artifact(ws, "dpo", "dpo2", complete=False)  # the failed run's attempt
    failed_run(ws, "20260101T000002Z-b", arts(("ingest", "ing1"), ("sft", "sft1"), ("dpo", "dpo2")))
    # Killed: no final record, and its lock dropped as the kernel drops a dead process's
    # (test_interrupted_run_is_told_by_its_lock kills a real one).
    killed = RunJournal(ws, "20260101T000003Z-c", "chain").__enter__()
    killed.stages(arts(("sft", "sft1")))
    killed.lock.release()
    for stage, fp in [("dpo", "dpo3"), ("export", "exp3")]:
        artifact(ws, stage, fp)
    completed_run(
        ws, "20260101T000004Z-d", arts(("ingest", "ing1"), ("sft", "sft1"), ("dpo", "dpo3"),
        ("export", "exp3")), {"exact_match": 0.27}, False,
    )  # fmt: skip
    artifact(ws, "dpo", "dpo0")  # complete, from a run whose record is gone
    # DPO's reference log-probs caches: of the kept SFT, and of an SFT no longer kept.
    for key, sft in [("ref1", "sft1"), ("ref0", "sft0")]:
        folder = stage_dir(ws, "ref_logps", key)
        folder.mkdir(parents=True)
        (folder / "ref_logps.safetensors").write_bytes(os.urandom(4 * KIB))
        write_manifest(folder, stage="ref_logps", fp=key, parents=[sft], section={}, seed=0,
                       summary={})  # fmt: skip
    return ws


def test_runs_lists_newest_first_with_status_headline_and_promotion(ws: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cmd_runs(None, [], out, err, workspace=str(ws)) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == [
        "run", "recipe", "status", "started", "duration", "headline", "promoted",
    ]  # fmt: skip
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("20260101T000004Z-d", "quickstart", "completed"),
        ("20260101T000003Z-c", "chain", "interrupted"),
        ("20260101T000002Z-b", "quickstart", "failed"),
        ("20260101T000001Z-a", "quickstart", "completed"),
    ]
    # The headline metrics the gate compares (those it has), 3 significant digits; the verdict.
    assert rows[3][-3:] == ["exact_match=0.31", "win_rate=0.562", "yes"]
    assert rows[0][-2:] == ["exact_match=0.27", "no"]
    # No evaluate headline and no gate for the failed and the killed run.
    assert rows[1][-2:] == rows[2][-2:] == ["-", "-"]
    # Why the failed and the killed run ended: the error's first line, the lock's silence.
    assert lines[6:] == [
        "20260101T000003Z-c: the run's process ended without a final record (killed?)",
        "20260101T000002Z-b: stage 'dpo' exited with code 1: boom",
    ]


def test_runs_limit_and_a_running_run(ws: Path) -> None:
    with RunJournal(ws, "20260101T000005Z-e", "quickstart"):
        newest = list_runs(ws, limit=2)
        assert [(r.run_id, r.status) for r in newest] == [
            ("20260101T000005Z-e", "running"),
            ("20260101T000004Z-d", "completed"),
        ]
        assert newest[0].duration_s is not None and newest[0].duration_s < 60
    assert read_run(ws / "runs" / "20260101T000005Z-e")["status"] == "completed"


def test_runs_needs_a_recipe_or_a_workspace(tmp_path: Path, capsys) -> None:
    assert main(["runs"]) == 2
    assert "give a recipe or --workspace DIR (one of them)" in capsys.readouterr().err
    assert main(["runs", "--workspace", str(tmp_path / "nope")]) == 2
    assert "nope: no such workspace folder" in capsys.readouterr().err
    assert main(["runs", "--workspace", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"no runs yet in {tmp_path}\n"


def test_runs_and_clean_take_the_workspace_from_a_recipe(ws: Path, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "run: {name: quickstart, workspace: elsewhere}\n"
        "infra: {device: cpu, precision: fp32}\n"
        "ingest: {source: from_config}\n"
        "sft: {data: {synthetic: {n_examples: 20}}}\n"
    )
    out, err = io.StringIO(), io.StringIO()
    # An override is a recipe's: it names the workspace here.
    assert main(["runs", str(recipe), f"run.workspace={ws}", "--limit", "1"]) == 0
    assert cmd_runs(str(recipe), [f"run.workspace={ws}"], out, err, limit=1) == 0
    assert len(out.getvalue().splitlines()) == 3  # header, rule, the newest run
    assert "20260101T000004Z-d" in out.getvalue()
    out = io.StringIO()
    assert cmd_clean(str(recipe), [f"run.workspace={ws}"], out, err) == 0
    assert out.getvalue().startswith(f"workspace {ws.resolve()} (dry run: nothing is deleted)")
    assert cmd_runs(str(recipe), [], out, err, workspace=str(ws)) == 2
    assert err.getvalue() == "posttrain: give a recipe or --workspace DIR (one of them)\n"


def _candidates(ws: Path) -> dict[str, str]:
    return {str(c.path.relative_to(ws)): c.category for c in plan_clean(ws, quiet_s=0).candidates}


def test_clean_candidates_keep_champion_lineage_and_newest_run(ws: Path) -> None:
    assert _candidates(ws) == {
        "artifacts/dpo/dpo2": FAILED,
        "artifacts/dpo/dpo0": UNREFERENCED,
        "artifacts/ref_logps/ref0": UNREFERENCED,
    }
    # Only the newest run's record counts: the champion's lineage and the newest completed
    # run's artifacts stay all the same.
    assert _candidates(ws) == {
        str(c.path.relative_to(ws)): c.category
        for c in plan_clean(ws, keep_last=1, quiet_s=0).candidates
    }


def test_clean_dry_run_prints_and_deletes_nothing(ws: Path) -> None:
    age(ws, 3600)
    # A stage on another machine (or one that outlived its run) writes without the lock until
    # it notices: the default quiet period leaves a just-written attempt alone, and says so.
    age(stage_dir(ws, "dpo", "dpo2"), 20)
    age(stage_dir(ws, "dpo", "dpo3"), 20)  # complete: nothing writes it, no note
    before = sorted(p for p in ws.rglob("*"))
    out, err = io.StringIO(), io.StringIO()
    assert cmd_clean(None, [], out, err, workspace=str(ws)) == 0
    text = out.getvalue()
    assert sorted(p for p in ws.rglob("*")) == before
    plan = plan_clean(ws)
    size = {c.path.name: human(c.bytes) for c in plan.candidates}
    lines = text.splitlines()
    assert lines[0] == f"workspace {ws.resolve()} (dry run: nothing is deleted)"
    assert [line.split(None, 4) for line in lines[4:6]] == [
        ["unreferenced", "artifact", *size["dpo0"].split(), "artifacts/dpo/dpo0        "
         "complete, but no kept run record and no champion names it"],
        ["unreferenced", "artifact", *size["ref0"].split(), "artifacts/ref_logps/ref0  "
         "a cache computed from an artifact that is no longer kept"],
    ]  # fmt: skip
    assert lines[7:11] == [
        "failed attempts:          0         0 B",
        "damaged checkpoints:      0         0 B",
        f"unreferenced artifacts:   2  {human(plan.total()):>10}",
        "left in .trash:           0         0 B",
    ]
    assert lines[12:15] == [
        "left alone:",
        "  artifacts/dpo/dpo2: written 20 s ago, may still be in use",
        "",
    ]
    assert lines[-1] == f"would free {human(plan.total())}; run with --yes to delete"


def test_clean_yes_deletes_exactly_the_candidates(ws: Path) -> None:
    plan = plan_clean(ws, quiet_s=0)
    survivors = {
        p for p in ws.rglob("*") if not any(p.is_relative_to(c.path) for c in plan.candidates)
    }
    outcome = delete(plan)
    assert {str(c.path.relative_to(ws)) for c in outcome.deleted} == {
        "artifacts/dpo/dpo2", "artifacts/dpo/dpo0", "artifacts/ref_logps/ref0",
    }  # fmt: skip
    assert outcome.skipped == []
    assert outcome.freed == plan.total() >= 2 * 64 * KIB
    # Everything else is there, lock files of the deleted folders added; no trash is left.
    after = set(ws.rglob("*"))
    assert survivors <= after
    assert {p.name for p in after - survivors} == {"dpo2.lock", "dpo0.lock", "ref0.lock"}
    for fp in ("ing1", "sft1", "dpo1", "exp1"):
        stage = {"ing1": "ingest", "sft1": "sft", "dpo1": "dpo", "exp1": "export"}[fp]
        assert status(stage_dir(ws, stage, fp), fp, hashes=True).reusable
    assert _candidates(ws) == {}


def test_clean_an_artifact_whose_files_no_longer_match_its_manifest(ws: Path) -> None:
    (stage_dir(ws, "dpo", "dpo3") / "model" / "weights.bin").write_bytes(b"short")
    plan = plan_clean(ws, quiet_s=0)
    assert [(c.category, c.why) for c in plan.candidates if c.path.name == "dpo3"] == [
        (
            FAILED,
            "its manifest no longer matches its files (model/weights.bin was altered (5 bytes, "
            "the manifest says 65536)): a run rebuilds it",
        )
    ]


def test_clean_leaves_a_locked_attempt_alone(ws: Path) -> None:
    running = artifact(ws, "sft", "sft9", complete=False)
    lock = ArtifactLock(running)
    assert lock.try_acquire({"what": "stage sft, launch test"})
    try:
        plan = plan_clean(ws, quiet_s=0)
        assert "artifacts/sft/sft9" not in {str(c.path.relative_to(ws)) for c in plan.candidates}
        assert "artifacts/sft/sft9: a process holds its lock (a stage is running)" in plan.kept
        delete(plan)
        assert (running / "model" / "weights.bin").is_file()
    finally:
        lock.release()
    assert _candidates(ws)["artifacts/sft/sft9"] == FAILED


def test_clean_a_stage_that_takes_the_lock_after_the_plan_is_skipped(ws: Path) -> None:
    plan = plan_clean(ws, quiet_s=0)
    lock = ArtifactLock(stage_dir(ws, "dpo", "dpo2"))
    assert lock.try_acquire({"what": "stage dpo"})
    try:
        outcome = delete(plan)
    finally:
        lock.release()
    assert outcome.skipped == ["artifacts/dpo/dpo2: a stage took it since the plan was made"]
    assert (stage_dir(ws, "dpo", "dpo2") / "model" / "weights.bin").is_file()


def test_clean_keeps_unreferenced_artifacts_while_a_run_runs(ws: Path) -> None:
    with RunJournal(ws, "20260101T000005Z-e", "quickstart"):
        plan = plan_clean(ws, quiet_s=0)
    assert {c.category for c in plan.candidates} == {FAILED}
    assert plan.kept == [
        "artifacts/dpo/dpo0: unreferenced, but run 20260101T000005Z-e is running and may use it",
        "artifacts/ref_logps/ref0: unreferenced, but run 20260101T000005Z-e is running and may "
        "use it",
    ]


def _checkpoint(art: Path, step: int) -> Path:
    folder = art / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    (folder / "meta.json").write_text(f'{{"step": {step}}}')
    (folder / "__0_0.distcp").write_bytes(os.urandom(8 * KIB))
    write_record(folder, hash_files(folder, listing(folder)))
    return folder


def test_clean_finds_damaged_checkpoints_in_a_kept_artifact(ws: Path) -> None:
    art = stage_dir(ws, "dpo", "dpo3")
    good = _checkpoint(art, 2)
    altered = _checkpoint(art, 4)
    with open(altered / "__0_0.distcp", "r+b") as f:  # same size, other bytes
        f.write(b"\0" * 16)
    half = art / "checkpoints" / "step_0000006.tmp"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"x" * 100)
    plan = plan_clean(ws, quiet_s=0)
    damaged = {c.path.name: c.why for c in plan.candidates if c.category == DAMAGED}
    assert damaged == {
        "step_0000004": "__0_0.distcp: sha256 differs from the one recorded at save",
        "step_0000006.tmp": "half-written",
    }
    delete(plan)
    assert sorted(p.name for p in (art / "checkpoints").iterdir()) == [good.name]
    assert status(art, "dpo3", hashes=True).reusable  # the artifact itself is untouched


def test_clean_never_follows_a_symlink_out_of_the_workspace(ws: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "attempt").mkdir(parents=True)
    (outside / "attempt" / "big.bin").write_bytes(os.urandom(256 * KIB))
    (ws / "artifacts" / "sft" / "sft7").symlink_to(outside / "attempt")  # a linked attempt
    (stage_dir(ws, "dpo", "dpo2") / "base").symlink_to(outside)  # a link inside an attempt
    plan = plan_clean(ws, quiet_s=0)
    assert "artifacts/sft/sft7" not in {str(c.path.relative_to(ws)) for c in plan.candidates}
    attempt = next(c for c in plan.candidates if c.path.name == "dpo2")
    assert attempt.bytes < 100 * KIB  # the link counted as a link, not the 256 KiB behind it
    delete(plan)
    assert not stage_dir(ws, "dpo", "dpo2").exists()
    assert (outside / "attempt" / "big.bin").stat().st_size == 256 * KIB


def test_clean_empties_what_a_killed_clean_left_in_the_trash(ws: Path) -> None:
    left = ws / ".trash" / "123-0-dpo9"
    (left / "model").mkdir(parents=True)
    (left / "model" / "weights.bin").write_bytes(os.urandom(16 * KIB))
    plan = plan_clean(ws, quiet_s=0)
    assert [(c.category, c.why) for c in plan.candidates if c.category == TRASH] == [
        (TRASH, "left by an interrupted clean")
    ]
    delete(plan)
    assert not (ws / ".trash").exists()


def test_clean_refuses_a_negative_keep_last(ws: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cmd_clean(None, [], out, err, workspace=str(ws), keep_last=-1) == 2
    assert err.getvalue() == "posttrain: --keep-last -1: must be 0 or more\n"


def test_interrupted_run_is_told_by_its_lock(tmp_path: Path) -> None:
    killed_run(tmp_path, "20260101T000003Z-c")
    record = read_run(tmp_path / "runs" / "20260101T000003Z-c")
    assert (record["status"], record["duration_at_least"]) == ("interrupted", True)
    assert 0 <= record["duration_s"] < 30
    out = io.StringIO()
    assert cmd_runs(None, [], out, io.StringIO(), workspace=str(tmp_path)) == 0
    row = out.getvalue().splitlines()[2].split()  # started is 3 words, duration 2
    assert (row[2], row[6]) == ("interrupted", f">{record['duration_s']:.1f}")


def test_compact_headline_prefers_the_gates_metrics() -> None:
    headline = {"base_loss": 6.4666, "tuned_loss": 6.2585, "ok": True, "n": 4, "note": "x"}
    assert compact_headline(headline, ["exact_match_tuned", "tuned_loss"]) == "tuned_loss=6.26"
    # None of the gate's: the first numeric ones (a bool is no metric).
    assert compact_headline(headline, ["rm_accuracy"]) == "base_loss=6.47 tuned_loss=6.26 n=4"
    assert compact_headline({}, []) == "-"


def test_a_run_stopped_by_ctrl_c_is_interrupted(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), RunJournal(tmp_path, "20260101T000001Z-a", "q"):
        raise KeyboardInterrupt
    record = read_run(tmp_path / "runs" / "20260101T000001Z-a")
    assert (record["status"], record["error"]) == ("interrupted", "stopped (KeyboardInterrupt)")
