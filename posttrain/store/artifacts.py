"""Artifact store: fingerprints, stage folders, manifests written last and atomically.

Layout: `<workspace>/artifacts/<stage>/<fingerprint>/` holds a stage's files, `metrics.jsonl`,
`config.json` and, written LAST, `manifest.json`. No manifest means the stage is not done.
Stages hand each other `ArtifactRef`s (a few hundred bytes), never weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from posttrain import jsonsafe
from posttrain.secrets import redact_obj

MANIFEST = "manifest.json"
# Not covered by the manifest: transient resume state, logs that a re-run appends to, and the
# policy versions a rollout server loads (`posttrain.serving.weights`; removed when the stage
# ends, but a killed stage leaves them, with links to the base's weights).
UNHASHED_DIRS = ("checkpoints", "logs", "serving")
FINGERPRINT_LEN = 16


class ArtifactRef(BaseModel):
    """What one stage hands the next: where its output is and what it was made from."""

    stage: str = Field(description="Stage that produced the artifact.")
    uri: str = Field(description="Absolute path of the stage output folder.")
    fingerprint: str = Field(description="Hash of stage, code version, recipe section and parents.")
    sha256: str = Field(description="sha256 of the manifest's file table (content identity).")
    parents: list[str] = Field(default_factory=list, description="Fingerprints of the inputs.")

    @property
    def path(self) -> Path:
        return Path(self.uri)


def canonical_json(obj: Any) -> str:
    return jsonsafe.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(kind: str, code_version: str, inputs: Any, parents: dict[str, str]) -> str:
    """Hash of everything that determines a stage's output: its kind and the kind's code
    version, its inputs (`posttrain.plan.fingerprints.stage_inputs`: the result fields of what it
    reads and the identity of the outside inputs they name) and its parents' fingerprints by
    role."""
    payload = canonical_json(
        {"kind": kind, "version": code_version, "inputs": inputs, "parents": parents}
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:FINGERPRINT_LEN]


def stage_dir(workspace: str | os.PathLike[str], stage: str, fp: str) -> Path:
    return Path(workspace) / "artifacts" / stage / fp


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def path_identity(path: str | os.PathLike[str], hash_limit: int = 64 << 20) -> dict[str, Any]:
    """Content identity of a file or folder for fingerprints.

    Files up to `hash_limit` bytes are hashed; larger ones (weights) are identified by size and
    mtime, which is what changes when a checkpoint is replaced, without hashing gigabytes on
    every plan.
    """
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for f in files:
        st = f.stat()
        rel = f.name if f == root else str(f.relative_to(root))
        out[rel] = sha256_file(f) if st.st_size <= hash_limit else f"{st.st_size}:{st.st_mtime_ns}"
    return out


def _hashed_files(folder: Path) -> list[Path]:
    out = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        skip = rel.parts[0] in UNHASHED_DIRS or str(rel) == MANIFEST or rel.name.startswith(".tmp")
        if p.is_file() and not skip:
            out.append(p)
    return out


def file_table(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in _hashed_files(folder)
    }


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the kernel says it (Linux 4.7+:
    /proc/self/status); else set and restored under a lock (a file created by another thread in
    between would get mode 0666)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temp file in the same folder, fsync, rename over `path`, fsync the folder.

    The file gets the mode a plain `open(path, "w")` would (0666 less the umask): mkstemp
    creates 0600, which on a shared workspace hid manifests and specs from the group that can
    read every other artifact file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def environment_info() -> dict[str, Any]:
    """Library versions and host facts recorded in every manifest."""
    versions = {"python": sys.version.split()[0]}
    for name in (
        "torch",
        "transformers",
        "peft",
        "datasets",
        "accelerate",
        "safetensors",
        "tokenizers",
    ):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    device: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        device["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"versions": versions, "device": device}


def honour_umask(folder: Path) -> list[Path]:
    """Give every file under `folder` the mode `open()` would have (0666 less the umask; 0777
    less it for executables); returns the files changed. safetensors (0.8) writes through a
    0600 temporary file, so weights and adapters came out unreadable to the group that shares
    the workspace while the rest of the artifact was readable. Files this process cannot chmod
    (another user's) are left as they are."""
    mask, changed = current_umask(), []
    for p in folder.rglob("*"):
        if not p.is_file() or p.is_symlink():
            continue
        mode = stat.S_IMODE(p.stat().st_mode)
        want = (0o777 if mode & 0o111 else 0o666) & ~mask
        if mode != want:
            with contextlib.suppress(PermissionError):
                os.chmod(p, want)
                changed.append(p)
    return changed


def write_manifest(
    folder: Path,
    *,
    stage: str,
    fp: str,
    parents: list[str],
    section: Any,
    seed: int,
    summary: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> ArtifactRef:
    """Hash every file in `folder` and write `manifest.json` last, atomically. Returns the ref.
    File modes are made to follow the umask first (`honour_umask`)."""
    honour_umask(folder)
    files = file_table(folder)
    content_sha = hashlib.sha256(canonical_json(files).encode()).hexdigest()
    manifest = {
        "stage": stage,
        "fingerprint": fp,
        "parents": parents,
        "files": files,
        "content_sha256": content_sha,
        "section": section,
        "seed": seed,
        "summary": summary,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **environment_info(),
        **(extra or {}),
    }
    # Last line of defence against leaking a credential (an error message, an environment value
    # or a path in a summary) into a file every later stage, report and copy of the workspace
    # carries. The file table stays verbatim: verification compares its names with the folder.
    manifest = {k: v if k == "files" else redact_obj(v, k) for k, v in manifest.items()}
    atomic_write_text(folder / MANIFEST, jsonsafe.dumps(manifest, indent=2, default=str))
    return ArtifactRef(
        stage=stage, uri=str(folder), fingerprint=fp, sha256=content_sha, parents=parents
    )


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def verify(folder: Path, hashes: bool = True) -> tuple[bool, str]:
    """Is `folder` a complete, unaltered artifact? Returns (ok, reason when not). `hashes=False`
    checks presence and sizes only (a stat per file instead of reading every byte)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return False, f"no readable {MANIFEST} in {folder}"
    for rel, meta in manifest.get("files", {}).items():
        p = folder / rel
        if not p.is_file():
            return False, f"{rel} is missing"
        if (size := p.stat().st_size) != meta["bytes"]:
            return False, f"{rel} was altered ({size} bytes, the manifest says {meta['bytes']})"
        if hashes and sha256_file(p) != meta["sha256"]:
            return False, f"{rel} was altered (sha256 differs from the manifest)"
    return True, ""


def ref_from_manifest(folder: Path) -> ArtifactRef:
    m = read_manifest(folder)
    if m is None:
        raise FileNotFoundError(f"no {MANIFEST} in {folder}")
    return ArtifactRef(
        stage=m["stage"],
        uri=str(folder),
        fingerprint=m["fingerprint"],
        sha256=m["content_sha256"],
        parents=m["parents"],
    )
