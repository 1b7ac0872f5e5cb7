"""Resumable training checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is `checkpoints/step_<N>/`: the trainable parameters and optimizer state as DCP
shards (world-size independent), `meta.json` (step, scheduler, Python/NumPy RNG as JSON, the
data-loader position, a stage's own `extra` state) and one `rng_rank<r>.pt` tensor per rank (loaded
with weights_only=True: no pickled objects). It is written under `step_<N>.tmp/` and renamed when
every rank is done, so a crash mid-save leaves the previous checkpoint as the newest complete one.
Retention never deletes the newest.

The data-loader position (`meta["data"]`, see `data_position`) is a record, not state to restore:
the rows of step s are a pure function of (seed, s) (`posttrain.data.batching.step_indices`), so
`step` alone resumes the stream; the record says where in it the run stood and lets a resume check
that it walks the same stream (same rows, global batch and seed).
"""

from __future__ import annotations

import json
import random
import shutil
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

# Frozen base weights are reloaded from the ingest artifact; only what training changes is saved.
_OPTS = StateDictOptions(ignore_frozen_params=True)
# Loading such a partial state dict must not demand the frozen keys.
_LOAD_OPTS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.exists():
        return []
    done = [
        p
        for p in root.glob("step_*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / "meta.json").exists()
    ]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def data_position(step: int, n_rows: int, global_batch_size: int, seed: int) -> dict[str, int]:
    """Where the data stream stands after `step` optimizer steps of `global_batch_size` rows over
    per-epoch shuffles of `n_rows` rows: `epoch` and the next sample `offset` within that epoch's
    permutation, `samples_seen` in all, and the shuffle `seed` the permutations are drawn from
    (`epoch_permutation(n_rows, epoch, seed)`)."""
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
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    state = {
        "model": trainable_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=_OPTS),
    }
    dcp.save(state, checkpoint_id=str(tmp))
    torch.save(torch.get_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        np_state = np.random.get_state()
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "python_rng": _jsonable(random.getstate()),
            "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            **(extra or {}),
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(final)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(
    path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG from `path`; returns its meta."""
    state = {
        "model": trainable_state_dict(model),
        "optim": get_optimizer_state_dict(model, optim, options=_OPTS),
    }
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=_LOAD_OPTS)
    set_optimizer_state_dict(model, optim, state["optim"], options=_LOAD_OPTS)
    meta = json.loads((path / "meta.json").read_text())
    scheduler.load_state_dict(meta["scheduler"])
    random.setstate(_tuplify(meta["python_rng"]))
    np_state = meta["numpy_rng"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.exists():  # absent when resuming on more ranks than saved: keep the seeded state
        torch.set_rng_state(torch.load(rng_file, weights_only=True))
    return meta


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple | list) else x


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x
