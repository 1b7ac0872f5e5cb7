"""The command line and environment a stage process is started with.

One process runs `python -m <stage module> --spec <spec.json>`; several ranks run under torchrun,
on one node or meeting at a rendezvous across nodes. The environment carries the launch marker
(`flows.stage_procs` finds and kills the launch's processes by it), the locks the launcher holds
(so the stage does not wait for its own launcher) and who launched it (`posttrain.orphan`).
"""

from __future__ import annotations

import contextvars
import os
import site
import sys
from pathlib import Path

from prefect.context import FlowRunContext

import posttrain
from flows.stage_procs import FLOW_RUN_ENV_VAR, LAUNCH_ENV_VAR
from posttrain import hub
from posttrain.device_lock import HELD_ENV as DEVICE_LOCK_ENV
from posttrain.locking import LOCK_HELD_ENV
from posttrain.orphan import LAUNCHER_BEAT_ENV, LAUNCHER_SILENCE_ENV, launcher_env
from posttrain.planner import PlannedStage
from posttrain.recovery import EARLIER_ATTEMPT_ENV

# The artifact lock this thread's `supervise_stage` (flows.stage_supervise) holds, passed to the
# stage process it starts (LOCK_HELD_ENV) so the process does not wait for its own launcher. A
# context variable, not os.environ: several stages may be supervised at once from threads of one
# process.
HELD_ARTIFACT_LOCK: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "posttrain_held_lock", default=None
)
# The device lock file (posttrain.device_lock) the flow holds, passed to its stage processes so
# an orphaned stage that goes on (infra.orphan=finish) can take the devices over.
HELD_DEVICE_LOCK: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "posttrain_device_lock", default=None
)
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
    """The command line that runs one stage on this node.

    One process: `python -m <module>`. Several on one node: `torchrun --standalone`. Several
    nodes: every node runs `torchrun --nnodes N --node-rank K` and they meet at the c10d
    rendezvous on `rdzv_endpoint` (hosted by the agent whose endpoint host is local, normally
    node rank 0) under `rdzv_id` (the stage fingerprint: every node derives the same one).

    A remote launcher, which learns a node's rank and the first node's address only when the
    job runs, passes them as text the engine expands on each node (`$SLURM_PROCID`,
    `$(POSTTRAIN_NODE_RANK)`): same command, every node.
    """
    stage_args = ["-m", module, "--spec", str(spec_path)]
    if nnodes <= 1 and nprocs <= 1:
        return [python, *stage_args]
    launcher = [python, "-m", "torch.distributed.run"]
    if nnodes <= 1:
        return [*launcher, "--standalone", "--nproc-per-node", str(nprocs), *stage_args]
    if not rdzv_endpoint:
        raise ValueError("a multi-node stage needs a rendezvous endpoint (infra.rdzv_endpoint)")
    if isinstance(node_rank, int) and not 0 <= node_rank < nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{nnodes - 1}")
    return [
        *launcher,
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nprocs),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        rdzv_id,
        *stage_args,
    ]


def stage_markers(launch_id: str, earlier_attempt: str | None = None) -> dict[str, str]:
    """What every process of one launch carries, wherever it runs: the fixed settings, the
    launch marker, the offline switch, the earlier attempt's account, the artifact lock the
    launcher holds and the flow run's id.

    `earlier_attempt`: the launcher's account of an unfinished earlier attempt of this stage
    (`posttrain.recovery`), for the stage's summary: the launcher reads it before it clears
    the old heartbeats, which the stage then can no longer see."""
    env = dict(CHILD_ENV)
    # Offline exactly when the launcher is (posttrain.hub.offline): a hub id the plan resolved
    # online is downloaded by the stage that reads it.
    env["HF_HUB_OFFLINE"] = "1" if hub.offline() else "0"
    env[LAUNCH_ENV_VAR] = launch_id
    if earlier_attempt:
        env[EARLIER_ATTEMPT_ENV] = earlier_attempt
    if held := HELD_ARTIFACT_LOCK.get():
        env[LOCK_HELD_ENV] = held
    if flow_run_id := current_flow_run_id():
        env[FLOW_RUN_ENV_VAR] = flow_run_id
    return env


def child_env(
    launch_id: str,
    base: dict[str, str] | None = None,
    earlier_attempt: str | None = None,
    visible_devices: str | None = None,
) -> dict[str, str]:
    """A local stage's environment: ours (less an outer launch's markers), its markers
    (`stage_markers`), the device lock and this process as its launcher, and the project on
    PYTHONPATH (`project_pythonpath`)."""
    env = dict(os.environ if base is None else base)
    for inherited in (EARLIER_ATTEMPT_ENV, LOCK_HELD_ENV, DEVICE_LOCK_ENV):
        env.pop(inherited, None)
    env.update(stage_markers(launch_id, earlier_attempt))
    if visible_devices is not None:  # one of several stages running side by side
        env["CUDA_VISIBLE_DEVICES"] = visible_devices
    if device_lock := HELD_DEVICE_LOCK.get():
        env[DEVICE_LOCK_ENV] = device_lock
    # Who launched the stage, so it notices when its launcher is gone (posttrain.orphan).
    env.update(launcher_env())
    return project_pythonpath(env)


def project_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """`env` with the folder holding the `posttrain` package first on PYTHONPATH, when the
    project is used from a checkout (not installed), so `python -m posttrain...` works from any
    working directory, on this machine or a node sharing its file system."""
    root = str(Path(posttrain.__file__).resolve().parent.parent)
    if root not in site.getsitepackages():
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def remote_env(
    launch_id: str, beat_file: Path, silence_s: float, earlier_attempt: str | None = None
) -> dict[str, str]:
    """The variables of a stage an engine (Slurm, Kubernetes) runs on other machines: its
    markers (`stage_markers`), without what only means something here (this machine's PID as
    the launcher, its device lock, its GPU numbering), plus the beat file the flow rewrites
    while it follows the stage (the stage's orphan watch reads it instead of a PID)."""
    env = stage_markers(launch_id, earlier_attempt)
    env[LAUNCHER_BEAT_ENV] = str(beat_file)
    env[LAUNCHER_SILENCE_ENV] = f"{silence_s:g}"
    return env


def launch_env(stage: PlannedStage, launch_id: str, earlier_attempt: str | None) -> dict[str, str]:
    """The environment of one launch of `stage`, local or remote (`stage.launcher`)."""
    if stage.launcher == "local":
        return child_env(
            launch_id, earlier_attempt=earlier_attempt, visible_devices=stage.visible_devices
        )
    beat = stage.out_dir / "logs" / "launcher.beat"
    return remote_env(launch_id, beat, float(stage.infra["launcher_silence_s"]), earlier_attempt)


def launch_labels() -> dict[str, str]:
    """What an engine tags a launch with so it can be found without this process: the flow
    run's id (the flow's cancel and crash hooks cancel every job carrying it)."""
    flow_run_id = current_flow_run_id()
    return {"flow-run": flow_run_id} if flow_run_id else {}


def current_flow_run_id() -> str | None:
    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
