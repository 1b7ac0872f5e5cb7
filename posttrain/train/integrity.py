"""What a checkpoint wrote, recorded at save and checked before a resume trusts it.

`integrity.json` in a checkpoint folder lists every other file of the folder (DCP shards and
`.metadata`, `rng_rank<r>.pt`, `meta.json`) with its size and sha256:
`{"algorithm": "sha256", "files": {"__0_0.distcp": {"bytes": 123, "sha256": "..."}, ...}}`.
It is written after the files it lists and before the folder's atomic rename, so a complete
checkpoint always has it; checkpoints written before this record existed lack it and are
resumed "unverified" (their load is still checked).

Hashing is split across ranks (file i goes to rank i % world), so a save or a resume check costs
about bytes / (world x ~1.6 GB/s) on this machine's cores (sha256 with SHA extensions).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.store.artifacts import sha256_file

INTEGRITY = "integrity.json"
ALGORITHM = "sha256"
META = "meta.json"


def listing(folder: Path) -> list[str]:
    """Relative paths of the files a checkpoint's record covers, sorted (the same on every rank)."""
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != INTEGRITY
    )


def my_share(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "sha256"}} for `names` in `folder`."""
    return {
        n: {"bytes": (folder / n).stat().st_size, "sha256": sha256_file(folder / n)} for n in names
    }


def write_record(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    # A plain write: the folder's rename, which comes after, is what makes the checkpoint count.
    record = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    (folder / INTEGRITY).write_text(json.dumps(record, indent=1))


def read_record(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The recorded file table; None for a checkpoint written without one. Raises ValueError
    when the record is there but unreadable (that checkpoint is damaged)."""
    path = folder / INTEGRITY
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        files = record["files"]
        if record.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown layout (algorithm {record.get('algorithm')!r})")
        for meta in files.values():
            int(meta["bytes"]), str(meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{INTEGRITY} unreadable ({type(exc).__name__}: {exc})") from exc
    return files


def check_sizes(folder: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Problems found by stat alone: missing files, sizes that differ from the record."""
    problems = []
    for name, meta in files.items():
        p = folder / name
        if not p.is_file():
            problems.append(f"{name}: missing")
        elif (size := p.stat().st_size) != meta["bytes"]:
            problems.append(f"{name}: {size} bytes, {meta['bytes']} expected (written at save)")
    return problems


def check_hashes(folder: Path, files: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """Problems among `names` (this rank's share) that only the content shows."""
    problems = []
    for name in names:
        p, meta = folder / name, files[name]
        if p.is_file() and p.stat().st_size == meta["bytes"] and sha256_file(p) != meta["sha256"]:
            problems.append(f"{name}: sha256 differs from the one recorded at save")
    return problems


def check_meta(folder: Path) -> list[str]:
    """meta.json must parse and name its step: without it nothing can be resumed."""
    try:
        meta = json.loads((folder / META).read_text())
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return [f"{META} unreadable ({type(exc).__name__}: {exc})"]
    return []
