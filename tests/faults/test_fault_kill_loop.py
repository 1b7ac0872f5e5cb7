"""The same recipe on the same machine gives the same bits: from scratch, under load, after kills.

The tiny quickstart (ingest -> sft -> reward -> dpo -> evaluate -> export, every training stage
checkpointing every 3 steps, DPO's reference log-probs precomputed) runs once uninterrupted, on
the embedded Prefect, as `posttrain run` does for a user. Against it:

- a run SIGKILLed inside DPO's reference pass, then a DPO of another beta under other numerics
  (3 threads, unchunked logits) that seals its reference table in the cache, then the DPO
  stage SIGKILLed inside its training loop, then run to the end: the export is the uninterrupted
  run's (before issue 39 the cached table of other numerics became the recipe's, whichever run
  computed it first). DPO's parents are copies of the uninterrupted run's, which it reuses;
- in another workspace, with another PYTHONHASHSEED, while a competing training job (a real
  stage process training a base) runs on the same cores all along, a seeded loop that SIGKILLs
  `posttrain run` at random moments — the CLI alone (an OOM kill: its stage and embedded server
  must go by themselves) or every process of the run at once (a power cut) — and starts it
  again: the last run ends, some stage resumed from a checkpoint, no process of any run is
  left, and every artifact's files equal the uninterrupted run's, the reference table among
  them (issue 39). One pipeline carries all three: from scratch (what no kill interrupted),
  under load, after kills, the same bits.

Every process a run starts inherits its PREFECT_HOME, which is private to this module: that is
how the tests find them all, whatever session or parent they ended up with.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prefect_server import seed_home

from posttrain.kinds import KINDS
from tests.stage_helpers import (
    ROOT,
    TINY,
    artifact_digests,
    competing_training,
    planned_dir,
    planned_launch,
    stop_competing,
    write_recipe,
)

pytestmark = pytest.mark.slow

SEED = 1212
# Optimizer steps of each training stage, checkpointed every 3: every stage has a checkpoint
# to resume from and steps after it. (The steps take milliseconds: a stage's time is its
# process start, which fewer steps or rows do not shorten, and its evaluation passes.)
STEPS = {"sft": 12, "reward": 6, "dpo": 6}
EVERY = 3
RUN_TIMEOUT_S = 600
# The stages whose complete artifacts the DPO test takes from the uninterrupted run.
DPO_PARENTS = ("ingest", "sft", "reward")

PAIRS = {
    "synthetic": {"n_examples": 64},
    "eval_fraction": 0.25,
    "max_seq_len": 64,
    "max_prompt_len": 40,
}
TRAIN = {"batch": {"micro_batch_size": 8, "grad_accum_steps": 1}, "checkpoint_every": EVERY}
# DPO's reference pass over 96 pairs: 12 forwards (>= 1 s here), long enough for a kill,
# polled every 5 ms, to land inside it.
DPO_PAIRS = {**PAIRS, "synthetic": {"n_examples": 128}}


def _recipe(folder: Path) -> Path:
    data = copy.deepcopy(TINY)
    data["run"]["name"] = "killloop"
    data["ingest"]["from_config"]["pretrain_steps"] = 10
    data["sft"]["data"]["synthetic"]["n_examples"] = 120
    data["sft"].update(max_steps=STEPS["sft"], checkpoint_every=EVERY)
    data["reward"] = {"data": PAIRS, "max_steps": STEPS["reward"], "min_accuracy": 0.0, **TRAIN}
    data["dpo"] = {
        "data": DPO_PAIRS,
        "max_steps": STEPS["dpo"],
        "precompute_reference": True,
        **TRAIN,
    }
    data["evaluate"].update(max_eval_rows=8, num_prompts=1, win_rate_prompts=2)
    return write_recipe(folder, data)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PYTEST"))}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


def _ours(home: Path) -> list[psutil.Process]:
    """Every live process carrying this module's PREFECT_HOME (CLI, server, stages, ranks)."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("PREFECT_HOME") == str(home) and p.status() != "zombie":
                found.append(p)
        except psutil.Error:
            continue
    return found


def _start(recipe: Path, home: Path, log: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(recipe), *args],
            cwd=ROOT,
            env=_env(home, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _run(recipe: Path, home: Path, log: Path, *args: str, **env: str) -> None:
    """One `posttrain run` to its end, which must succeed."""
    rc = _start(recipe, home, log, *args, **env).wait(RUN_TIMEOUT_S)
    assert rc == 0, log.read_text()[-6000:]


def _export_files(ws: Path, base_ws: Path | None = None) -> dict[str, str]:
    """sha256 of every file of the exported model. The model card names the base's folder,
    which is in this workspace (in `base_ws` where the ingest artifact was copied from there),
    and quotes the measured decode speed: it is compared without either."""
    (model,) = (ws / "artifacts" / "export").glob("*/model")
    out = {}
    for p in sorted(model.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "README.md":
                # measured speeds are no property of the model; every other line must match
                for folder in (ws, base_ws or ws):
                    data = data.replace(str(folder).encode(), b"<workspace>")
                lines = data.splitlines()
                data = b"\n".join(line for line in lines if b"tok/s" not in line)
            out[str(p.relative_to(model))] = hashlib.sha256(data).hexdigest()
    return out


def _wait_gone(home: Path, limit_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + limit_s
    while (left := _ours(home)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _checkpointed(ws: Path, stage: str | Path) -> int:
    """The newest complete checkpoint `stage` (a kind, or one artifact folder) wrote in this
    workspace (0 before its first): a kill after it has something to resume from. (Its steps
    take milliseconds here, so waiting for a logged step and then a random while would mostly
    land after the stage.)"""
    folders = [stage] if isinstance(stage, Path) else (ws / "artifacts" / stage).glob("*")
    done = [
        int(p.name.removeprefix("step_"))
        for folder in folders
        for p in folder.glob("checkpoints/step_*")
        if not p.name.endswith(".tmp")
    ]
    return max(done, default=0)


def _phase(folder: Path) -> str | None:
    """The phase of the newest heartbeat of the stage in `folder` (its rank 0)."""
    with contextlib.suppress(OSError, ValueError):
        return json.loads((folder / "logs" / "heartbeat" / "rank0.json").read_text())["phase"]
    return None


def _kill_everything(home: Path, proc: subprocess.Popen[bytes]) -> None:
    """A power cut: SIGKILL the CLI and every process of its run at once."""
    for pid in [proc.pid, *(p.pid for p in _ours(home) if p.pid != proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    left = _wait_gone(home, 60)
    assert not left, f"still running 60 s after the kill: {left}"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return seed_home(tmp_path_factory.mktemp("prefect-home"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, home: Path) -> Path:
    """The workspace of one uninterrupted run of the recipe, alone on the machine."""
    folder = tmp_path_factory.mktemp("reference")
    _run(_recipe(folder), home, folder / "run.log")
    ws = folder / "ws"
    assert "model.safetensors" in _export_files(ws)
    return ws


def test_killed_in_dpo_after_a_reference_table_of_other_numerics_ends_the_same(
    uninterrupted: Path, home: Path, tmp_path: Path
) -> None:
    recipe, ws, log = _recipe(tmp_path), tmp_path / "ws", tmp_path / "run.log"
    dpo, tables = planned_dir("dpo", recipe), ws / "artifacts" / "ref_logps"
    # DPO's parents: the uninterrupted run's (the same fingerprints), which the runs reuse.
    for kind in DPO_PARENTS:
        (done,) = (uninterrupted / "artifacts" / kind).glob("*/manifest.json")
        shutil.copytree(done.parent, ws / "artifacts" / kind / done.parent.name)

    # Inside the reference pass of the recipe's DPO: every process at once.
    proc, t0 = _start(recipe, home, log), time.monotonic()
    while _phase(dpo) != "reference":
        assert proc.poll() is None, "the run ended before DPO's reference pass: " + log.read_text()
        assert time.monotonic() - t0 < RUN_TIMEOUT_S
        time.sleep(0.005)
    _kill_everything(home, proc)
    assert not list(tables.glob("*/manifest.json")), "the kill missed the reference pass"

    # Meanwhile a DPO of another beta seals its table under other numerics (3 threads, full
    # logits instead of the chunked head): the table the recipe's DPO would take if the cache
    # ignored what a table was computed under (it did before issue 39).
    # Its stage process alone, as its supervisor launches it: how another run started it (a
    # CLI, a server) is no part of what its table is keyed on.
    other = ("dpo.beta=0.2", "infra.threads_per_rank=3", "infra.logits_chunk_tokens=0")
    with planned_launch("dpo", recipe, *other) as spec, open(log, "ab") as out:
        cmd = [sys.executable, "-m", KINDS["dpo"].module, "--spec", str(spec)]
        env, to = _env(home), RUN_TIMEOUT_S
        ran = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, timeout=to)
    assert ran.returncode == 0, log.read_text()[-6000:]

    # Inside the training loop: the recipe's DPO stage process, SIGKILLed after its first
    # checkpoint. Launched as its supervisor launches it, like the table above: a `posttrain
    # run` around it would add only a CLI and its server start, which the kill does not reach.
    with planned_launch("dpo", recipe) as spec, open(log, "ab") as out:
        cmd = [sys.executable, "-m", KINDS["dpo"].module, "--spec", str(spec)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(home), stdout=out, stderr=out)
        t0 = time.monotonic()
        while _checkpointed(ws, dpo) < EVERY:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() - t0 < RUN_TIMEOUT_S
            time.sleep(0.005)
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
    assert not _wait_gone(home, 60)

    _run(recipe, home, log)
    assert "resumed from step_" in (dpo / "logs" / "stage.log").read_text(errors="replace")
    # Both runs reused DPO's parents (the killed one before DPO's reference pass).
    assert log.read_text().count("complete artifact found") >= 2 * len(DPO_PARENTS)
    assert _export_files(ws, uninterrupted) == _export_files(uninterrupted)
    # The recipe's own table beside the other one.
    signatures = [
        json.loads(m.read_text())["section"]["numerics"] for m in tables.glob("*/manifest.json")
    ]
    assert sorted((s["threads"] == 3, s["logits_chunk_tokens"]) for s in signatures) == [
        (False, 2048),
        (True, 0),
    ]


def _kill_moments(rng: random.Random) -> list[tuple[str, int | float]]:
    """One kill at a random time (Prefect start-up, ingest, any stage), then kills right after
    a random checkpoint that leaves steps to do in each of two random training stages, in
    pipeline order so every re-run gets further: each kill in a phase of its own."""
    stages = sorted(rng.sample(list(STEPS), 2), key=list(STEPS).index)
    picked = [(stage, rng.choice(range(EVERY, STEPS[stage], EVERY))) for stage in stages]
    return [("time", rng.uniform(3.0, 20.0)), *picked]


def _kill_attempts(
    recipe: Path, home: Path, log: Path, rng: random.Random, **env: str
) -> list[str]:
    """Start `posttrain run` at each of `_kill_moments` and SIGKILL it there, the CLI alone or
    every process of the run; what each attempt did, for the failure messages."""
    ws, events = recipe.parent / "ws", []
    for i, (where, when) in enumerate(_kill_moments(rng)):
        everything = rng.random() < 0.5
        what = f"attempt {i}: SIGKILL {'every process' if everything else 'the CLI'}"
        what += f" at {when:.1f} s" if where == "time" else f" after {where} checkpoint {when}"
        with open(log, "a") as f:
            f.write(f"\n=== {what}\n")
        proc, t0 = _start(recipe, home, log, **env), time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < RUN_TIMEOUT_S:
            if where == "time" and time.monotonic() - t0 >= when:
                break
            if where != "time" and _checkpointed(ws, where) >= when:
                time.sleep(rng.uniform(0.0, 0.02))  # mid-step, mid-next-checkpoint, ...
                break
            time.sleep(0.01)
        if proc.poll() is not None:
            events.append(f"{what}: the run had ended (rc {proc.returncode})")
            continue
        victims = [proc.pid]
        if everything:
            victims += [p.pid for p in _ours(home) if p.pid != proc.pid]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        # What the CLI left (its stage, the embedded server) must stop by itself, quickly.
        left = _wait_gone(home, 60)
        assert not left, f"{what}: still running 60 s after the kill: {left}"
        events.append(what)
    return events


def test_killed_at_random_moments_under_load_with_another_hash_seed_every_artifact_is_the_same(
    uninterrupted: Path, home: Path, tmp_path: Path
) -> None:
    # The competing job carries a PREFECT_HOME of its own: no kill of the run's processes
    # reaches it, and the checks that none of them is left do not wait for it.
    load_dir = tmp_path / "load"
    load_dir.mkdir()
    competitor = competing_training(load_dir, _env(load_dir), threads=os.cpu_count() or 1)
    recipe, ws, log = _recipe(tmp_path), tmp_path / "ws", tmp_path / "killed.log"
    try:
        events = _kill_attempts(recipe, home, log, random.Random(SEED), PYTHONHASHSEED="4321")
        rc = _start(recipe, home, log, PYTHONHASHSEED="4321").wait(RUN_TIMEOUT_S)
    finally:
        assert stop_competing(competitor), "the competing job ended before the run did"
    assert rc == 0, "\n".join(events) + "\n" + log.read_text()[-6000:]
    assert not _wait_gone(home, 30)
    # The stages' own lines (the resume included) are in their logs, which every attempt appends
    # to, not on the CLI's terminal (flows.terminal).
    stage_logs = "".join(
        p.read_text(errors="replace") for p in ws.glob("artifacts/*/*/logs/stage.log")
    )
    assert "resumed from step_" in stage_logs, "no kill landed mid-training: " + "\n".join(events)
    assert _export_files(ws) == _export_files(uninterrupted), "\n".join(events)
    # Every artifact, not only the export, each stage read as one launch (a resumed launch adds
    # its start record to metrics, and finds the reference table its killed launch sealed).
    got, expected = (artifact_digests(w, one_launch=True) for w in (ws, uninterrupted))
    assert got.keys() == expected.keys()
    assert any(k.startswith("ref_logps/") for k in got)  # the precomputed reference table
    differ = sorted(k for k in got if got[k] != expected[k])
    assert not differ, differ
    # And every manifest says so, with what the bits depend on.
    for manifest in (ws / "artifacts").glob("*/*/manifest.json"):
        numerics = json.loads(manifest.read_text()).get("numerics")
        if manifest.parent.parent.name == "ref_logps":
            continue  # a cache: its key holds the signature (the DPO test reads it)
        assert numerics["reproducibility"]["bit_exact"] is True, manifest
        assert numerics["signature"]["mkl_cbwr"] == "AUTO,STRICT", manifest
    print("\n".join(events))
