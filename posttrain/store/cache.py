"""Values a stage computes once for later runs to reuse: DPO's reference log-prob table
(`posttrain.stages.dpo`) and a teacher's answers (`posttrain.rl.teacher_answers`).

An entry is an artifact, `<workspace>/artifacts/<name>/<key>/`: its files and the manifest that
seals them. The key is the fingerprint of everything the value depends on, the numerics
signature of the process that computes it included (`posttrain.numerics`), so a hit returns the
bits a miss computes. An entry is sealed in a folder beside it, then renamed into place: a
reader never finds half of one. It is read only once every byte verifies (`posttrain.store.
status`); a damaged one is said in a log line and computed again. `posttrain clean` keeps an
entry while an artifact it was computed from (its manifest's parents) is kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from posttrain.store.artifacts import write_manifest
from posttrain.store.status import status

T = TypeVar("T")
log = logging.getLogger("posttrain.cache")


def cached(
    folder: Path,
    compute: Callable[[], T],
    save: Callable[[T, Path], None],
    load: Callable[[Path], T],
    *,
    parents: list[str],
    inputs: dict[str, Any],
    writer: bool,
    barrier: Callable[[], None] = lambda: None,
) -> tuple[T, bool]:
    """(the value of the entry `folder`, whether it was a hit). On a miss every rank runs
    `compute` (it may be collective), the `writer` (rank 0) publishes the value, and the others
    wait for it at `barrier`. `parents`: fingerprints of the artifacts the value is computed
    from; `inputs`: what its manifest records of the rest."""
    look = status(folder, folder.name, hashes=True)
    if look.reusable:
        return load(folder), True
    if look.state != "missing":
        log.warning("cache entry %s is damaged (%s): computing it again", folder, look.why)
    value = compute()
    if writer:  # sealed beside the entry, then renamed into place
        tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save(value, tmp)
        # A cache draws nothing at random: its key holds all it depends on.
        write_manifest(
            tmp, stage=folder.parent.name, fp=folder.name, parents=parents, section=inputs,
            seed=0, summary={},
        )  # fmt: skip
        if folder.exists() and not status(folder, folder.name, hashes=True).reusable:
            aside = folder.with_name(f".damaged-{folder.name}-{os.getpid()}")
            with contextlib.suppress(OSError):  # another process set it aside first
                os.rename(folder, aside)
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:  # there: another process published it meanwhile, and that one stays
            shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    return value, False
