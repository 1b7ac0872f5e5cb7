"""Faults met by whole stages, run through their real entry point (`stage_main`, in-process):
a damaged newest checkpoint, every checkpoint damaged, a disk that is full before or fills during
a checkpoint, a damaged parent artifact, and the file modes a stage leaves under two umasks.

What the user sees is checked as they would see it: the stage's log, its last stderr line (the
`POSTTRAIN_ERROR` verdict), metrics.jsonl, and the adapter it finally writes, which must equal
an uninterrupted run's bit for bit whenever training went on."""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan, spec_for
from posttrain.runtime.diskspace import folder_bytes, required_bytes
from posttrain.store.artifacts import ref_from_manifest, verify
from posttrain.store.locking import lock_path
from posttrain.telemetry.records import read_metrics
from posttrain.train.checkpoint import complete_checkpoints
from posttrain.train.resume import inspect_checkpoint
from tests.faults.fault_injection import (
    InjectedDisk,
    SmallDisk,
    disk_filled_when_dcp_writes,
    disk_for_test,
    flip_bytes,
    largest_shard,
    skip_without_tmpfs,
    truncate,
)
from tests.stage_helpers import (
    TINY,
    planned_dir,
    run_inprocess,
    run_shared,
    supervised,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 2
ADAPTER = "adapter/adapter_model.safetensors"


def _tiny(pretrain_steps: int = 30) -> dict:
    data = copy.deepcopy(TINY)
    data["infra"]["threads_per_rank"] = 1
    data["ingest"]["from_config"]["pretrain_steps"] = pretrain_steps
    data["sft"].update(max_steps=STEPS, checkpoint_every=EVERY, keep_checkpoints=3)
    data["sft"]["data"]["synthetic"]["n_examples"] = 120
    return data


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, shared_parents: Path) -> Path:
    path = write_recipe(tmp_path_factory.mktemp("faults"), _tiny())
    # The 30-step base of test_resume, test_head_to_head and test_guards too: built once.
    run_shared("ingest", path, shared_parents)
    return path


@pytest.fixture(scope="module")
def reference(recipe: Path, tmp_path_factory) -> Path:
    """An uninterrupted SFT run (checkpoints at steps 2, 4, 6), moved aside."""
    out = run_inprocess("sft", recipe)
    ref = tmp_path_factory.mktemp("reference") / "sft"
    out.rename(ref)
    return ref


def _crashed_run(recipe: Path, reference: Path, *over: str) -> Path:
    """The stage folder as a run that crashed after step 7 leaves it: the reference run's real
    checkpoints and metrics, no adapter, no manifest."""
    out = planned_dir("sft", recipe, *over)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    shutil.copy(reference / "metrics.jsonl", out / "metrics.jsonl")
    return out


def _same_adapter(out: Path, reference: Path) -> None:
    got, want = load_file(out / ADAPTER), load_file(reference / ADAPTER)
    assert got.keys() == want.keys() and got
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _fails(stage: str, recipe: Path, capsys, *over: str) -> tuple[str, str]:
    """Run a stage that must fail; -> (stdout, its last stderr line)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_inprocess(stage, recipe, *over)
    assert exit_.value.code == 1
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err, "a verdict, not a traceback wall:\n" + cap.err[-3000:]
    return cap.out, cap.err.strip().splitlines()[-1]


def test_damaged_newest_checkpoint_resumes_from_the_older_one_bit_exact(
    recipe: Path, reference: Path, capsys
) -> None:
    out = _crashed_run(recipe, reference)
    shard = largest_shard(out / "checkpoints" / "step_0000006")
    size = shard.stat().st_size
    truncate(shard)
    capsys.readouterr()
    run_inprocess("sft", recipe)
    log = capsys.readouterr().out
    assert (
        f"checkpoint {out / 'checkpoints' / 'step_0000006'} is damaged, not resuming from it: "
        f"{shard.name}: {size // 2} bytes, {size} expected (written at save)" in log
    )
    assert "moved damaged checkpoint step_0000006 aside to step_0000006.damaged" in log
    assert "resumed from step_0000004 at step 4" in log
    assert verify(out)[0]
    _same_adapter(out, reference)
    (resume,) = read_metrics(out / "metrics.jsonl", "resume")
    assert resume["checkpoint"] == "step_0000004" and resume["start_step"] == 4
    assert resume["rejected"][0]["checkpoint"] == "step_0000006"
    # The run saved step 6 again; the damaged one is kept beside it for inspection.
    assert (out / "checkpoints" / "step_0000006.damaged").is_dir()
    assert inspect_checkpoint(out / "checkpoints" / "step_0000006") == (True, [])


def test_every_checkpoint_damaged_restarts_or_fails_as_the_recipe_says(
    recipe: Path, reference: Path, capsys
) -> None:
    # fail: the stage stops, naming every damaged file; the folders stay where they are.
    fail = ("infra.no_intact_checkpoint=fail",)
    out = _crashed_run(recipe, reference, *fail)
    damaged = {}
    for ckpt in complete_checkpoints(out / "checkpoints"):
        flip_bytes(shard := largest_shard(ckpt))
        damaged[ckpt.name] = shard.name
    _, verdict = _fails("sft", recipe, capsys, *fail)
    assert verdict.startswith("POSTTRAIN_ERROR stage sft failed: NoIntactCheckpoint: stage sft: ")
    for ckpt, shard in damaged.items():
        assert f"{ckpt}: {shard}: sha256 differs from the one recorded at save" in verdict
    assert len(complete_checkpoints(out / "checkpoints")) == 3
    assert "NoIntactCheckpoint" in (out / "logs" / "error.txt").read_text()

    # restart (the default): step 0, said in the log and in metrics.jsonl, and the result is
    # an uninterrupted run's.
    out = _crashed_run(recipe, reference)
    for ckpt in complete_checkpoints(out / "checkpoints"):
        truncate(largest_shard(ckpt))
    capsys.readouterr()
    run_inprocess("sft", recipe)
    log = capsys.readouterr().out
    assert (
        "no intact checkpoint (step_0000006, step_0000004, step_0000002 all damaged): "
        "restarting from step 0 (infra.no_intact_checkpoint is restart)" in log
    )
    (resume,) = read_metrics(out / "metrics.jsonl", "resume")
    assert resume["restarted"] and resume["checkpoint"] is None and resume["start_step"] == 0
    assert [r["checkpoint"] for r in resume["rejected"]] == [
        "step_0000006",
        "step_0000004",
        "step_0000002",
    ]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "train")] == list(
        range(1, STEPS + 1)
    )
    _same_adapter(out, reference)


@pytest.fixture
def ckpt_disk(recipe: Path, monkeypatch) -> Iterator[tuple[Path, SmallDisk]]:
    """A fresh SFT folder whose checkpoints/ is a real 40 MiB filesystem of its own."""
    out = planned_dir("sft", recipe)
    shutil.rmtree(out, ignore_errors=True)
    with disk_for_test(out / "checkpoints", 40, monkeypatch) as disk:
        yield out, disk


@pytest.mark.parametrize("when", ["before", "during"])
def test_full_disk_is_a_verdict_and_the_rerun_resumes(
    recipe: Path, reference: Path, ckpt_disk, when: str, capsys
) -> None:
    out, disk = ckpt_disk
    if when == "before":
        # Room for the step-2 checkpoint, not for step 4's beside it: refused before writing.
        size = folder_bytes(reference / "checkpoints" / "step_0000002")
        disk.fill(leave=required_bytes(size) + size // 2)
        if isinstance(disk, InjectedDisk):
            skip_without_tmpfs("the fallback disk does not shrink as files are written")
        _, verdict = _fails("sft", recipe, capsys)
    else:
        with disk_filled_when_dcp_writes(disk, "step_0000004.tmp"):
            _, verdict = _fails("sft", recipe, capsys)
    root = out / "checkpoints"
    assert verdict.startswith(
        f"POSTTRAIN_ERROR stage sft failed: DiskFull: not enough disk space for checkpoint "
        f"step_0000004 in {root}: needs about "
    ), verdict
    assert "keep_checkpoints" in verdict and "run.workspace" in verdict
    assert ("the disk filled while writing it" in verdict) == (when == "during")
    # Nothing half-written; the last good checkpoint intact; no manifest.
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step_0000002"]
    assert inspect_checkpoint(root / "step_0000002") == (True, [])
    assert not (out / "manifest.json").exists()
    assert "DiskFull" in (out / "logs" / "error.txt").read_text()

    disk.free_up()
    capsys.readouterr()
    run_inprocess("sft", recipe)
    assert "resumed from step_0000002 at step 2" in capsys.readouterr().out
    assert verify(out)[0]
    _same_adapter(out, reference)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_parent_fails_the_downstream_stage_before_loading_it(
    recipe: Path, damage: str, capsys, tmp_path: Path
) -> None:
    """Launched as the flow launches it (--spec). The stage names the parent, the file and what
    is wrong, and stops before its own run starts (no config.json: written just before it)."""
    ingest = planned_dir("ingest", recipe)
    weights = ingest / "model" / "model.safetensors"
    saved = tmp_path / "weights"
    shutil.copy(weights, saved)
    try:
        size = weights.stat().st_size
        (truncate if damage == "truncate" else flip_bytes)(weights)
        stages = {s.name: s for s in plan(load_recipe(recipe, [])).stages}
        sft = stages["sft"]
        shutil.rmtree(sft.out_dir, ignore_errors=True)
        spec = spec_for(sft, load_recipe(recipe, []), {"ingest": _ref(ingest)})
        capsys.readouterr()
        from posttrain.stages.common import stage_main
        from posttrain.stages.sft import run

        with supervised(sft, spec) as path, pytest.raises(SystemExit):
            stage_main(run, kind="sft", distributed=True, argv=["--spec", str(path)])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert "Traceback" not in err
        assert last.startswith(
            f"POSTTRAIN_ERROR stage sft failed: ParentArtifactDamaged: parent stage 'ingest' "
            f"artifact {ingest} is damaged: model/model.safetensors was altered ("
        ), last
        why = (
            f"{size // 2} bytes, the manifest says {size}"
            if damage == "truncate"
            else "sha256 differs from the manifest"
        )
        assert why in last and "Re-running the pipeline rebuilds 'ingest'" in last
        assert not (sft.out_dir / "config.json").exists()
        # What the flow's launcher does with the parent next: it no longer verifies, so its
        # manifest is dropped and the stage runs again.
        assert not verify(ingest)[0]
    finally:
        shutil.copy(saved, weights)
    assert verify(ingest)[0]


def _ref(folder: Path):
    return ref_from_manifest(folder)


@pytest.mark.parametrize(("umask", "file_mode"), [(0o022, 0o644), (0o002, 0o664)])
def test_stage_files_honour_the_umask(tmp_path: Path, umask: int, file_mode: int) -> None:
    """Every file a real stage leaves (weights, tokenizer, manifest, spec, heartbeat, lock) gets
    0666 less the umask, and every folder 0777 less it: a group sharing the workspace under
    umask 002 can read (and lock) all of it, the manifest included."""
    old = os.umask(umask)
    try:
        recipe = write_recipe(tmp_path, _tiny(pretrain_steps=2))
        out = run_inprocess("ingest", recipe)
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()] + [lock_path(out)]
    assert {out / "manifest.json", out / "logs" / "spec.json"} <= set(files)
    modes = {str(p.relative_to(out.parent)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert set(modes.values()) == {oct(file_mode)}, modes
    dirs = [out, *(p for p in out.rglob("*") if p.is_dir())]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {oct(0o777 & ~umask)}
    assert json.loads((out / "manifest.json").read_text())["stage"] == "ingest"
