"""Stages on a real Slurm cluster (tests/slurm_cluster.py: slurmctld, munged and two slurmd
nodes, each in its own network namespace, started on this machine).

In file order, on one cluster:
  1. a 2-node SFT through the flow (`posttrain run`, infra.launcher slurm): the flow killed
     outright leaves its job running, the next run (waiting on the device lock meanwhile)
     stops it and resumes; a node that fails
     mid-stage fails the stage with Slurm's reason; the re-run resumes from the newest
     checkpoint and finishes, with the same losses as the local launcher's 2-process
     torchrun; nothing is left in the queue;
  2. a UI cancel (the flow run set to Cancelling through the Prefect API) of a served run whose
     SFT runs on Slurm leaves nothing in the queue and no process of the stage;
  3. a flow killed outright: its job notices the silent beat file and stops by itself;
  4. a hung rank on the second node: stacks dumped through Slurm, the job cancelled;
  5. the flow's cancel hook finds a run's jobs by their label.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from prefect_server import cancel_from_ui, serving, start_serve, stop_group, wait_for
from stage_modules import on_child_path, write_heartbeat_modules

from flows.stage.procs import tagged_processes
from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan
from posttrain.runtime.spec import tag_flow_run_id, tag_launch_id
from posttrain.store.artifacts import verify
from posttrain.telemetry.health.sampler import read_health
from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import (
    ROOT,
    hand_planned,
    run_shared,
    run_torchrun,
    slurm_sft_recipe,
    write_recipe,
)

pytestmark = pytest.mark.slow

POSTTRAIN = [sys.executable, "-m", "flows.cli"]
RUN_TIMEOUT_S = 420
# Long enough that a killed flow's job is still training when the next run, waiting on the
# device lock, takes over, and that run's own job when its node is downed: both happen within
# ~1 s (4-5 steps) of the first checkpoint (step 4), 28 steps (~6 s) before the job's end.
# Each step more is trained by the resumed job and the local torchrun alike.
STEPS = 32


def _stage(recipe: Path, name: str = "sft") -> Any:
    return {s.name: s for s in plan(load_recipe(recipe)).stages}[name]


def _env(cluster: Any, server: Any) -> dict[str, str]:
    return {**os.environ, **server.env, **cluster.env, "HF_HUB_OFFLINE": "1"}


def _queue(cluster: Any) -> list[str]:
    return cluster.client("squeue", "--noheader", "--format=%i %T").split("\n")[:-1]


@pytest.fixture(autouse=True)
def _empty_queue(slurm_cluster: Any) -> None:
    """The cluster is the session's (tests/slurm_cluster.py): each test here starts once the
    jobs of an earlier test, here or in another module, have left the queue."""
    wait_for("an empty queue before the test", lambda: not _queue(slurm_cluster), 60)


def _start_run(
    recipe: Path, env: dict[str, str], log: Path, *overrides: str
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*POSTTRAIN, "run", str(recipe), *overrides],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _losses(out_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out_dir / "metrics.jsonl") if r.get("kind") == "train"]


def _checkpoints(out_dir: Path) -> list[str]:
    folder = out_dir / "checkpoints"
    return sorted(p.name for p in folder.glob("step_*") if not p.name.endswith(".tmp"))


def _local_run(recipe: Path, local: Path, store: Path) -> Any:
    """The recipe's SFT under the local launcher, uninterrupted (torchrun, 2 processes): its
    planned stage."""
    local.mkdir()
    data = load_recipe(recipe).model_dump(mode="json")
    data["run"]["workspace"] = str(local / "ws")
    data["infra"] |= {"launcher": "local", "nnodes": 1, "devices_per_node": 2}
    # Uninterrupted: no checkpoint is read (`checkpoint_every` is outside the fingerprint).
    data["sft"]["checkpoint_every"] = 0
    local_recipe = write_recipe(local, data)
    run_shared("ingest", local_recipe, store)  # the Slurm runs' ingest, copied
    done = run_torchrun("sft", local_recipe, 2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _stage(local_recipe)


def _kill_the_holder_under_a_waiting_run(
    recipe: Path, env: dict[str, str], sft: Any, tmp_path: Path
) -> tuple[subprocess.Popen[bytes], Path, dict[str, Any]]:
    """Two runs of `recipe` start at once: the one that takes the devices (run 1) is SIGKILLed
    once its job has written a checkpoint, while the other (run 2) waits on the device lock, so
    run 2 takes over the moment run 1 dies and finds its job still training, however fast the
    steps go. Run 2, its log, and run 1's launch record."""
    logs = [tmp_path / "run1.log", tmp_path / "run2.log"]
    runs = [_start_run(recipe, env, path) for path in logs]

    def holder() -> tuple[int] | None:
        held = [i for i, path in enumerate(logs) if "holding posttrain-devices" in path.read_text()]
        return (held[0],) if held else None

    (first,) = wait_for("a run to hold the devices", holder, 240, every=0.2)
    second = 1 - first
    waiting = "held by another run"
    wait_for("run 2 to wait for the devices", lambda: waiting in logs[second].read_text(), 240)
    wait_for("a first checkpoint", lambda: _checkpoints(sft.out_dir), 240, every=0.2)
    earlier = json.loads((sft.out_dir / "logs" / "launch.json").read_text())
    os.killpg(runs[first].pid, signal.SIGKILL)
    runs[first].wait()
    return runs[second], logs[second], earlier


def test_two_node_sft_on_slurm_recovers_and_trains_the_local_launchers_losses(
    slurm_cluster: Any, prefect_server: Any, shared_parents: Path, tmp_path: Path
) -> None:
    """Run 1 is SIGKILLed (its job goes on), run 2 stops that job and resumes, then loses a
    node, run 3 resumes and finishes: the losses equal one uninterrupted local torchrun's."""
    recipe = slurm_sft_recipe(tmp_path / "slurm", "onslurm", steps=STEPS, checkpoint_every=4)
    run_shared("ingest", recipe, shared_parents)  # reused by every run: SFT is what is watched
    env = _env(slurm_cluster, prefect_server)
    sft = _stage(recipe)

    # Run 1 is killed outright (SIGKILL: no cleanup) once a checkpoint exists; its job goes on.
    second, log, earlier = _kill_the_holder_under_a_waiting_run(recipe, env, sft, tmp_path)
    assert _queue(slurm_cluster), "the killed flow's job still runs"

    # Run 2 finds that job and stops it before launching its own; then node n2 fails.
    wait_for(
        "run 2's own job",
        lambda: (
            json.loads((sft.out_dir / "logs" / "launch.json").read_text())["launch_id"]
            != earlier["launch_id"]
        ),
        120,
    )
    # Stopped by run 2, not by itself: its beat file's silence limit (120 s) is far off.
    info = slurm_cluster.client("scontrol", "-o", "show", "job", earlier["job"]["job_id"])
    assert "JobState=CANCELLED" in info
    wait_for("run 2 to train", lambda: "resumed from step_" in _last_launch(sft), 240, every=0.2)
    slurm_cluster.client(
        "scontrol", "update", "nodename=n2", "state=down", "reason=test: node lost"
    )
    try:
        assert second.wait(RUN_TIMEOUT_S) != 0
        text = log.read_text()
        assert "was ended by Slurm: job" in text and "NODE_FAIL, it lost a node" in text, text
        assert "Traceback" not in text
    finally:
        slurm_cluster.client("scontrol", "update", "nodename=n2", "state=resume")
        slurm_cluster.wait_idle(60)
    assert _queue(slurm_cluster) == []
    kept = _checkpoints(sft.out_dir)
    assert kept, "the checkpoints of the failed runs are kept"

    # Run 3 resumes from the newest of them and finishes on both nodes; its own checkpoints
    # would be read by no one (`checkpoint_every` is outside the fingerprint).
    log = tmp_path / "run3.log"
    third = _start_run(recipe, env, log, "sft.checkpoint_every=0")
    assert third.wait(RUN_TIMEOUT_S) == 0, log.read_text()[-4000:]
    assert verify(sft.out_dir)[0]
    last = _last_launch(sft)
    assert f"resumed from {kept[-1]}" in last
    # The account of the failed attempt says who ended it.
    assert "it failed (ended by Slurm: job" in log.read_text()
    # The one-process stage after it ran as a 1-node job (its record: the log says "is running"
    # only after the job waited in the queue, which an idle cluster may not make it do).
    export_job = json.loads((_stage(recipe, "export").out_dir / "logs" / "launch.json").read_text())
    assert export_job["job"]["nnodes"] == "1" and export_job["job"]["job_id"]
    job = json.loads((sft.out_dir / "logs" / "launch.json").read_text())["job"]["job_id"]
    assert f"Slurm job {job} (2 nodes)" in last and "rendezvous at n1:" in last
    assert "[node 0] " in last and "[node 1] " in last  # both agents' lines, labelled
    info = slurm_cluster.client("scontrol", "-o", "show", "job", job)
    assert "JobState=COMPLETED" in info and "NodeList=n[1-2]" in info
    assert _queue(slurm_cluster) == []
    # Both nodes' ranks left their health samples in the shared workspace, where the flow's
    # Prometheus endpoint reads them (flows.trackers.exposition): no port on the nodes.
    health = read_health(sft.out_dir)
    assert set(health) == {0, 1}, health
    assert all(h["sources"]["io"] == "present" and h["node"] for h in health.values())

    # The same stage under the local launcher, uninterrupted: torchrun, 2 processes here.
    local_sft = _local_run(recipe, tmp_path / "local", shared_parents)
    assert local_sft.fingerprint == sft.fingerprint  # where it ran is not what it computed
    slurm_losses, local_losses = _losses(sft.out_dir), _losses(local_sft.out_dir)
    assert len(slurm_losses) == STEPS
    assert slurm_losses == pytest.approx(local_losses, rel=1e-5, abs=1e-6)


def test_ui_cancel_of_a_slurm_stage_leaves_nothing_in_the_queue(
    slurm_cluster: Any, prefect_server: Any, shared_parents: Path, tmp_path: Path
) -> None:
    from prefect.client.orchestration import SyncPrefectClient

    recipe = slurm_sft_recipe(tmp_path / "served", "slurmserved", steps=5000)
    run_shared("ingest", recipe, shared_parents)  # reused: the SFT on Slurm is what is cancelled
    env = {**prefect_server.env, **slurm_cluster.env}
    log_path = tmp_path / "serve.log"
    serve = start_serve([str(recipe)], env, log_path)
    client = SyncPrefectClient(prefect_server.api_url)
    try:
        deployment = serving(
            serve,
            log_path,
            lambda: wait_for(
                "the deployment",
                lambda: next(
                    (d for d in client.read_deployments() if d.name == "slurmserved"), None
                ),
                120,
            ),
        )
        run = client.create_flow_run_from_deployment(deployment.id)
        sft = _stage(recipe)
        # Running on both nodes: each rank has written a training record.
        wait_for(
            "the Slurm SFT to train",
            lambda: len(_losses(sft.out_dir)) >= 2 and _queue(slurm_cluster),
            240,
        )
        job = json.loads((sft.out_dir / "logs" / "launch.json").read_text())
        cancel_from_ui(client, run.id)
        assert _queue(slurm_cluster) == []
        info = slurm_cluster.client("scontrol", "-o", "show", "job", job["job"]["job_id"])
        assert "JobState=CANCELLED" in info
        # No process of the stage on any node, nor of the flow run.
        wait_for(
            "the stage's processes to exit",
            lambda: (
                not tagged_processes(lambda t: tag_launch_id(t) == job["launch_id"])
                and not tagged_processes(lambda t: tag_flow_run_id(t) == str(run.id))
            ),
            30,
        )
        assert serve.poll() is None, "the serve process must survive a cancel"
    finally:
        stop_group(serve)


def _stage_log(stage: Any) -> str:
    path = stage.out_dir / "logs" / "stage.log"
    return path.read_text() if path.exists() else ""


def _last_launch(stage: Any) -> str:
    """The stage log from its newest launch line on."""
    return _stage_log(stage).rsplit("\n=== ", 1)[-1]


def test_a_killed_flows_job_stops_by_itself(
    slurm_cluster: Any, prefect_server: Any, shared_parents: Path, tmp_path: Path
) -> None:
    recipe = slurm_sft_recipe(
        tmp_path / "orphan", "orphaned", steps=5000, checkpoint_every=4, supervisor_silence_s=10
    )
    run_shared("ingest", recipe, shared_parents)  # reused: the SFT on Slurm is what is orphaned
    sft = _stage(recipe)
    run = _start_run(recipe, _env(slurm_cluster, prefect_server), tmp_path / "run.log")
    wait_for("the Slurm SFT to train", lambda: len(_losses(sft.out_dir)) >= 2, 240)
    job = json.loads((sft.out_dir / "logs" / "launch.json").read_text())
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    t0 = time.monotonic()
    wait_for("the orphaned job to leave the queue", lambda: not _queue(slurm_cluster), 90)
    assert time.monotonic() - t0 >= 5  # it ran on after the kill, until the beat went silent
    assert "its supervisor is gone" in _stage_log(sft)
    assert not tagged_processes(lambda t: tag_launch_id(t) == job["launch_id"])

    # Nor, once Slurm has cleaned up, a step daemon of the job on a node.
    def step_daemons() -> list[psutil.Process]:
        return [
            p
            for p in psutil.process_iter(["name", "cmdline", "status"])
            if p.info["name"] == "slurmstepd"
            and p.info["status"] != psutil.STATUS_ZOMBIE
            and job["job"]["job_id"] in " ".join(p.info["cmdline"] or [])
        ]

    wait_for("the job's step daemons to exit", lambda: not step_daemons(), 30)


def test_a_hung_rank_on_slurm_is_dumped_and_the_job_cancelled(
    slurm_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hang watch reads the heartbeats on the shared workspace, as for a local stage; the
    stacks come from SIGUSR1 through `scancel --signal`."""
    from flows.stage.hang import StageHung
    from flows.stage.task import stage_task

    on_child_path(tmp_path / "mods", monkeypatch)
    write_heartbeat_modules(tmp_path / "mods")  # rank 1 of pt_stuck_sft stops at step 3
    monkeypatch.setenv("PT_PIDS_FILE", str(tmp_path / "pids"))
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    stage, spec = _direct_stage(tmp_path, "pt_stuck_sft", hang_timeout_s=4.0)
    with pytest.raises(StageHung) as info:
        stage_task.fn(stage, spec, kill_grace_s=1.0)
    assert (info.value.hang.behind.rank, info.value.hang.behind.step) == (1, 2)
    stacks = stage.out_dir / "logs" / "stacks-rank1.txt"
    assert "wait_for_nothing_forever" in stacks.read_text()  # written on node n2
    assert "rank 1 is behind: last beat at step 2" in str(info.value)
    assert _queue(slurm_cluster) == []
    # No rank outlived the job: the USR1 did not kill torchrun's agent and orphan its ranks
    # (which a process-tree tracker, like this cluster's proctrack/linuxproc, then loses).
    launch = json.loads((stage.out_dir / "logs" / "launch.json").read_text())["launch_id"]
    assert not tagged_processes(lambda t: tag_launch_id(t) == launch)


def test_the_flows_hooks_cancel_its_jobs_by_label(slurm_cluster: Any, monkeypatch) -> None:
    from flows.stage.launchers.slurm import cancel_flow_run_jobs

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)

    def submit(comment: str) -> str:
        out = slurm_cluster.client(
            "sbatch", "--parsable", f"--comment={comment}", "--wrap", "sleep 300"
        )
        return out.strip()

    ours, other = submit("posttrain-flow-run=abc"), submit("posttrain-flow-run=abcd")
    assert cancel_flow_run_jobs("abc") == 1
    wait_for("the run's job to leave the queue", lambda: len(_queue(slurm_cluster)) == 1, 30)
    assert _queue(slurm_cluster)[0].split()[0] == other
    slurm_cluster.client("scancel", other)
    wait_for("the queue to empty", lambda: not _queue(slurm_cluster), 30)
    assert "JobState=CANCELLED" in slurm_cluster.client("scontrol", "-o", "show", "job", ours)


def _direct_stage(tmp_path: Path, module: str, **changes: Any) -> tuple[Any, Path]:
    """A 2-node Slurm stage running `module`, planned by hand (for stage_task without a flow)."""
    infra = {"launcher": "slurm", "nnodes": 2, "slurm": {"poll_s": 0.5, **changes.pop("slurm", {})}}
    infra |= changes.pop("infra", {})
    return hand_planned(
        tmp_path, module, infra, nnodes=2, hang_startup_s=120, launcher="slurm", **changes
    )


def test_a_refused_submission_fails_with_slurms_words(
    slurm_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.stage.failures import StageFailed
    from flows.stage.task import stage_task

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    stage, spec = _direct_stage(tmp_path, "posttrain.stages.sft", slurm={"partition": "gpu"})
    with pytest.raises(
        StageFailed, match="could not be started: sbatch refused the job: .*invalid partition"
    ):
        stage_task.fn(stage, spec, kill_grace_s=1.0)
    assert _queue(slurm_cluster) == []


def test_a_job_that_cannot_start_fails_at_the_queue_timeout(
    slurm_cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.stage.failures import StageTimeout
    from flows.stage.task import stage_task

    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    stage, spec = _direct_stage(tmp_path, "posttrain.stages.sft", infra={"queue_timeout_s": 3})
    slurm_cluster.client("scontrol", "update", "nodename=n2", "state=drain", "reason=test")
    try:
        t0 = time.monotonic()
        with pytest.raises(StageTimeout) as info:
            stage_task.fn(stage, spec, kill_grace_s=1.0)
        assert 3 <= time.monotonic() - t0 < 30
    finally:
        slurm_cluster.client("scontrol", "update", "nodename=n2", "state=resume")
    assert "waited 3 s without starting (Slurm job" in str(info.value)
    assert "Slurm: PENDING (" in str(info.value) and "infra.queue_timeout_s" in str(info.value)
    assert _queue(slurm_cluster) == []
    slurm_cluster.wait_idle(60)
