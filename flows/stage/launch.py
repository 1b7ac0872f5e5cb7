"""The command line, environment and launch record a stage process is started with.

One process runs `python -m <stage module> --spec <spec.json>`; several ranks run under torchrun,
on one node or meeting at a rendezvous across nodes. What the stage needs to know about its
launch (the lock its supervisor holds, who to watch) goes into its spec (`launch_info`,
`posttrain.runtime.spec`); the environment carries only the fixed settings and the launch's tag,
by which `flows.stage.procs` finds and stops the launch's processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import site
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect.context import FlowRunContext

import posttrain
from posttrain import hub
from posttrain.runtime.device_lock import DeviceLock
from posttrain.runtime.orphan import process_start
from posttrain.runtime.spec import LAUNCH_TAG_ENV, LaunchInfo, PlannedStage

# The device lock file (posttrain.runtime.device_lock) the flow holds, named in its stages' specs so
# an orphaned stage that goes on (infra.orphan=finish) can take the devices over. A context
# variable: several stages may be supervised at once from threads of one flow.
HELD_DEVICE_LOCK: contextvars.ContextVar[DeviceLock | None] = contextvars.ContextVar(
    "posttrain_device_lock", default=None
)
# True while a run reuses its stages without holding the devices: a stage that must run after
# all raises DevicesNeeded instead of launching. A context variable: stages side by side are
# supervised from threads that copy the flow's context.
REUSE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "posttrain_reuse_only", default=False
)


class DevicesNeeded(Exception):
    """A stage must run while its run holds no devices (`REUSE_ONLY`)."""


@contextlib.contextmanager
def reuse_only() -> Iterator[None]:
    """Within: a stage that would launch raises DevicesNeeded (flows.stage.supervise)."""
    token = REUSE_ONLY.set(True)
    try:
        yield
    finally:
        REUSE_ONLY.reset(token)


CHILD_ENV = {
    # Line-buffered output, so the log and Prefect see lines as they happen.
    "PYTHONUNBUFFERED": "1",
    # tokenizers' thread pool warns and can deadlock after fork (DataLoader workers).
    "TOKENIZERS_PARALLELISM": "false",
}

NODE_RANK_ENV = "POSTTRAIN_NODE_RANK"


def node_rank(env: dict[str, str] | None = None) -> int:
    """This machine's node rank for multi-node stages (POSTTRAIN_NODE_RANK, default 0)."""
    value = (os.environ if env is None else env).get(NODE_RANK_ENV, "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{NODE_RANK_ENV} must be an integer, got {value!r}") from None


def stage_command(
    module: str,
    spec_path: Path | str,
    nprocs: int,
    python: str = sys.executable,
    nnodes: int = 1,
    node_rank: int | str = 0,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "posttrain",
) -> list[str]:
    """The command line that runs one stage on this node: `python -m <module>`, `torchrun
    --standalone` for several processes, and for several nodes torchrun meeting at the c10d
    rendezvous `rdzv_endpoint` under `rdzv_id` (the fingerprint: every node derives it). A
    remote launcher passes the rank and endpoint as text the engine expands on each node
    (`$SLURM_PROCID`, `$(POSTTRAIN_NODE_RANK)`): the same command on every node."""
    stage_args = ["-m", module, "--spec", str(spec_path)]
    if nnodes <= 1 and nprocs <= 1:
        return [python, *stage_args]
    torchrun = [python, "-m", "torch.distributed.run"]
    if nnodes <= 1:
        return [*torchrun, "--standalone", "--nproc-per-node", str(nprocs), *stage_args]
    if not rdzv_endpoint:
        raise ValueError("a multi-node stage needs a rendezvous endpoint (infra.rdzv_endpoint)")
    if isinstance(node_rank, int) and not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
    nodes = ["--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return [*torchrun, *nodes, "--nproc-per-node", str(nprocs), *rdzv, *stage_args]


def planned_stage_command(
    stage: PlannedStage, spec_path: Path | str, node_rank: int | str, rdzv: str | None, **kw: Any
) -> list[str]:
    """`stage_command` for a planned stage (its module, processes, nodes and fingerprint)."""
    kw = {"nnodes": stage.nnodes, "node_rank": node_rank, "rdzv_endpoint": rdzv, **kw}
    return stage_command(stage.module, spec_path, stage.nprocs, rdzv_id=stage.fingerprint, **kw)


def launch_info(
    stage: PlannedStage, launch_id: str, lock: str, earlier_attempt: str | None
) -> LaunchInfo:
    """How this launch of `stage` is held, for its spec: its id, the artifact lock (node 0's),
    the flow's device lock, the earlier attempt's account, and what the stage watches to notice
    that its supervisor is gone (its PID here, a beat file for an engine's remote nodes)."""
    if devices := HELD_DEVICE_LOCK.get():
        # A run waiting for these devices tells its user which stage holds them, and how far.
        devices.update(stage=stage.name, out_dir=str(stage.out_dir))
    info = LaunchInfo(
        id=launch_id,
        flow_run_id=current_flow_run_id(),
        lock=lock,
        device_lock=str(devices.path) if devices and stage.launcher == "local" else None,
        earlier_attempt=earlier_attempt,
    )
    if stage.launcher == "local":
        info.supervisor_pid, info.supervisor_start = os.getpid(), process_start()
    else:
        info.beat_file = str(stage.out_dir / "logs" / "supervisor.beat")
        info.silence_s = float(stage.infra["supervisor_silence_s"])
    return info


def local_env(
    launch: LaunchInfo, base: dict[str, str] | None = None, visible_devices: str | None = None
) -> dict[str, str]:
    """Ours, with `launch_env` over it, the stage's GPUs when stages share the machine, and the
    project on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env.update(launch_env(launch))
    if visible_devices is not None:  # one of several stages running side by side
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    return project_pythonpath(env)


def launch_env(launch: LaunchInfo) -> dict[str, str]:
    """What every process of a launch sees wherever it runs; the rest is in its spec."""
    env = dict(CHILD_ENV)
    # Offline exactly when the supervisor is (posttrain.hub.offline): a hub id the plan
    # resolved online is downloaded by the stage that reads it.
    env["HF_HUB_OFFLINE"] = "1" if hub.offline() else "0"
    env[LAUNCH_TAG_ENV] = launch.tag()
    return env


def project_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """`env` with a checkout's (not installed) project first on PYTHONPATH, so `python -m
    posttrain...` works from any folder, here or on a node sharing the file system."""
    root = str(Path(posttrain.__file__).resolve().parent.parent)
    if root not in site.getsitepackages():
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def launch_labels() -> dict[str, str]:
    """The flow run's id, which an engine tags a launch with: the flow's cancel and crash hooks
    cancel every job carrying it."""
    flow_run_id = current_flow_run_id()
    return {"flow-run": flow_run_id} if flow_run_id else {}


def current_flow_run_id() -> str | None:
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
