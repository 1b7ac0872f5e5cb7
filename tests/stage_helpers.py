"""Run real stages on a tiny recipe, in-process (world size 1) or under torchrun, the test
acting as their supervisor (`supervised`: it holds the artifact's lock and names it in the
spec, as `flows.stage.supervise` does)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from posttrain.config.loader import load_recipe
from posttrain.kinds import KINDS
from posttrain.plan.planner import plan, spec_for
from posttrain.runtime.spec import PlannedStage, StageSpec, spec_path
from posttrain.store.artifacts import ref_from_manifest
from posttrain.store.locking import ArtifactLock
from posttrain.store.status import find_reusable

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "run": {"name": "tiny", "seed": 0},
    "infra": {"device": "cpu", "devices_per_node": 1},
    "ingest": {
        "source": "from_config",
        "from_config": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "intermediate_size": 128,
            "vocab_size": 512,
            "max_position_embeddings": 128,
            "pretrain_steps": 100,
            "pretrain_batch_size": 8,
            "pretrain_seq_len": 64,
            "corpus_examples": 400,
        },
    },
    "sft": {
        "data": {"synthetic": {"n_examples": 240}, "eval_fraction": 0.1, "max_seq_len": 64},
        "lora": {"r": 8, "alpha": 16},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "batch": {"micro_batch_size": 8, "grad_accum_steps": 1},
        "max_steps": 16,
        "checkpoint_every": 0,
    },
    "evaluate": {
        "max_eval_rows": 24,
        "num_prompts": 2,
        "speed": {"prompt_tokens": 16, "new_tokens": 8},
        "sampling": [
            {"name": "greedy", "strategy": "greedy", "max_new_tokens": 12},
            {"name": "sample", "strategy": "sample", "top_k": 10, "max_new_tokens": 12},
        ],
    },
}

# An evaluate section for tests of wiring (which policy evaluate takes, what its report holds),
# not of quality: few rows and prompts, short generations, no speed test, a small pass@k (when
# the lineage has a verifier) and win-rate (when it has a reward model).
SMALL_EVALUATE = {
    "max_eval_rows": 8,
    "num_prompts": 1,
    "sampling": [{"name": "greedy", "strategy": "greedy", "max_new_tokens": 4}],
    "speed": None,
    "win_rate_prompts": 4,
    "win_rate_sampling": {"name": "win-rate", "strategy": "greedy", "max_new_tokens": 8},
    "pass_prompts": 4,
    "pass_samples": 2,
    "pass_k": 2,
    "pass_sampling": {"name": "pass@k", "strategy": "sample", "max_new_tokens": 8},
}


def write_recipe(folder: Path, data: dict | None = None) -> Path:
    data = yaml.safe_load(yaml.safe_dump(data or TINY))
    data["run"]["workspace"] = str(folder / "ws")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@contextlib.contextmanager
def supervised(stage: PlannedStage, spec: StageSpec, reuse: bool = False) -> Iterator[Path | None]:
    """Act as the supervisor of one launch of `stage` (flows.stage.supervise does it for the
    flow and `posttrain launch`): hold its artifact's lock for the block and yield the path of
    its spec with a launch record naming the lock, which a stage process requires. `reuse`:
    look first, as a supervisor does, and yield None when the artifact is complete."""
    from flows.stage.launch import launch_info
    from posttrain.runtime.recovery import earlier_attempt

    lock = ArtifactLock(stage.out_dir)
    lock.acquire({"what": f"test supervisor of stage {stage.name}"})
    try:
        if reuse and find_reusable(stage.out_dir, stage.fingerprint) is not None:
            yield None
            return
        launch = launch_info(
            stage, uuid.uuid4().hex, str(lock.path), earlier_attempt(stage.out_dir)
        )
        yield spec.model_copy(update={"launch": launch}).write(spec_path(stage.out_dir))
    finally:
        lock.release()


@contextlib.contextmanager
def planned_launch(
    stage: str, recipe: Path, *overrides: str, name: str | None = None
) -> Iterator[Path | None]:
    """`supervised(reuse=True)` for the recipe's stage `name` (else its one stage of kind
    `stage`), planned with its parents' artifacts, which must be complete."""
    loaded = load_recipe(recipe, list(overrides))
    planned = {s.name: s for s in plan(loaded).stages}
    me = _named(list(planned.values()), name or stage, stage)
    refs = {p: ref_from_manifest(planned[p].out_dir) for p in me.parents}
    with supervised(me, spec_for(me, loaded, refs), reuse=True) as path:
        yield path


def run_inprocess(stage: str, recipe: Path, *overrides: str, name: str | None = None) -> Path:
    """Run one stage of kind `stage` (the one named `name` when the recipe has several) through
    its real entry point in this process, this process its supervisor; returns its output
    folder."""
    from posttrain.stages.common import stage_main

    module = importlib.import_module(KINDS[stage].module)
    with planned_launch(stage, recipe, *overrides, name=name) as path:
        if path is not None:  # else complete: reused
            stage_main(
                module.run,
                kind=stage,
                distributed=KINDS[stage].distributed,
                argv=["--spec", str(path)],
            )
    return planned_dir(name or stage, recipe, *overrides)


def run_shared(stage: str, recipe: Path, store: Path) -> Path:
    """`run_inprocess(stage, recipe)` for a parent that several test modules build from the same
    sections (TINY's ingest and sft, PREF's reward): it is built once per session, in the
    workspace of `store` (the `shared_parents` fixture), and copied into the recipe's workspace.
    A copy with the same fingerprint and verified files is what its supervisor reuses, so the
    call below then does nothing. Copies keep a module's changes to its artifacts its own; the
    ingest manifest's model_dir names the store's model folder, which no test changes."""
    out = planned_dir(stage, recipe)
    data = yaml.safe_load(recipe.read_text())
    data["run"]["workspace"] = str(store / "ws")
    # Beside the recipe, so its relative paths and allowed folders read the same.
    built_recipe = recipe.with_name(f".shared-{recipe.name}")
    built_recipe.write_text(yaml.safe_dump(data))
    built = planned_dir(stage, built_recipe)
    assert built.name == out.name  # the fingerprint does not depend on the workspace
    if not (built / "manifest.json").exists():
        run_inprocess(stage, built_recipe)
    if not out.exists():
        shutil.copytree(built, out)
    return run_inprocess(stage, recipe)


# Fields of metrics records and eval.json that measure time, speed or memory: no property of
# what was computed.
MEASURED = re.compile(
    r"time|_s$|seconds|share|per_s|flops|mfu|mem|rss|available|tok/s|latency|ttft|tpot|speed"
)


def _unmeasured(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _unmeasured(v) for k, v in obj.items() if not MEASURED.search(k)}
    if isinstance(obj, list):
        return [_unmeasured(v) for v in obj]
    return obj


def _relaunched(record: dict) -> bool:
    """A metrics record only a resumed launch writes."""
    kind = record.get("kind")
    return kind == "resume" or (kind == "start" and record.get("start_step", 0) > 0)


def artifact_digests(ws: Path, one_launch: bool = False) -> dict[str, str]:
    """What every sealed artifact of a workspace computed: sha256 of each file its manifest
    lists, with metrics records and evaluate's figures stripped of their timings, and the
    workspace's own path written out of the files that name it. Left out: logs, the manifest
    (its creation time and host facts) and the model card (it quotes measured speeds).
    `one_launch`: also leave out what tells a resumed launch from a first one (its `start`
    record, at a step > 0, and a `resume` record in metrics; whether the reference log-probs
    were a cache hit), so a stage killed and resumed reads as one launch."""
    out = {}
    for manifest in sorted((ws / "artifacts").glob("*/*/manifest.json")):
        folder = manifest.parent
        for rel in json.loads(manifest.read_text())["files"]:
            path = folder / rel
            if rel.startswith("logs/") or path.name == "README.md":
                continue
            data = path.read_bytes().replace(str(ws).encode(), b"<workspace>")
            if path.suffix == ".jsonl":
                records = [json.loads(line) for line in data.splitlines() if line.strip()]
                # Health samples come on a clock, the pre-flight measures the host.
                records = [r for r in records if r.get("kind") not in ("health", "preflight")]
                if one_launch:
                    records = [r for r in records if not _relaunched(r)]
                data = json.dumps(_unmeasured(records), sort_keys=True).encode()
            elif path.suffix == ".json":
                obj = json.loads(data)
                if one_launch and path.name == "reference.json":
                    obj.pop("precomputed", None)  # a hit of the table its killed launch sealed
                data = json.dumps(_unmeasured(obj), sort_keys=True).encode()
            key = f"{folder.parent.name}/{folder.name}/{rel}"
            out[key] = hashlib.sha256(data).hexdigest()
    return out


@dataclass
class Competitor:
    """A competing training job and the artifact lock this process holds for it."""

    proc: subprocess.Popen[bytes]
    hold: contextlib.ExitStack


def competing_training(folder: Path, env: dict[str, str], threads: int) -> Competitor:
    """A training job of its own on the same cores: TINY's ingest stage, whose causal-LM
    warm-up trains the base, as a real process in its own workspace under `folder`, for far
    more steps than any test waits (stop it with `stop_competing`). `threads`: as many as the
    job it competes with. The quickstart's ingest at 2 threads beside a 1-thread job ran its
    warm-up ~8x slower here (its OpenMP threads spin while one waits for a core); beside a
    2-thread job the tiny pipeline took ~2x its time alone."""
    import copy

    data = copy.deepcopy(TINY)
    data["ingest"]["from_config"]["pretrain_steps"] = 1_000_000
    data["infra"]["threads_per_rank"] = threads
    recipe = write_recipe(folder, data)
    hold = contextlib.ExitStack()
    spec = hold.enter_context(planned_launch("ingest", recipe))
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain.stages.ingest", "--spec", str(spec)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Competitor(proc, hold)


def stop_competing(competitor: Competitor) -> bool:
    """SIGKILL the competing job's process group; whether it was still running (it must have
    been, for the load to have been there all along)."""
    proc = competitor.proc
    running = proc.poll() is None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    competitor.hold.close()
    return running


def crash_after(out: Path, logged_steps: int, outputs: tuple[str, ...]) -> None:
    """Leave a finished training stage's folder as a crash after `logged_steps` would: no
    manifest, no `outputs` folders, metrics up to that step (its checkpoints stay)."""
    (out / "manifest.json").unlink()
    for d in outputs:
        shutil.rmtree(out / d)
    kept, counted = [], 0
    for line in (out / "metrics.jsonl").read_text().splitlines():
        # The start record and `logged_steps` records after it; the health sampler's records,
        # written on a clock rather than per step, come along without counting.
        if '"kind": "health"' not in line:
            if counted == 1 + logged_steps:
                break
            counted += 1
        kept.append(line)
    (out / "metrics.jsonl").write_text("\n".join(kept) + "\n")


def planned_dir(stage: str, recipe: Path, *overrides: str) -> Path:
    """The folder of the stage named `stage`, else of the recipe's one stage of that kind."""
    return _named(plan(load_recipe(recipe, list(overrides))).stages, stage, stage).out_dir


def _named(planned: list[PlannedStage], name: str, kind: str) -> PlannedStage:
    return ([s for s in planned if s.name == name] or [s for s in planned if s.kind == kind])[0]


def run_torchrun(
    stage: str,
    recipe: Path,
    nproc: int,
    *overrides: str,
    name: str | None = None,
    timeout: float = 300,
    module: str | None = None,
) -> subprocess.CompletedProcess:
    """The recipe's stage (as `run_inprocess` finds it) under `torchrun --standalone` with
    `nproc` ranks, this process its supervisor; `module`: another entry than the kind's."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    with planned_launch(stage, recipe, *overrides, name=name) as spec:
        assert spec is not None, "the stage is complete already: nothing would run"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            module or KINDS[stage].module,
            "--spec",
            str(spec),
        ]
        return subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )


def hand_planned(
    tmp_path: Path, module: str, infra: dict | None = None, **fields: object
) -> tuple[object, Path]:
    """An `sft` stage running `module` (a stand-in stage module), planned by hand on TINY with
    `infra` merged in, and its spec: for driving the supervisor (`stage_task.fn`) without a flow.
    `fields` are PlannedStage fields (nprocs, nnodes, hang_timeout_s, launcher...)."""
    import copy

    from posttrain.config.loader import resolve
    from posttrain.config.schema import Recipe
    from posttrain.plan.planner import spec_for
    from posttrain.runtime.spec import PlannedStage
    from posttrain.store.artifacts import stage_dir

    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"] |= {"threads_per_rank": 1, **(infra or {})}
    recipe = resolve(Recipe.model_validate(data))
    fp = "0123456789abcdef"
    stage = PlannedStage(
        **{
            "name": "sft",
            "module": module,
            "fingerprint": fp,
            "out_dir": stage_dir(tmp_path / "ws", "sft", fp),
            "parents": {},
            "nprocs": 1,
            "timeout_s": 240,
            "inputs": {"section": {}},
            "infra": recipe.infra.model_dump(mode="json"),
            **fields,
        }
    )
    return stage, spec_for(stage, recipe, {})


def slurm_sft_recipe(
    folder: Path, name: str, steps: int, checkpoint_every: int = 0, **infra: object
) -> Path:
    """TINY on the test Slurm cluster (tests/slurm_cluster.py): the SFT on 2 nodes x 1 process
    (global batch 8), every stage but ingest submitted as a job; `infra` merged in. No evaluate:
    the export after SFT is the 1-node job of a one-process stage, the other kind of job."""
    import copy

    data = copy.deepcopy(TINY)
    data["evaluate"] = None
    data["run"] |= {"name": name, "workspace": str(folder / "ws")}
    data["ingest"]["from_config"]["pretrain_steps"] = 10
    data["infra"] |= {
        "launcher": "slurm",
        "nnodes": 2,
        "devices_per_node": 1,
        "threads_per_rank": 1,
        "slurm": {"poll_s": 0.5},
        **infra,
    }
    data["sft"] |= {"max_steps": steps, "checkpoint_every": checkpoint_every}
    data["sft"]["batch"] = {"micro_batch_size": 4, "grad_accum_steps": 1}  # x 2 ranks = 8
    folder.mkdir(parents=True, exist_ok=True)
    return write_recipe(folder, data)
