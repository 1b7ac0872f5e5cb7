"""Damaged checkpoints never block a resume: real DCP checkpoints of a real tiny LoRA model in a
real (one-rank) process group, damaged on disk the way files get damaged, then resumed.

Fast tier: a few seconds in all. The whole-stage versions (a real SFT resumed from an older
checkpoint ends bit-exact) are in test_fault_stages.py (slow)."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.errors import NoIntactCheckpoint
from posttrain.train.checkpoint import (
    complete_checkpoints,
    damaged_checkpoints,
    save_checkpoint,
)
from posttrain.train.integrity import INTEGRITY, read_record
from posttrain.train.resume import inspect_checkpoint, resume_newest_intact
from tests.faults.fault_injection import flip_bytes, largest_shard, truncate
from tests.faults.fault_trainer import Trainer


@pytest.fixture
def dist_mesh() -> Iterator:
    d = init_distributed("cpu", 60, 1)
    try:
        yield d.mesh
    finally:
        shutdown()


@pytest.fixture
def three(tmp_path: Path, dist_mesh) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """Checkpoints at steps 1, 2, 3 of one run and the weights each holds."""
    t = Trainer(dist_mesh)
    saved = {}
    for step in (1, 2, 3):
        t.step()
        save_checkpoint(tmp_path, step, t.model, t.opt, t.sched, keep=3)
        saved[step] = t.weights()
    return tmp_path, saved


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_integrity_record_covers_every_file_it_wrote(three) -> None:
    root, _ = three
    for ckpt in complete_checkpoints(root):
        files = read_record(ckpt)
        on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()}
        assert set(files) == on_disk - {INTEGRITY}
        assert {"meta.json", ".metadata", "rng_rank0.pt"} <= set(files)
        assert all((ckpt / n).stat().st_size == m["bytes"] for n, m in files.items())
        assert inspect_checkpoint(ckpt) == (True, [])


def _delete(p: Path) -> None:
    p.unlink()


def _garble_json(p: Path) -> None:
    p.write_text(p.read_text()[:-20])


DAMAGE: dict[str, tuple[Callable[[Path], Path], Callable[[Path], None], str]] = {
    "truncated shard": (largest_shard, truncate, "bytes, {} expected"),
    "flipped bytes": (largest_shard, flip_bytes, "sha256 differs"),
    "deleted shard": (largest_shard, _delete, "missing"),
    "deleted rng file": (lambda c: c / "rng_rank0.pt", _delete, "missing"),
    "meta.json garbled": (lambda c: c / "meta.json", _garble_json, "meta.json unreadable"),
    "integrity.json garbled": (lambda c: c / INTEGRITY, _garble_json, "integrity.json unreadable"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_falls_back_to_the_older_intact_one(
    three, dist_mesh, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, saved = three
    newest = complete_checkpoints(root)[-1]
    pick, hurt, expect = DAMAGE[damage]
    victim = pick(newest)
    size = victim.stat().st_size
    hurt(victim)

    fresh = Trainer(dist_mesh)
    with caplog.at_level(logging.WARNING, logger="posttrain.train"):
        point = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched, where="stage sft")
    assert point.path == root / "step_0000002" and point.meta["step"] == 2 and point.verified
    assert _same(fresh.weights(), saved[2])
    assert fresh.sched.last_epoch == 2
    # The warning names the checkpoint, the file and what is wrong with it.
    warning = next(r.getMessage() for r in caplog.records if "is damaged" in r.getMessage())
    assert str(newest) in warning and victim.name in warning
    assert expect.format(size) in warning, warning
    # Moved aside, kept, and out of the way of the next resume and of retention.
    assert [p.name for p in damaged_checkpoints(root)] == ["step_0000003.damaged"]
    assert [p.name for p in complete_checkpoints(root)] == ["step_0000001", "step_0000002"]
    record = point.record()
    assert record["checkpoint"] == "step_0000002" and record["start_step"] == 2
    assert record["rejected"][0]["checkpoint"] == "step_0000003"
    assert record["rejected"][0]["moved_to"] == "step_0000003.damaged"
    assert any(victim.name in p for p in record["rejected"][0]["problems"])


def test_checkpoint_of_an_earlier_version_resumes_unverified(
    three, dist_mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """No integrity.json (written before it existed): sizes cannot be checked, the load is."""
    root, saved = three
    for ckpt in complete_checkpoints(root):
        (ckpt / INTEGRITY).unlink()
    fresh = Trainer(dist_mesh)
    with caplog.at_level(logging.WARNING, logger="posttrain.train"):
        point = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched)
    assert point.path == root / "step_0000003" and not point.verified
    assert _same(fresh.weights(), saved[3])
    assert "unverified" in caplog.text
    assert point.record() == {
        "checkpoint": "step_0000003",
        "start_step": 3,
        "verified": False,
        "restarted": False,
        "rejected": [],
        "check_s": point.record()["check_s"],
    }


def test_unverifiable_checkpoint_that_fails_to_load_falls_back_and_leaves_no_trace(
    three, dist_mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """An old-format checkpoint with a truncated shard passes the (impossible) size check but
    fails in DCP: named as damaged, and the older one is loaded into a model the failed read
    did not touch."""
    root, saved = three
    newest = complete_checkpoints(root)[-1]
    (newest / INTEGRITY).unlink()
    truncate(largest_shard(newest))
    fresh = Trainer(dist_mesh)
    with caplog.at_level(logging.WARNING, logger="posttrain.train"):
        point = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched)
    assert point.path == root / "step_0000002"
    assert _same(fresh.weights(), saved[2])
    problem = point.rejected[0]["problems"][0]
    assert problem.startswith("could not be loaded on rank 0: ") and "Error" in problem, problem
    assert "step_0000003" in caplog.text and "could not be loaded" in caplog.text


def _damage_all(root: Path, old_format: bool = False) -> list[str]:
    names = []
    for ckpt in complete_checkpoints(root):
        shard = largest_shard(ckpt)
        truncate(shard)
        if old_format:  # no record: only the load itself finds the damage
            (ckpt / INTEGRITY).unlink()
        names.append(f"{ckpt.name}: {shard.name}")
    return names


@pytest.mark.parametrize("old_format", [False, True], ids=["recorded", "old-format"])
def test_all_damaged_restarts_from_step_zero_like_a_fresh_run(
    three, dist_mesh, old_format: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With integrity records the damage is found by stat; without, by three failed loads, each
    of which must leave no trace (a half-read shard in the weights, an initialised optimizer)."""
    root, _ = three
    _damage_all(root, old_format)
    # A fresh trainer and its twin: the one that went through the failed resume must be in
    # exactly the state of one that never saw a checkpoint (weights, optimizer, RNG).
    fresh = Trainer(dist_mesh)
    rng = torch.get_rng_state()
    twin = Trainer(dist_mesh)
    torch.set_rng_state(rng)
    with caplog.at_level(logging.WARNING, logger="posttrain.train"):
        point = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched, on_none="restart")
    assert point.path is None and point.restarted and point.meta == {}
    assert "restarting from step 0" in caplog.text
    assert _same(fresh.weights(), twin.weights()) and not fresh.opt.state
    assert torch.equal(torch.get_rng_state(), rng)
    assert [r["checkpoint"] for r in point.record()["rejected"]] == [
        "step_0000003",
        "step_0000002",
        "step_0000001",
    ]
    assert complete_checkpoints(root) == [] and len(damaged_checkpoints(root)) == 3
    # The next resume finds nothing to trip over.
    again = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched)
    assert again.path is None and again.record() is None


def test_all_damaged_with_fail_names_every_damaged_file(three, dist_mesh) -> None:
    root, _ = three
    damaged = _damage_all(root)
    fresh = Trainer(dist_mesh)
    with pytest.raises(NoIntactCheckpoint) as err:
        resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched, on_none="fail")
    text = str(err.value)
    assert "\n" not in text, "one line: it becomes the stage's POSTTRAIN_ERROR line"
    for entry in damaged:
        ckpt, shard = entry.split(": ")
        assert ckpt in text and shard in text
    assert "infra.no_intact_checkpoint=restart" in text
    # Left in place: `fail` means a person decides.
    assert len(complete_checkpoints(root)) == 3 and damaged_checkpoints(root) == []


def test_partial_save_left_by_a_kill_is_swept_at_resume(three, dist_mesh) -> None:
    root, _ = three
    partial = root / "step_0000004.tmp"
    shutil.copytree(root / "step_0000003", partial)
    fresh = Trainer(dist_mesh)
    point = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched)
    assert point.path == root / "step_0000003" and not partial.exists()


def test_resume_record_is_absent_when_all_is_well(three, dist_mesh) -> None:
    root, _ = three
    fresh = Trainer(dist_mesh)
    point = resume_newest_intact(root, fresh.model, fresh.opt, fresh.sched)
    assert point.verified and point.record() is None
    meta = json.loads((point.path / "meta.json").read_text())
    assert meta["step"] == 3
