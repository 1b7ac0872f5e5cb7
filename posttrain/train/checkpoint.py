"""Resumable training checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is `checkpoints/step_<N>/`: the trainable parameters and optimizer state as DCP
shards (world-size independent), `meta.json` (step, scheduler, Python/NumPy RNG as JSON, the
data-loader position, a stage's own `extra` state) and one `rng_rank<r>.pt` tensor per rank (loaded
with weights_only=True: no pickled objects). It is written under `step_<N>.tmp/` and renamed when
every rank is done, so a crash mid-save leaves the previous checkpoint as the newest complete one.
Retention never deletes the newest.

Before the rename, `integrity.json` records the size and sha256 of every file (hashed in parallel,
one share per rank; see `posttrain.train.integrity`), so a resume can tell a damaged checkpoint
from an intact one (`posttrain.train.resume`). Before writing, every rank checks that the disk
has room for it (the previous checkpoint's size, or the bytes of the state to save); a save that
fills the disk anyway removes its `.tmp` folder. Either way every rank raises `DiskFull`
together (the outcome of each phase is exchanged, so no rank waits alone in a barrier) and the
last complete checkpoint stays as it was.

The data-loader position (`meta["data"]`, see `data_position`) is a record, not state to restore:
the rows of step s are a pure function of (seed, s) (`posttrain.data.batching.step_indices`), so
`step` alone resumes the stream; the record says where in it the run stood and lets a resume check
that it walks the same stream (same rows, global batch and seed).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from posttrain.distributed.agree import barrier, from_rank0, gather_all, world
from posttrain.runtime.diskspace import (
    DiskFull,
    ensure_free,
    folder_bytes,
    free_bytes,
    full_disk_error,
    human,
    required_bytes,
    tensor_bytes,
)
from posttrain.train.integrity import META, hash_files, listing, my_share, write_record

log = logging.getLogger("posttrain.train")
# A complete checkpoint's folder name; `step_<N>.tmp` (being written) and `step_<N>.damaged`
# (moved aside by a resume) are not.
STEP_DIR = re.compile(r"step_(\d+)")

# Frozen base weights are reloaded from the ingest artifact; only what training changes is saved.
_OPTS = StateDictOptions(ignore_frozen_params=True)
# Loading such a partial state dict must not demand the frozen keys.
_LOAD_OPTS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (renamed from `.tmp`, with a meta.json), oldest first; complete is
    not intact (`resume_newest_intact`)."""
    if not root.exists():
        return []
    done = [
        p
        for p in root.iterdir()
        if STEP_DIR.fullmatch(p.name) and p.is_dir() and (p / META).exists()
    ]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def damaged_checkpoints(root: Path) -> list[Path]:
    """Checkpoints a resume moved aside (`step_<N>.damaged*`), kept for inspection."""
    return sorted(root.glob("step_*.damaged*")) if root.exists() else []


def data_position(step: int, n_rows: int, global_batch_size: int, seed: int) -> dict[str, int]:
    """Where the data stream stands after `step` optimizer steps: the epoch, the next sample's
    offset in that epoch's permutation (`epoch_permutation(n_rows, epoch, seed)`), and what
    the stream is walked with."""
    seen = step * global_batch_size
    epoch, offset = divmod(seen, n_rows)
    return {
        "epoch": epoch,
        "offset": offset,
        "samples_seen": seen,
        "n_rows": n_rows,
        "global_batch_size": global_batch_size,
        "seed": seed,
    }


def trainable_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model state a checkpoint holds: trainable parameters (and buffers) only.

    `ignore_frozen_params` alone is not enough: torch drops frozen parameters by walking
    `named_parameters()`, which names a shared parameter once, so the tied alias of a frozen
    embedding (`lm_head.weight`) stayed in, vocab x hidden values in every LoRA checkpoint.
    Every name of a frozen parameter is dropped here, and a trainable parameter shared under
    several names (tied embeddings in full fine-tuning) is kept once: loading it restores every
    alias, since they are one tensor.
    """
    drop, seen = set(), set()
    for n, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad or id(p) in seen:
            drop.add(n)
        seen.add(id(p))
    state = get_model_state_dict(model, options=_OPTS)
    return {k: v for k, v in state.items() if k not in drop}


def _outcome(exc: BaseException | None) -> tuple[str, str] | None:
    """What a rank reports of its part of a save: None (fine), ("full", why) or ("error", why)."""
    if exc is None:
        return None
    if isinstance(exc, DiskFull):
        return ("full", "")
    if (err := full_disk_error(exc)) is not None:
        return ("full", f"{err.strerror or err}")
    return ("error", f"{type(exc).__name__}: {exc}"[:2000])


def _fail_together(
    local: BaseException | None, outcomes: list[Any], tmp: Path, name: str, expected: int
) -> None:
    """If any rank's part failed, every rank raises (rank 0 first removes the partial `.tmp`)."""
    bad = [(r, o) for r, o in enumerate(outcomes) if o is not None]
    if not bad:
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()  # the cleanup is done before any rank exits (torchrun then stops the rest)
    full = [(r, why) for r, (kind, why) in bad if kind == "full"]
    if full:
        r, why = full[0]
        during = f"; the disk filled while writing it (rank {r}: {why})" if why else ""
        damaged = damaged_checkpoints(tmp.parent)
        note = (
            f"{during}; no partial checkpoint is left, the last complete one is untouched"
            if during
            else ""
        )
        if damaged:
            note += (
                f"; {len(damaged)} damaged checkpoint(s) moved aside earlier in {tmp.parent} "
                f"({', '.join(p.name for p in damaged)}) can be deleted once inspected"
            )
        raise DiskFull(
            f"checkpoint {name}", tmp.parent, required_bytes(expected), free_bytes(tmp.parent), note
        ) from local
    if local is not None:
        raise local
    r, (_, why) = bad[0]
    raise RuntimeError(f"checkpoint {name} not saved: rank {r} failed: {why}")


def _attempt(fn: Any) -> BaseException | None:
    # DCP's CheckpointException is a BaseException: catch it, but never Ctrl-C or an exit.
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 (reported to every rank by _fail_together)
        return exc
    return None


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    scheduler: Any,
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    final = root / f"step_{step:07d}"
    tmp = root / f"step_{step:07d}.tmp"
    t0 = time.perf_counter()
    state = {
        "model": trainable_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=_OPTS),
    }
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step that was killed
    # Room for it: the previous checkpoint's size, or the bytes of the tensors to save (global
    # sizes: every rank writes its shards into this one shared folder).
    done = complete_checkpoints(root)
    expected = max(folder_bytes(done[-1]) if done else 0, tensor_bytes(state))
    exc = _attempt(lambda: ensure_free(root, expected, f"checkpoint {final.name}"))
    _fail_together(exc, gather_all(_outcome(exc)), tmp, final.name, expected)

    def write_shards() -> None:
        if _rank() == 0:
            tmp.mkdir(parents=True)
        barrier()
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(torch.get_rng_state(), tmp / f"rng_rank{_rank()}.pt")

    exc = _attempt(write_shards)
    _fail_together(exc, gather_all(_outcome(exc)), tmp, final.name, expected)
    # Every rank hashes its share of the files (all written now: the gather above was a barrier).
    t_hash = time.perf_counter()
    names = from_rank0(listing(tmp))
    table: dict[str, Any] = {}
    exc = _attempt(lambda: table.update(hash_files(tmp, my_share(names, _rank(), world()))))
    results = gather_all((_outcome(exc), table))
    _fail_together(exc, [o for o, _ in results], tmp, final.name, expected)
    hash_s = time.perf_counter() - t_hash

    def seal() -> None:
        np_state = np.random.get_state()
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "python_rng": _jsonable(random.getstate()),
            "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "world_size": world(),
            **(extra or {}),
        }
        (tmp / META).write_text(json.dumps(meta))
        files = {k: v for _, part in results for k, v in part.items()}
        write_record(tmp, {**files, **hash_files(tmp, [META])})
        tmp.rename(final)

    exc = _attempt(seal) if _rank() == 0 else None
    _fail_together(exc, from_rank0([_outcome(exc)]), tmp, final.name, expected)
    if _rank() == 0:
        size = sum(v["bytes"] for _, part in results for v in part.values())
        log.info(
            "checkpoint %s saved: %s in %.2f s, of which %.3f s hashing (sha256, %d rank(s))",
            final.name,
            human(size),
            time.perf_counter() - t0,
            hash_s,
            world(),
        )
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


@dataclass
class StagedCheckpoint:
    """A checkpoint read into memory, not yet applied (see `read_checkpoint`)."""

    path: Path
    meta: dict[str, Any]
    state: dict[str, Any]  # {"model", "optim"}: new tensors shaped like the live state
    python_rng: tuple
    numpy_rng: tuple
    torch_rng: torch.Tensor | None
    optim_was_fresh: bool


def read_checkpoint(
    path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer
) -> StagedCheckpoint:
    """Read and check everything `path` holds for this rank without changing the model, the
    scheduler or the RNG; raises on any damage. Collective (DCP). Then `apply_checkpoint`, or,
    when another rank failed to read it, `discard_checkpoint` (every rank takes the same
    decision, so a restart from step 0 is exactly a fresh run on every rank)."""
    meta = json.loads((path / META).read_text())
    py_rng = _tuplify(meta["python_rng"])
    np_saved = meta["numpy_rng"]
    np_rng = (np_saved[0], np.array(np_saved[1], dtype=np.uint32), *np_saved[2:])
    random.Random().setstate(py_rng)  # validated on throwaway generators
    np.random.RandomState().set_state(np_rng)
    rng_file = path / f"rng_rank{_rank()}.pt"
    # absent when resuming on more ranks than saved: keep the seeded state
    torch_rng = torch.load(rng_file, weights_only=True) if rng_file.exists() else None
    fresh = not optim.state
    live = {
        "model": trainable_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=_OPTS),
    }
    # Read into new tensors, not into the parameters: a read that fails half-way (a truncated
    # shard) must not leave half a checkpoint in the model.
    target = _empty_like(live)
    staged = StagedCheckpoint(path, meta, target, py_rng, np_rng, torch_rng, fresh)
    try:
        dcp.load(target, checkpoint_id=str(path))
    except BaseException:
        discard_checkpoint(staged, optim)
        raise
    return staged


def discard_checkpoint(staged: StagedCheckpoint, optim: torch.optim.Optimizer) -> None:
    """Undo the one side effect of reading: get_optimizer_state_dict initialises a fresh
    optimizer's state (a zero-lr step, so AdamW's step count would be off by one)."""
    if staged.optim_was_fresh:
        optim.state.clear()


def apply_checkpoint(
    staged: StagedCheckpoint, model: torch.nn.Module, optim: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Put a read checkpoint into model, optimizer, scheduler and RNG; returns its meta."""
    set_model_state_dict(model, staged.state["model"], options=_LOAD_OPTS)
    set_optimizer_state_dict(model, optim, staged.state["optim"], options=_LOAD_OPTS)
    scheduler.load_state_dict(staged.meta["scheduler"])
    random.setstate(staged.python_rng)
    np.random.set_state(staged.numpy_rng)
    if staged.torch_rng is not None:
        torch.set_rng_state(staged.torch_rng)
    return staged.meta


def _empty_like(x: Any) -> Any:
    """The same nesting with a new uninitialised tensor for every tensor (DTensors keep their
    placement); other values are kept (DCP replaces them when it loads)."""
    if isinstance(x, torch.Tensor):
        return torch.empty_like(x)
    if isinstance(x, dict):
        return {k: _empty_like(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_empty_like(v) for v in x]
    return x


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple | list) else x


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x
