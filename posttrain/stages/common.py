"""What every stage process shares: read the spec, set up ranks and seeds, run, write the manifest.

A stage module defines `run(ctx) -> summary` and ends with `stage_main(run)`; what kind it is
(and whether it is distributed) comes from the registry, by its module name. It is started
one way, by a supervisor (`flows.stage.supervise`: `posttrain run`, or
`posttrain launch STAGE recipe.yaml` for one stage by hand):
    (torchrun --nproc-per-node 2) python -m posttrain.stages.sft --spec <out_dir>/logs/spec.json
The supervisor holds the artifact's lock for the launch and has looked at the folder; the spec
names that lock (`launch.lock`), and a spec that names none is refused. Exit code 0 means the
manifest was written; anything else means the stage is not done.

Every rank beats `<out_dir>/logs/heartbeat/rank<k>.json` and dumps its Python stacks into
`<out_dir>/logs/stacks-rank<k>.txt` on SIGUSR1 (`posttrain.telemetry.heartbeat`), samples its
GPU, InfiniBand ports and storage reads into `<out_dir>/logs/health/rank<k>.json`
(`posttrain.telemetry.health`, every POSTTRAIN_HEALTH_INTERVAL_S seconds), and watches
the process that supervises it (`posttrain.runtime.orphan`): when it dies, the stage stops or
finishes alone, per `infra.orphan`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from posttrain import hub, numerics
from posttrain.config.schema import ResolvedRecipe
from posttrain.errors import ERROR_MARKER, ParentArtifactDamaged, RecipeVerdict, StageVerdict
from posttrain.kinds import KINDS, StageKind, kind_of
from posttrain.runtime.context import StageContext
from posttrain.runtime.exit import exit_without_collecting
from posttrain.runtime.orphan import OrphanWatch
from posttrain.runtime.recovery import recovery_record
from posttrain.runtime.spec import LaunchInfo, StageSpec, read_spec
from posttrain.store.artifacts import read_manifest, write_manifest
from posttrain.store.status import status
from posttrain.store.summary import Memory, Summary, read_summary
from posttrain.telemetry import health, heartbeat

log = logging.getLogger("posttrain")


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def verify_parents(ctx: StageContext) -> None:
    """Every parent artifact still matches its manifest and is the one this run planned with,
    or ParentArtifactDamaged. Runs before anything reads a parent: a truncated adapter would
    otherwise fail deep in safetensors, or, worse, a file altered in place would load silently."""
    t0, n_bytes = time.perf_counter(), 0
    for name, ref in ctx.parents.items():
        look = status(ref.path, ref.fingerprint, hashes=True)
        why = look.why
        if look.ref is not None and look.ref.sha256 != ref.sha256:
            why = "its manifest is not the one this run was planned with"
        if why:
            raise ParentArtifactDamaged(
                f"parent stage '{name}' artifact {ref.path} is damaged: {why}. Nothing was "
                f"loaded from it. Re-running the pipeline rebuilds '{name}' (its supervisor drops "
                "a manifest that no longer verifies and runs the stage again), then this stage."
            )
        files = (read_manifest(ref.path) or {}).get("files", {})
        n_bytes += sum(f["bytes"] for f in files.values())
    if ctx.parents:
        log.info(
            "parents %s verified (%.1f MiB, sha256) in %.2f s",
            ", ".join(ctx.parents),
            n_bytes / 2**20,
            time.perf_counter() - t0,
        )


def check_data_paths(ctx: StageContext) -> None:
    """Refuse a data path that names nothing before any model is loaded (as `validate` does)."""
    from posttrain.config.inputs_check import stage_data_problems
    from posttrain.data.loading import DataFileMissing

    if problems := stage_data_problems(ctx.recipe, ctx.stage.name):
        raise DataFileMissing("; ".join(problems))


def memory_preflight(ctx: StageContext) -> None:
    """Estimate a training stage's per-device memory before anything is loaded; refuse or warn
    per `infra.memory_preflight` (report in logs/preflight.json and `ctx.preflight`); then
    resolve the stage's token budget (`batch.by_tokens`, `auto` from the estimate) into
    `ctx.token_budget`."""
    from posttrain.runtime.preflight import enforce
    from posttrain.runtime.token_budget import resolve_token_budget, say, sized_report

    if ctx.kind is None or not ctx.kind.trains:
        return
    report = _preflight_report(ctx)
    batch = getattr(ctx.section, "batch", None)
    ctx.token_budget = resolve_token_budget(
        getattr(batch, "by_tokens", None), report, _step_rows(ctx)
    )
    say(ctx.token_budget)
    # auto: the verdict and the estimate the summary sets beside the peak are the budget's.
    report = sized_report(report, ctx.token_budget)
    if report is None:
        return
    ctx.preflight = report.record() | ctx.token_budget.record()
    if ctx.is_main:
        out = ctx.stage.out_dir / "logs" / "preflight.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**ctx.preflight, "report": report.text()}, indent=2))
    enforce(report, ctx.recipe.infra.memory_preflight)


def _preflight_report(ctx: StageContext) -> Any:
    """The pre-flight's PreflightReport of this stage, or None when `infra.memory_preflight`
    is off or the estimate does not describe the base."""
    from posttrain.runtime.preflight import preflight

    if ctx.recipe.infra.memory_preflight == "off":
        return None
    roles = [r for r in ("base", "teacher_base") if ctx.has_role(r)]  # a teacher: its own base
    dirs = {r: read_summary(ctx.role_dir(r)).model_dir for r in roles}
    try:
        report = preflight(
            ctx.recipe,
            ctx.stage.name,
            model_dir=dirs.get("base"),
            teacher_dir=dirs.get("teacher_base"),
        )
    except ValueError as exc:  # a base the estimate does not describe: never block on that
        log.warning("memory pre-flight skipped: %s", exc)
        return None
    return report


def _step_rows(ctx: StageContext) -> int:
    """Rows of the stage's batch one rank takes in one optimizer step (micro x accum)."""
    from posttrain.config.loader import section_batch

    batch = getattr(ctx.section, "batch", None)
    if batch is None:
        return 1
    if batch.micro_batch_size is None or batch.grad_accum_steps is None:
        batch = section_batch(ctx.recipe, ctx.stage.name)
    return (batch.micro_batch_size or 1) * (batch.grad_accum_steps or 1)


def measured_memory(ctx: StageContext) -> Memory:
    """The pre-flight estimate beside this process's measured peak: RSS on CPU (the whole
    process, as the estimate's framework row counts the runtime), reserved on GPU (what the
    caching allocator took from the device)."""
    import torch

    from posttrain.telemetry.metrics import fragmentation_warning, memory_snapshot

    assert ctx.preflight is not None
    device = ctx.dist.device if ctx.dist is not None else torch.device("cpu")
    snap = memory_snapshot(device)
    keys = ("estimate_gib", "capacity_gib", "fits", "by_tokens", "by_tokens_estimate_gib")
    out = {k: ctx.preflight[k] for k in keys if ctx.preflight.get(k) is not None}
    if device.type == "cuda":
        alloc, reserved = snap["mem_peak_allocated_gib"], snap["mem_peak_reserved_gib"]
        out |= {"measured": "peak reserved", "measured_peak_gib": round(reserved, 4)}
        out["peak_allocated_gib"] = round(alloc, 4)
        log.info("GPU memory: peak allocated %.3f GiB, peak reserved %.3f GiB", alloc, reserved)
        if warning := fragmentation_warning(alloc, reserved):
            log.warning("%s", warning)
    else:
        out |= {"measured": "peak RSS", "measured_peak_gib": round(snap["mem_peak_rss_gib"], 4)}
    if out["measured_peak_gib"]:
        out["estimate_over_measured"] = round(out["estimate_gib"] / out["measured_peak_gib"], 3)
    memory = Memory.model_validate(out)
    log.info(
        "memory: estimated %.3f GiB, measured %s %.3f GiB",
        memory.estimate_gib,
        memory.measured,
        memory.measured_peak_gib,
    )
    return memory


def _parse(kind: str, argv: list[str] | None) -> tuple[StageSpec, LaunchInfo]:
    ap = argparse.ArgumentParser(prog=f"python -m posttrain.stages.{kind}")
    ap.add_argument(
        "--spec", required=True, help="spec JSON written by its supervisor (posttrain.runtime.spec)"
    )
    spec = read_spec(ap.parse_args(argv).spec)
    if (launch := spec.launch) is None or launch.lock is None:
        # Only a supervisor that holds the artifact's lock has looked at the folder and may
        # let a process write it (flows.stage.supervise).
        raise SystemExit(
            f"stage {spec.stage.name}: its spec names no supervisor holding the artifact's lock; "
            f"run one stage with `posttrain launch {spec.stage.name} RECIPE`"
        )
    return spec, launch


def _own_kind(run: Callable[..., Any]) -> StageKind:
    """The kind of the stage module that defines `run` (`python -m` runs it as __main__)."""
    module = run.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else module
    return kind_of(module)


def emit_line(text: str, stream: Any = None) -> None:
    """Write one marker line (POSTTRAIN_ARTIFACT, POSTTRAIN_ERROR) in a single write: under
    torchrun every rank shares its supervisor's pipes, and `print` writes the text and the
    newline separately, so two ranks could glue their lines. One write of under PIPE_BUF
    (4 KiB) bytes to a pipe is atomic."""
    stream = stream or sys.stdout
    line = text + "\n"
    stream.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream (pytest capsys)
        stream.write(line)
        stream.flush()
        return
    data = line.encode()
    while data:  # a long line may need several writes; each is still whole for short ones
        data = data[os.write(fd, data) :]


def stage_main(
    run: Callable[[StageContext], dict[str, Any]],
    *,
    kind: str | None = None,
    distributed: bool | None = None,
    argv: list[str] | None = None,
) -> None:
    """Entry point of a stage process. Writes the manifest (rank 0) only after `run` returns.

    `kind`: default the registered kind whose module defines `run`; a name outside the registry
    (the promotion gate's head-to-head, test stand-ins) runs as a plain, local stage."""
    exit_without_collecting()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        force=True,
        format="%(asctime)s %(levelname)s [%(name)s] %(message)s",
    )
    registered = _own_kind(run) if kind is None else KINDS.get(kind)
    kind_name = registered.name if registered is not None else str(kind)
    if distributed is None:  # a kind named by the caller (a stand-in) runs locally unless told
        distributed = kind is None and registered is not None and registered.distributed
    spec, launch = _parse(kind_name, argv)
    ctx = _context(spec, registered, kind_name)
    # Hub ids read the commits the plan fingerprinted, even if a branch moved since.
    hub.pin(ctx.stage.inputs.get("hub", {}).values())
    ctx.stage.out_dir.mkdir(parents=True, exist_ok=True)
    # First thing: a stage whose supervisor died (while this process imported torch, say) must
    # not start, or must go on alone, per infra.orphan (posttrain.runtime.orphan).
    watch = OrphanWatch.start(ctx.stage.out_dir, ctx.stage.name, ctx.recipe.infra.orphan, launch)
    try:
        _run_and_seal(ctx, run, distributed, watch, launch)
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        _report_failure(ctx, exc)
        sys.exit(1)
    finally:
        if watch is not None:
            watch.stop()
        health.stop()
        heartbeat.stop()
        if distributed:
            from posttrain.distributed.runtime import shutdown

            shutdown()


def _context(spec: StageSpec, kind: StageKind | None, kind_name: str) -> StageContext:
    return StageContext(
        stage=spec.stage,
        kind=kind,
        recipe=ResolvedRecipe.model_validate(spec.recipe),
        parents=dict(spec.parents),
        kind_name=kind_name,
    )


def _start_ranks(ctx: StageContext, distributed: bool) -> None:
    """The process group (distributed stages) or the thread count, and quiet non-main ranks."""
    infra = ctx.recipe.infra
    if not distributed:
        if infra.threads_per_rank:
            import torch

            torch.set_num_threads(infra.threads_per_rank)
        return
    from posttrain.distributed.runtime import init_distributed

    ctx.dist = init_distributed(
        infra.device,
        infra.pg_timeout_s,
        infra.threads_per_rank,
        infra.layout,
        infra.sequence_parallel,
    )
    ctx.rank, ctx.world_size = ctx.dist.rank, ctx.dist.world_size
    mesh = ctx.dist.sp_mesh or ctx.dist.mesh  # with sequence parallelism: ("dp", "sp")
    log.info(
        "process group: world %d, layout %s, mesh %s %s",
        ctx.world_size,
        infra.layout,
        tuple(mesh.shape),
        mesh.mesh_dim_names,
    )
    if not ctx.is_main:  # one copy of the progress log, not one per rank
        logging.getLogger().setLevel(logging.WARNING)


def _run_and_seal(
    ctx: StageContext,
    run: Callable[[StageContext], dict[str, Any]],
    distributed: bool,
    watch: OrphanWatch | None,
    launch: LaunchInfo,
) -> None:
    """Check the parents and memory, start the ranks, run the stage, seal its artifact."""
    # Before the process group exists: torchrun's RANK says which process writes the report.
    ctx.rank = int(os.environ.get("RANK", "0"))
    # Before reading any parent. Rank 0 only: a failing rank ends the whole torchrun launch,
    # and N ranks hashing the same files would only multiply the reads.
    if ctx.is_main:
        verify_parents(ctx)
        check_data_paths(ctx)
    # Before loading anything: a stage that cannot fit fails here, in seconds.
    memory_preflight(ctx)
    # What an earlier attempt left: the supervisor's account, read before this launch cleared
    # its heartbeats (posttrain.runtime.recovery).
    account = launch.earlier_attempt if ctx.is_main else None
    if account:
        log.warning("%s", account)
    _start_ranks(ctx, distributed)
    say_reproducibility(ctx)
    # After the process group is up (its rendezvous may legitimately wait for other nodes):
    # the supervisor's hang watch arms on this first beat.
    heartbeat.start(ctx.stage.out_dir, ctx.rank)
    # Beside it, the rank's device and host health (logs/health/); rank 0's MetricsWriter
    # registers itself with the sampler when the stage opens it.
    health.start(ctx.stage.out_dir, ctx.rank, ctx.dist.device if ctx.dist is not None else None)
    seed_everything(ctx.recipe.run.seed)
    if ctx.is_main:
        (ctx.stage.out_dir / "config.json").write_text(
            json.dumps(
                {"stage": ctx.stage.name, "inputs": ctx.stage.inputs}, indent=2, sort_keys=True
            )
        )
    log.info(
        "stage %s fingerprint %s -> %s (rank %d/%d)",
        ctx.stage.name,
        ctx.stage.fingerprint,
        ctx.stage.out_dir,
        ctx.rank,
        ctx.world_size,
    )
    summary = run(ctx)
    heartbeat.beat(phase="finish")
    if distributed:
        import torch.distributed as dist

        dist.barrier()
    if ctx.is_main:
        _seal(ctx, summary, watch, account)


def _seal(
    ctx: StageContext, returned: dict[str, Any], watch: OrphanWatch | None, account: str | None
) -> None:
    """Write the manifest, last, and say so on stdout (rank 0). `run`'s summary is validated
    first: one the flow could not read fails here, before anything is sealed."""
    if watch is not None:
        # A last look before sealing: with infra.orphan=stop an orphan ends here without a
        # manifest (its supervisor's lock is gone); with finish it has taken the lock over.
        watch.check()
    summary = Summary.model_validate(returned)
    if ctx.preflight is not None:
        summary = summary.model_copy(update={"memory": measured_memory(ctx)})
    if recovery := recovery_record(account, summary):
        summary = summary.model_copy(update={"recovery": recovery})
    sealed = summary.model_dump(exclude_unset=True)  # what was set: no default is added
    ref = write_manifest(
        ctx.stage.out_dir,
        stage=ctx.kind_name,
        fp=ctx.stage.fingerprint,
        parents=[p.fingerprint for p in ctx.parents.values()],
        section=ctx.stage.inputs,
        seed=ctx.recipe.run.seed,
        summary=sealed,
        extra={**ctx.extra_manifest, **numerics_record(ctx)},
    )
    log.info("stage %s done: %s", ctx.stage.name, json.dumps(sealed, default=str)[:2000])
    emit_line(f"POSTTRAIN_ARTIFACT {ref.model_dump_json()}")


def numerics_record(ctx: StageContext) -> dict[str, Any]:
    """The manifest's `numerics` (signature, reproducibility); none for a process that never
    imported torch (a stand-in does no arithmetic)."""
    if "torch" not in sys.modules:
        return {}
    return {"numerics": {"signature": ctx.numerics(), "reproducibility": reproducibility(ctx)}}


def say_reproducibility(ctx: StageContext) -> None:
    """One log line (rank 0) when a re-run of this stage will not give the same bits."""
    if ctx.is_main and "torch" in sys.modules and not (v := reproducibility(ctx))["bit_exact"]:
        log.info("numerics: a re-run will not give the same bits: %s", v["why"])


def reproducibility(ctx: StageContext) -> dict[str, Any]:
    """`numerics.reproducibility`, or not bit-exact for rollouts from a serving engine."""
    rollout = getattr(ctx.section, "rollout", None) if ctx.kind is not None else None
    if getattr(rollout, "engine", None) == "server":
        return {
            "bit_exact": False,
            "why": "rollouts from a serving engine: its batching follows request timing and "
            "does not honour seeds",
        }
    return numerics.reproducibility(ctx.device_type)


def _report_failure(ctx: StageContext, exc: BaseException) -> None:
    """logs/error.txt (rank 0), one POSTTRAIN_ERROR line, a traceback only when unexpected."""
    from posttrain.runtime.diskspace import as_disk_full
    from posttrain.runtime.preflight import MemoryPreflightError

    if isinstance(exc, RecipeVerdict) and exc.section is None:
        exc.section = ctx.where  # `batch.padding_free` -> `dpo.batch.padding_free`
    tb = traceback.format_exc()
    # A full disk, wherever it struck (a json write, save_pretrained), is a verdict too.
    exc = as_disk_full(exc, f"stage {ctx.stage.name}'s output") or exc
    # A refusal or another known condition is a verdict, not a bug: its message, without a
    # traceback on stderr (logs/error.txt keeps it, after the message).
    known = isinstance(exc, MemoryPreflightError | StageVerdict)
    if ctx.is_main:
        text = str(exc) if isinstance(exc, MemoryPreflightError) else tb
        if isinstance(exc, StageVerdict):
            text = f"{exc}\n\n{tb}"
        err = ctx.stage.out_dir / "logs" / "error.txt"
        try:
            err.parent.mkdir(parents=True, exist_ok=True)
            err.write_text(text)
        except OSError:  # the disk may be the problem: the verdict below still goes out
            pass
    if not known:  # a verdict's text is in the line below
        print(tb, file=sys.stderr, flush=True)
    emit_line(f"{ERROR_MARKER}{ctx.stage.name} failed: {type(exc).__name__}: {exc}", sys.stderr)
