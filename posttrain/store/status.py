"""Whether an artifact is complete and whether it may be reused: the one answer, `status`.

Complete: its sealed manifest is there, names the fingerprint asked for, and lists files that
are all there as it says. `hashes=False` checks their sizes, a stat per file: the cheap look
of whoever checks again before building on it (selection, `plan`, `clean`, the device wait).
`hashes=True` reads every byte too, and only then is the artifact `reusable`: what a supervisor
hands on instead of launching, and a cache hit. `status` never changes the folder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from posttrain.store.artifacts import MANIFEST, ArtifactRef, ref_from_manifest, verify

# missing: no folder; unsealed: no manifest (started, never finished); invalid: a manifest its
# files or the fingerprint asked for contradict; complete.
State = Literal["missing", "unsealed", "invalid", "complete"]


@dataclass(frozen=True)
class Status:
    state: State
    why: str = ""  # why it is not complete
    ref: ArtifactRef | None = None  # when complete
    hashed: bool = False  # every byte was checked

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    @property
    def reusable(self) -> bool:
        return self.complete and self.hashed


def status(out_dir: Path, fingerprint: str, *, hashes: bool) -> Status:
    """The state of the artifact in `out_dir` against `fingerprint` (module docstring)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return Status("missing", f"{out_dir} does not exist")
    if not (out_dir / MANIFEST).exists():
        return Status("unsealed", f"no {MANIFEST} in {out_dir}: started, never sealed")
    ok, why = verify(out_dir, hashes=hashes)
    if not ok:
        return Status("invalid", why)
    try:
        ref = ref_from_manifest(out_dir)
    except KeyError as exc:  # another version's manifest, or one edited by hand
        return Status("invalid", f"its manifest has no {exc}")
    if ref.fingerprint != fingerprint:
        why = f"its manifest names fingerprint {ref.fingerprint}, the plan {fingerprint}"
        return Status("invalid", why)
    return Status("complete", ref=ref, hashed=hashes)


def find_reusable(
    out_dir: Path, fingerprint: str, log: logging.Logger | logging.LoggerAdapter | None = None
) -> ArtifactRef | None:
    """A supervisor's one look, under the artifact's lock: its ref when reusable; else None,
    after removing a manifest that no longer verifies, so that an altered artifact never looks
    complete while, or if, the re-run goes on (its other files, checkpoints included, stay for
    the re-run to resume from)."""
    look = status(out_dir, fingerprint, hashes=True)
    if look.state == "invalid":
        (log or logging.getLogger("posttrain.lock")).warning(
            "artifact in %s is not valid (%s): removing its manifest and re-running",
            out_dir,
            look.why,
        )
        (Path(out_dir) / MANIFEST).unlink(missing_ok=True)
    return look.ref if look.reusable else None
