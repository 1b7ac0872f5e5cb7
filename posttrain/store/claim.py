"""Whether a stage must run: one look at its artifact folder, under its lock.

A stage is done when its sealed manifest exists, verifies (every file's size and sha256) and
carries the planned fingerprint (`posttrain.store.status`). The look that decides it is made
once per launch by whoever holds the artifact's lock (`posttrain.store.locking.ArtifactLock`):
  - the supervisor (`flows.stage.supervise`) for every stage the flow launches; the stage
    process it starts inherits the lock (`spec.launch.lock`) and does not look again;
  - the stage process itself when nothing holds the lock for it (`python -m posttrain.stages.x
    --spec ...`, `posttrain launch`): `claim_by_hand`. Rank 0 of node 0 takes the lock and
    looks; the other ranks of its torchrun launch wait until the lock's record carries their
    rank 0's decision and follow it, so no rank touches a folder another run is writing.
Prefect's task cache is not a source of truth: the artifact store is the one cache.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.store.artifacts import ArtifactRef
from posttrain.store.locking import ArtifactLock, describe_holder
from posttrain.store.status import find_reusable, status

log = logging.getLogger("posttrain.lock")


@dataclass
class HandClaim:
    """What `claim_by_hand` found: the artifact when it is complete (`done`, rank 0 of node 0
    gets its ref; others only the fact), and the lock this process holds, if any."""

    done: bool
    ref: ArtifactRef | None = None
    lock: ArtifactLock | None = None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def _launch_key(env: Mapping[str, str]) -> str:
    # The ranks of one torchrun agent share its run id and are its children; the agent's PID
    # tells this launch from an earlier one with the same run id (a multi-node rdzv id is the
    # fingerprint, the same for every launch of the stage).
    if run_id := env.get("TORCHELASTIC_RUN_ID"):
        return f"{run_id}/{os.getppid()}"
    return f"pid-{os.getpid()}"


def claim_by_hand(
    out_dir: Path,
    fingerprint: str,
    stage: str,
    env: Mapping[str, str] | None = None,
    poll_s: float = 0.25,
) -> HandClaim:
    """Take the artifact for a stage process that no supervisor holds the lock for, or find
    it complete. See the module docstring for who looks."""
    env = os.environ if env is None else env
    if env.get("GROUP_RANK", "0") != "0":
        # Another node of a launch started by hand: node 0's lock may be on a file system this
        # node does not share. The folder it writes to is shared (or the stage could not run),
        # so it says whether the stage is done; read-only, node 0 owns the folder.
        return HandClaim(status(out_dir, fingerprint, hashes=True).reusable)
    lock, key = ArtifactLock(out_dir), _launch_key(env)
    if env.get("RANK", "0") == "0":
        lock.acquire(
            {"launch": key, "what": f"stage {stage}, launch {key}"},
            on_wait=lambda holder: _waiting(stage, holder, lock),
            poll_s=poll_s,
        )
        ref = find_reusable(out_dir, fingerprint, log)
        lock.update(decision="reuse" if ref is not None else "build")
        return HandClaim(ref is not None, ref, lock)
    return HandClaim(_follow_rank_0(lock, key, stage, poll_s) == "reuse")


def _follow_rank_0(lock: ArtifactLock, key: str, stage: str, poll_s: float) -> str:
    """Wait until the lock's record is this launch's rank 0's, with its decision."""
    told = False
    while True:
        holder = lock.holder()
        if holder is not None and holder.get("launch") == key and holder.get("decision"):
            return str(holder["decision"])
        if not told:
            _waiting(stage, holder, lock)
            told = True
        time.sleep(poll_s)


def _waiting(stage: str, holder: dict[str, Any] | None, lock: ArtifactLock) -> None:
    log.info(
        "stage %s: waiting for another run of the same stage (%s) to release %s",
        stage,
        describe_holder(holder),
        lock.path,
    )
