"""The one answer to "is this artifact complete, and may it be reused" (posttrain.store.status)
and the cache built on it (posttrain.store.cache)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from posttrain.store.artifacts import MANIFEST, stage_dir, write_manifest
from posttrain.store.cache import cached
from posttrain.store.status import find_reusable, status

FP = "0123456789abcdef"


def _artifact(ws: Path, fp: str = FP, manifest_fp: str = FP) -> Path:
    out = stage_dir(ws, "sft", fp)
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "weights.bin").write_bytes(bytes(range(256)) * 4)
    (out / "checkpoints").mkdir()  # not sealed: resume state
    write_manifest(out, stage="sft", fp=manifest_fp, parents=["p"], section={}, seed=0, summary={})
    return out


def test_the_states_of_an_artifact_folder(tmp_path: Path) -> None:
    out = stage_dir(tmp_path, "sft", FP)
    assert status(out, FP, hashes=True).state == "missing"
    (out / "adapter").mkdir(parents=True)
    unsealed = status(out, FP, hashes=True)
    assert unsealed.state == "unsealed" and unsealed.ref is None and not unsealed.complete
    assert "started, never sealed" in unsealed.why
    out = _artifact(tmp_path / "ws")
    for hashes in (False, True):
        look = status(out, FP, hashes=hashes)
        assert look.complete and look.why == "" and look.ref is not None
        assert look.ref.fingerprint == FP and look.ref.parents == ["p"]
        # Only a look that read every byte says the artifact may be handed on.
        assert look.reusable is hashes
    (out / "checkpoints" / "step_1").write_text("resume state changes freely")
    assert status(out, FP, hashes=True).reusable


def test_altered_files_and_another_fingerprint_are_invalid(tmp_path: Path) -> None:
    out = _artifact(tmp_path)
    weights = out / "adapter" / "weights.bin"
    weights.write_bytes(bytes(1024))  # same size, other bytes: only hashing sees it
    assert status(out, FP, hashes=False).complete
    look = status(out, FP, hashes=True)
    assert (look.state, look.why) == (
        "invalid",
        "adapter/weights.bin was altered (sha256 differs from the manifest)",
    )
    weights.write_bytes(b"short")
    assert status(out, FP, hashes=False).why == (
        "adapter/weights.bin was altered (5 bytes, the manifest says 1024)"
    )
    other = _artifact(tmp_path / "other", manifest_fp="fedcba9876543210")
    look = status(other, FP, hashes=False)
    assert look.state == "invalid" and look.ref is None
    assert look.why == f"its manifest names fingerprint fedcba9876543210, the plan {FP}"
    assert (other / MANIFEST).exists() and (out / MANIFEST).exists(), "it changes no folder"
    (other / MANIFEST).write_text("{}")  # another version's manifest: invalid, not a crash
    assert status(other, FP, hashes=True).why == "its manifest has no 'stage'"


def test_the_supervisors_look_drops_an_invalid_manifest_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = _artifact(tmp_path)
    ref = find_reusable(out, FP)
    assert ref is not None and ref.fingerprint == FP
    assert find_reusable(out, "fedcba9876543210") is None  # another plan's: not reused...
    assert not (out / MANIFEST).exists()  # ...and no longer looks complete
    assert "removing its manifest and re-running" in caplog.text
    assert (out / "adapter" / "weights.bin").exists(), "the rest stays for the re-run"
    caplog.clear()
    assert find_reusable(out, FP) is None and caplog.text == ""  # unsealed: nothing to drop


class Counted:
    """A value computed on a miss, counting how often it was."""

    def __init__(self, value: list[int]) -> None:
        self.value, self.calls = value, 0

    def compute(self) -> list[int]:
        self.calls += 1
        return list(self.value)


def _save(value: list[int], folder: Path) -> None:
    (folder / "table.json").write_text(json.dumps(value))


def _load(folder: Path) -> list[int]:
    return json.loads((folder / "table.json").read_text())


def _cached(folder: Path, table: Counted) -> tuple[list[int], bool]:
    return cached(
        folder, table.compute, _save, _load, parents=["sft1"], inputs={"n": 3}, writer=True
    )


def test_a_cache_miss_computes_and_seals_a_hit_reads_what_it_computed(tmp_path: Path) -> None:
    folder, table = stage_dir(tmp_path, "ref_logps", "key1"), Counted([1, 2, 3])
    assert _cached(folder, table) == ([1, 2, 3], False) and table.calls == 1
    look = status(folder, "key1", hashes=True)
    assert look.reusable and look.ref is not None and look.ref.parents == ["sft1"]
    assert look.ref.stage == "ref_logps"
    assert [p.name for p in folder.parent.iterdir()] == ["key1"], "no temporary folder is left"
    assert _cached(folder, table) == ([1, 2, 3], True) and table.calls == 1


def test_a_damaged_cache_entry_is_said_and_computed_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder, table = stage_dir(tmp_path, "teacher_answers", "key2"), Counted([4, 5])
    _cached(folder, table)
    (folder / "table.json").write_text("[4, 6]")  # same size, other bytes
    caplog.set_level(logging.WARNING, logger="posttrain.cache")
    assert _cached(folder, table) == ([4, 5], False) and table.calls == 2
    assert f"cache entry {folder} is damaged (table.json was altered" in caplog.text
    assert _load(folder) == [4, 5] and status(folder, "key2", hashes=True).reusable
    assert [p.name for p in folder.parent.iterdir()] == ["key2"], "the damaged one is gone"


def test_only_the_writer_publishes_and_every_rank_waits_for_it(tmp_path: Path) -> None:
    folder, waits = stage_dir(tmp_path, "ref_logps", "key3"), []
    value, hit = cached(
        folder, lambda: [7], _save, _load, parents=[], inputs={}, writer=False,
        barrier=lambda: waits.append(1),
    )  # fmt: skip
    assert (value, hit, waits) == ([7], False, [1]) and not folder.exists()
