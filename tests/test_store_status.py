"""The one answer to "is this artifact complete, and may it be reused" (posttrain.store.status)."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.store.artifacts import MANIFEST, stage_dir, write_manifest
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
    assert (other / MANIFEST).exists() and (out / MANIFEST).exists(), (
        "status never changes a folder"
    )


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
