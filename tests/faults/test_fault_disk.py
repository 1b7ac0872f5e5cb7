"""A full disk is a verdict, not a crash, and costs nothing already written: real checkpoints and
a real export written onto a real small filesystem (a tmpfs mounted for the test) that is full
before the write starts, or fills while it runs.

Fast tier (a few seconds). The same through a whole stage and its POSTTRAIN_ERROR line:
test_fault_stages.py (slow)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.distributed.runtime import init_distributed, shutdown
from posttrain.runtime.diskspace import DiskFull, as_disk_full, model_bytes
from posttrain.stages.export import _save_with_room
from posttrain.train.checkpoint import complete_checkpoints, save_checkpoint
from posttrain.train.resume import inspect_checkpoint
from tests.faults.fault_injection import (
    InjectedDisk,
    SmallDisk,
    disk_filled_when_dcp_writes,
    disk_for_test,
    skip_without_tmpfs,
)
from tests.faults.fault_trainer import Trainer
from tests.fixtures_tiny import load_base, tiny_assets


@pytest.fixture
def disk(tmp_path: Path, monkeypatch) -> Iterator[SmallDisk]:
    with disk_for_test(tmp_path / "disk", 40, monkeypatch) as d:
        yield d


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    d = init_distributed("cpu", 60, 1)
    try:
        yield Trainer(d.mesh)
    finally:
        shutdown()


def _only_intact(root: Path, step: int) -> None:
    """The last good checkpoint is there, intact, and nothing half-written beside it."""
    assert [p.name for p in root.iterdir()] == [f"step_{step:07d}"]
    assert inspect_checkpoint(root / f"step_{step:07d}") == (True, [])


def test_checkpoint_refused_before_writing_when_the_disk_is_short(
    disk: SmallDisk, trainer: Trainer
) -> None:
    root = disk.mount / "checkpoints"
    trainer.step()
    save_checkpoint(root, 1, trainer.model, trainer.opt, trainer.sched, keep=2)
    disk.fill(leave=1 << 20)
    trainer.step()
    with pytest.raises(DiskFull) as err:
        save_checkpoint(root, 2, trainer.model, trainer.opt, trainer.sched, keep=2)
    text = str(err.value)
    assert f"checkpoint step_0000002 in {root}" in text
    assert f"({err.value.needed} bytes)" in text and f"({err.value.free} bytes) free" in text
    assert err.value.free < err.value.needed
    assert "keep_checkpoints" in text and "run.workspace" in text
    _only_intact(root, 1)
    disk.free_up()  # space freed: the same save goes through
    save_checkpoint(root, 2, trainer.model, trainer.opt, trainer.sched, keep=2)
    assert [p.name for p in complete_checkpoints(root)] == ["step_0000001", "step_0000002"]


def test_disk_filling_during_the_save_removes_the_partial_and_keeps_the_last(
    disk: SmallDisk, trainer: Trainer
) -> None:
    root = disk.mount / "checkpoints"
    trainer.step()
    save_checkpoint(root, 1, trainer.model, trainer.opt, trainer.sched, keep=2)
    trainer.step()
    with disk_filled_when_dcp_writes(disk), pytest.raises(DiskFull) as err:
        save_checkpoint(root, 2, trainer.model, trainer.opt, trainer.sched, keep=2)
    text = str(err.value)
    assert "the disk filled while writing it" in text and "No space left on device" in text
    assert "no partial checkpoint is left" in text
    _only_intact(root, 1)  # step_0000002.tmp is gone: its space is back
    disk.free_up()
    save_checkpoint(root, 2, trainer.model, trainer.opt, trainer.sched, keep=2)
    assert inspect_checkpoint(root / "step_0000002") == (True, [])


def test_enospc_deep_in_an_exception_chain_becomes_the_verdict() -> None:
    """What stage_main does with an ENOSPC from anywhere (a json write, save_pretrained)."""
    import errno

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/ws/artifacts/sft/x/m.json")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as exc:
        verdict = as_disk_full(exc, "stage sft's output")
    assert isinstance(verdict, DiskFull) and verdict.path == Path("/ws/artifacts/sft/x/m.json")
    assert "No space left on device" in str(verdict) and "run.workspace" in str(verdict)
    assert as_disk_full(RuntimeError("other")) is None


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return tiny_assets(tmp_path_factory)


def test_export_refused_before_writing_and_cleaned_up_when_the_disk_fills(
    disk: SmallDisk, assets
) -> None:
    model, out = load_base(assets), disk.mount / "export" / "model"
    out.parent.mkdir()
    disk.fill(leave=1 << 20)
    with pytest.raises(DiskFull) as err:
        _save_with_room(model, assets.tokenizer, out)
    assert f"the exported model (model/) in {out.parent}" in str(err.value)
    assert not out.exists()
    disk.free_up()

    real_save = model.save_pretrained

    def save_while_the_disk_fills(*args, **kwargs):
        disk.fill(0)
        return real_save(*args, **kwargs)

    if isinstance(disk, InjectedDisk):
        skip_without_tmpfs("no tmpfs here: the fallback cannot fill safetensors' own writes")
    model.save_pretrained = save_while_the_disk_fills
    with pytest.raises(DiskFull) as err:
        _save_with_room(model, assets.tokenizer, out)
    assert "the partial model/ was removed" in str(err.value)
    assert not out.exists()
    disk.free_up()
    model.save_pretrained = real_save
    _save_with_room(model, assets.tokenizer, out)
    weights = out / "model.safetensors"
    # The estimate is the weights' bytes: the file is those plus its JSON header.
    assert 0 < weights.stat().st_size - model_bytes(model) < 64 << 10
