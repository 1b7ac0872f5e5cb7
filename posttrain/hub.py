"""Hub ids (`org/name`) for models and datasets, resolved through huggingface_hub's cache.

A recipe names a model or dataset either by a local path or by a hub id plus a revision (branch,
tag or commit). The revision is resolved to a commit sha, which is what fingerprints and
manifests record: `main` moving to a new commit is a new run, the same commit is the same run.

Online or offline follows huggingface_hub's own switch: `HF_HUB_OFFLINE=1` reads the cache only
(tests, CI and air-gapped machines set it: without a network each hub lookup costs ~47 s of
retries); unset, a missing snapshot is downloaded. The flow passes the supervisor's setting on to
its stage processes. Offline, ids resolve from the cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`); online, snapshot_download fetches what is missing. Light on purpose
(no torch): the plan calls `resolve_sha` to fingerprint.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RepoType = Literal["model", "dataset"]

# org/name as the hub spells them: letters, digits, `-`, `_`, `.`; no `..`, no leading `.`/`-`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_SHA = re.compile(r"^[0-9a-f]{40}$")
# A missing local data file must stay "no such file", not become a hub lookup.
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt", ".safetensors")


class HubError(ValueError):
    """A hub id that cannot be resolved; the message says what, where, and whether offline."""


@dataclass(frozen=True)
class HubSnapshot:
    repo_id: str
    revision: str  # as the recipe gave it
    commit_sha: str
    folder: Path  # snapshots/<commit_sha> in the cache

    def record(self) -> dict[str, str]:
        """What manifests and summaries carry."""
        return {"hub_repo": self.repo_id, "revision": self.revision, "commit_sha": self.commit_sha}


# (repo_type, repo_id, revision) -> the commit the plan fingerprinted; set in a stage process
# from its spec (`pin`), so every read there is of exactly that commit.
_PINS: dict[tuple[str, str, str], str] = {}


def pin(records: Iterable[dict[str, str]]) -> None:
    """Pin hub ids to the commits the plan resolved (`pipeline.hub_record` dicts)."""
    for r in records:
        _PINS[(r["repo_type"], r["hub_repo"], r["revision"])] = r["commit_sha"]


def is_hub_id(value: str | None, base: Path | None = None) -> bool:
    """`org/name` that is not an existing local path (nor a missing data file's name), relative
    to `base` (the recipe's folder; default the current directory)."""
    if not value or not _HUB_ID.match(value) or ".." in value:
        return False
    if value.lower().endswith(_FILE_SUFFIXES):
        return False
    return not (Path(base or ".") / Path(value).expanduser()).exists()


def offline() -> bool:
    """True when HF_HUB_OFFLINE is set to 1/true/yes/on (huggingface_hub's convention)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """huggingface_hub's cache folder, read from the environment now (its own constant is read
    once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def _where(repo_id: str, revision: str, repo_type: RepoType) -> str:
    return (
        f"{repo_type} {repo_id!r} at revision {revision!r} (cache {cache_dir()}, "
        f"HF_HUB_OFFLINE={'on' if offline() else 'off'})"
    )


def _repo_folder(repo_id: str, repo_type: RepoType) -> Path:
    return cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"


def _cached_sha(repo_id: str, revision: str, repo_type: RepoType) -> str | None:
    """The commit a revision names in the cache: a full sha with a snapshot folder, or the
    sha in refs/<revision> (branches and tags; huggingface_hub writes one per resolved ref)."""
    folder = _repo_folder(repo_id, repo_type)
    if _SHA.match(revision):
        return revision if (folder / "snapshots" / revision).is_dir() else None
    ref = folder / "refs" / revision
    if ref.is_file():
        sha = ref.read_text().strip()
        if (folder / "snapshots" / sha).is_dir():
            return sha
    return None


def cached_snapshot(repo_id: str, revision: str, repo_type: RepoType = "model") -> Path | None:
    """The cache's snapshot folder of `repo_id` at `revision`, never the network; None when the
    cache does not hold it."""
    sha = _cached_sha(repo_id, revision, repo_type)
    return None if sha is None else _repo_folder(repo_id, repo_type) / "snapshots" / sha


def _missing(repo_id: str, revision: str, repo_type: RepoType, why: str) -> HubError:
    folder = _repo_folder(repo_id, repo_type)
    if not folder.is_dir():
        what = f"not in the cache (no {folder.name})"
    else:
        refs = sorted(p.name for p in (folder / "refs").glob("*"))
        what = f"revision not in the cache (cached refs: {refs or 'none'})"
    hint = (
        "it is not a local path either; pre-fetch it (`hf download "
        f"{repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''} --revision "
        f"{revision}`) or unset HF_HUB_OFFLINE to let the run download"
        if offline()
        else "check the id and revision on the hub"
    )
    return HubError(f"{_where(repo_id, revision, repo_type)}: {what}{why}; {hint}")


def resolve_sha(repo_id: str, revision: str = "main", repo_type: RepoType = "model") -> str:
    """The commit sha `revision` names. Offline: from the cache; online: asks the hub (and
    falls back to the cache when it cannot be reached). Raises HubError."""
    if not offline():
        from huggingface_hub import HfApi

        try:
            info = HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type)
            if info.sha:
                return info.sha
        except Exception as exc:  # not found, gated, no network: the cache may still have it
            sha = _cached_sha(repo_id, revision, repo_type)
            if sha:
                return sha
            raise _missing(
                repo_id, revision, repo_type, f" ({type(exc).__name__}: {exc})"
            ) from None
    sha = _cached_sha(repo_id, revision, repo_type)
    if sha is None:
        raise _missing(repo_id, revision, repo_type, "")
    return sha


def snapshot(
    repo_id: str,
    revision: str = "main",
    repo_type: RepoType = "model",
    allow_patterns: list[str] | None = None,
    commit_sha: str | None = None,
) -> HubSnapshot:
    """The local snapshot folder of `repo_id` at `revision` (pinned to `commit_sha` when the
    plan already resolved it), downloaded first when online. Raises HubError."""
    from huggingface_hub import snapshot_download

    commit_sha = commit_sha or _PINS.get((repo_type, repo_id, revision))
    if offline():
        sha = commit_sha or resolve_sha(repo_id, revision, repo_type)
        target = sha
    else:
        # By the recipe's revision, not the sha: huggingface_hub then writes refs/<revision>,
        # so a later offline run of the same recipe resolves it from the cache.
        sha, target = commit_sha, revision
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=target,
                repo_type=repo_type,
                cache_dir=str(cache_dir()),
                allow_patterns=allow_patterns,
                local_files_only=offline(),
            )
        )
    except Exception as exc:  # the library's many "not cached" / "not found" errors
        raise _missing(repo_id, target, repo_type, f" ({type(exc).__name__}: {exc})") from None
    if sha is not None and folder.name != sha:
        raise HubError(
            f"{_where(repo_id, revision, repo_type)}: now at commit {folder.name}, but the run "
            f"was planned (and fingerprinted) at {sha}; the revision moved: run again to plan "
            "with the new commit, or pin ingest.revision / data.revision to a commit sha"
        )
    return HubSnapshot(repo_id, revision, folder.name, folder)
