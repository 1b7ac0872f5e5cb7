"""Real crashes: SIGKILL a training stage (its whole process group) after a checkpoint, re-run it,
and get what an uninterrupted run gets: bit-exact on the same world size, the same rows and losses
when resumed on another number of ranks."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from posttrain.kinds import KINDS
from posttrain.store.artifacts import verify
from posttrain.telemetry.records import read_metrics
from posttrain.train.checkpoint import complete_checkpoints, data_position
from tests.stage_helpers import (
    ROOT,
    TINY,
    planned_dir,
    planned_launch,
    run_inprocess,
    run_shared,
    write_recipe,
)

pytestmark = pytest.mark.slow

STEPS, EVERY = 24, 4


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, shared_parents: Path) -> Path:
    data = copy.deepcopy(TINY)
    data["infra"]["threads_per_rank"] = 1  # 2 threads per process on a busy 2-core box: ~30x slower
    data["ingest"]["from_config"]["pretrain_steps"] = 30
    data["sft"].update(max_steps=STEPS, checkpoint_every=EVERY)
    data["sft"]["data"]["synthetic"]["n_examples"] = 120  # 108 train rows: 24 x 8 crosses an epoch
    path = write_recipe(tmp_path_factory.mktemp("resume"), data)
    run_shared("ingest", path, shared_parents)  # the 30-step base, built once per session
    return path


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _train_steps(out: Path) -> list[int]:
    """Logged train steps so far; tolerates a line the running stage is writing."""
    path, steps = out / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "train":
            steps.append(rec["step"])
    return steps


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group and every descendant (torchrun starts its workers in sessions of
    their own, so the group alone would leave them training)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:  # already gone
        children = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.wait(timeout=30)
    psutil.wait_procs(children, timeout=30)


def _stage(spec: Path | None, nproc: int = 1) -> list[str]:
    """The command line of the sft stage on `spec` (a launch this test supervises), under
    torchrun for several ranks."""
    assert spec is not None, "the stage is complete already"
    stage = ["-m", KINDS["sft"].module, "--spec", str(spec)]
    if nproc == 1:
        return [sys.executable, *stage]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, f"--nproc-per-node={nproc}", *stage]


def _run_and_kill(cmd: list[str], out: Path, log: Path, after: int) -> int:
    """Start `cmd` in its own process group, SIGKILL it once a checkpoint at step >= `after` is
    complete and a later step has been logged; returns the newest complete checkpoint's step."""
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, env=_env(), cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )

    def past_a_checkpoint() -> bool:
        done = complete_checkpoints(out / "checkpoints")
        newest = int(done[-1].name.split("_")[1]) if done else 0
        return newest >= after and max(_train_steps(out), default=0) > newest

    try:
        deadline = time.monotonic() + 240
        while not past_a_checkpoint():
            assert proc.poll() is None, f"stage ended before the kill:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.02)
    finally:
        _kill_group(proc)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert not (out / "manifest.json").exists() and not (out / "adapter").exists()
    return int(complete_checkpoints(out / "checkpoints")[-1].name.split("_")[1])


def _uninterrupted(recipe: Path, tmp_path: Path, *over: str) -> tuple[Path, Path]:
    """Run the stage to the end in its folder, move the result aside; -> (folder, reference)."""
    out = run_inprocess("sft", recipe, *over)
    ref = tmp_path / "reference"
    out.rename(ref)
    return out, ref


def _check_data_position(out: Path, step: int) -> dict:
    meta = json.loads((out / "checkpoints" / f"step_{step:07d}" / "meta.json").read_text())
    n_rows = read_metrics(out / "metrics.jsonl", "start")[0]["train_examples"]
    assert meta["step"] == step and meta["scheduler"]["last_epoch"] == step
    assert meta["data"] == data_position(step, n_rows, 8, 0)
    assert meta["data"]["epoch"] * n_rows + meta["data"]["offset"] == step * 8
    return meta


def test_sigkill_then_rerun_is_bit_exact(recipe: Path, tmp_path: Path) -> None:
    over = ("sft.lora.dropout=0.1",)  # dropout draws on the torch RNG: its restore is checked too
    out, ref = _uninterrupted(recipe, tmp_path, *over)
    with planned_launch("sft", recipe, *over) as spec:
        at = _run_and_kill(_stage(spec), out, tmp_path / "killed.log", EVERY)
    assert EVERY <= at < STEPS
    _check_data_position(out, at)

    # Re-run as a fresh process, as after a real crash (an in-process re-run would share state
    # with the reference run, e.g. the CPU peak measured once per process with torch.randn).
    with planned_launch("sft", recipe, *over) as spec:
        rerun = subprocess.run(
            _stage(spec), env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300
        )
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"resumed from step_{at:07d} at step {at}" in rerun.stdout
    assert verify(out)[0]
    assert read_metrics(out / "metrics.jsonl", "start")[-1]["start_step"] == at

    from safetensors.torch import load_file

    name = "adapter/adapter_model.safetensors"
    got, want = load_file(out / name), load_file(ref / name)
    assert got.keys() == want.keys() and got
    for k in want:
        assert torch.equal(got[k], want[k]), k
    got_m, want_m = (read_metrics(p / "metrics.jsonl", "train") for p in (out, ref))
    assert [r["step"] for r in got_m] == [r["step"] for r in want_m] == list(range(1, STEPS + 1))
    for a, b in zip(want_m, got_m, strict=True):
        assert (b["loss"], b["grad_norm"], b["lr"]) == (a["loss"], a["grad_norm"], a["lr"]), a
    evals = [
        [r["eval_loss"] for r in read_metrics(p / "metrics.jsonl", "eval")] for p in (out, ref)
    ]
    assert evals[0] == evals[1]
    # The checkpoints the re-run wrote (retention keeps the last two) are past the epoch boundary.
    last = _check_data_position(out, STEPS - EVERY)["data"]
    assert last["epoch"] == 1 and last["offset"] == (STEPS - EVERY) * 8 - last["n_rows"]


def _assert_same_rows_and_losses(out: Path, ref: Path) -> None:
    """Every step of the run in `out` took the rows the uninterrupted run's took, with its loss
    up to the order of float sums across ranks."""
    got_m, want_m = (read_metrics(p / "metrics.jsonl", "train") for p in (out, ref))
    assert [r["step"] for r in got_m] == list(range(1, STEPS + 1))
    for a, b in zip(want_m, got_m, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4), (a["step"], a["loss"], b["loss"])
        assert b["target_tokens"] == a["target_tokens"], a["step"]


def test_killed_runs_resume_on_another_number_of_ranks(
    recipe: Path, tmp_path: Path, capsys
) -> None:
    """Both ways, on one chain of real kills (each resume is a launch the next kill interrupts):
    a checkpoint written by one unwrapped rank (full tensors, no FSDP2) loads into two sharded
    ranks, and theirs (an RNG state per rank) back into one; the same global batch, so the same
    rows every step and the uninterrupted run's losses."""
    two = ("infra.devices_per_node=2", "sft.batch.micro_batch_size=4")
    one = ("infra.devices_per_node=1", "sft.batch.micro_batch_size=8")
    # Same global batch: the same folder, so each launch picks up the other's checkpoints.
    assert planned_dir("sft", recipe, *two) == planned_dir("sft", recipe, *one)
    out, ref = _uninterrupted(recipe, tmp_path, *one)
    with planned_launch("sft", recipe, *one) as spec:
        at1 = _run_and_kill(_stage(spec), out, tmp_path / "one.log", EVERY)
    assert EVERY <= at1 < STEPS
    assert _check_data_position(out, at1)["world_size"] == 1

    # One rank -> two: killed after a checkpoint of its own.
    with planned_launch("sft", recipe, *two) as spec:
        at2 = _run_and_kill(_stage(spec, 2), out, tmp_path / "two.log", at1 + EVERY)
    assert f"resumed from step_{at1:07d} at step {at1}" in (tmp_path / "two.log").read_text()
    assert at1 < at2 < STEPS
    assert _check_data_position(out, at2)["world_size"] == 2
    assert {p.name for p in (out / "checkpoints" / f"step_{at2:07d}").glob("rng_rank*.pt")} == {
        "rng_rank0.pt",
        "rng_rank1.pt",
    }

    # Two ranks -> one, to the end.
    capsys.readouterr()
    run_inprocess("sft", recipe, *one)
    assert f"resumed from step_{at2:07d} at step {at2}" in capsys.readouterr().out
    assert verify(out)[0]
    starts = read_metrics(out / "metrics.jsonl", "start")
    launches = [(r["start_step"], r["world_size"], r["micro_batch_size"]) for r in starts]
    assert launches == [(0, 1, 8), (at1, 2, 4), (at2, 1, 8)]
    _assert_same_rows_and_losses(out, ref)
