"""Build huggingface_hub cache layouts by hand, exactly as the library writes them, so tests
can resolve hub ids offline through the real huggingface_hub / datasets code.

    <cache>/<models|datasets>--<org>--<name>/
        blobs/<sha256 of the file>                       the content, once
        snapshots/<commit sha>/<path in repo>  ->  ../../blobs/<hash>   (relative symlinks)
        refs/<branch or tag>                             the commit sha, no newline
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from posttrain.config.extends import read_recipe
from posttrain.hub import is_hub_id


def commit_sha(label: str) -> str:
    """A 40-hex commit id (a fake but well-formed git sha)."""
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes | Path],
    sha: str,
    refs: tuple[str, ...] = ("main",),
    repo_type: str = "model",
) -> Path:
    """Add commit `sha` holding `files` (repo path -> bytes, or a local file to copy) and point
    `refs` at it. Returns the snapshot folder."""
    repo = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / sha
    for rel, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return snap


def folder_files(folder: Path) -> dict[str, Path]:
    """{path in repo: file} of a local folder, for add_snapshot."""
    return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}


def cache_recipe_hub_ids(path: Path, cache: Path) -> None:
    """A recipe's hub ids resolve at load time: give each a snapshot in a local hub cache (the
    real layout; nothing is downloaded here), as `hf download` would have left it."""
    data, _ = read_recipe(path)  # with what it extends
    ids = {(data.get("ingest", {}).get("path"), "model")}
    for section in data.values():
        source = section.get("data", {}) if isinstance(section, dict) else {}
        ids |= {(source.get(k), "dataset") for k in ("path", "eval_path")}
    for repo, kind in ids:
        if is_hub_id(repo):
            add_snapshot(cache, repo, {"README.md": b"x"}, commit_sha(repo), repo_type=kind)
