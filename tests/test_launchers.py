"""The launcher layer without an engine: which engine runs a stage, what the Slurm launcher
writes and submits, how it reads Slurm's answers and output, the remote stages' orphan beat,
and the recipe's launcher settings. The real-Slurm runs are in tests/test_slurm_launch.py."""

from __future__ import annotations

import copy
import subprocess
import threading
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.stage.launchers import launcher_for
from flows.stage.launchers.base import LaunchRequest
from flows.stage.launchers.slurm import SlurmLaunch, SlurmLauncher, exit_status
from flows.stage.output import NODE_PREFIX
from posttrain.config.loader import load_recipe
from posttrain.plan.planner import plan
from posttrain.runtime.orphan import BeatReader, SupervisorBeat
from tests.stage_helpers import TINY, write_recipe


def _stages(tmp_path: Path, **infra: object) -> dict:
    data = copy.deepcopy(TINY)
    data["run"]["workspace"] = str(tmp_path / "ws")
    data["infra"] |= infra
    tmp_path.mkdir(parents=True, exist_ok=True)
    return {s.name: s for s in plan(load_recipe(write_recipe(tmp_path, data))).stages}


def _request(stage, tmp_path: Path, labels: dict | None = None) -> LaunchRequest:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    return LaunchRequest(stage, logs / "spec.json", "feedc0de" * 4, {}, logs, labels or {})


def test_ingest_stays_local_and_the_rest_goes_to_the_engine(tmp_path: Path) -> None:
    stages = _stages(tmp_path, launcher="slurm", nnodes=2)
    assert launcher_for(stages["ingest"]).name == "local"
    assert launcher_for(stages["sft"]).name == "slurm"
    assert launcher_for(stages["evaluate"]).name == "slurm"
    assert stages["sft"].nnodes == 2 and stages["evaluate"].nnodes == 1
    # Where a stage runs is not what it computes: same fingerprints as the local launcher's.
    local = _stages(tmp_path / "l", launcher="local", nnodes=2, rdzv_endpoint="h:1")
    assert {n: s.fingerprint for n, s in local.items()} == {
        n: s.fingerprint for n, s in stages.items()
    }


def test_every_node_runs_the_same_command_with_its_own_rank(tmp_path: Path) -> None:
    sft = _stages(tmp_path, launcher="slurm", nnodes=2, slurm={"python": "/bin/echo"})["sft"]
    launcher = SlurmLauncher.from_infra(sft.infra)
    request = _request(sft, tmp_path)
    node = tmp_path / "node.sh"
    node.write_text(launcher.node_script(request))
    for rank in ("0", "1"):
        env = {"SLURM_PROCID": rank, "POSTTRAIN_RDZV_ENDPOINT": "n1:20057", "PATH": "/usr/bin"}
        out = subprocess.run(["bash", str(node)], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [
            "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", rank,
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n1:20057",
            "--rdzv-id", sft.fingerprint, "-m", "posttrain.stages.sft", "--spec",
            str(request.spec_path),
        ]  # fmt: skip


def test_batch_script_and_sbatch_options(tmp_path: Path) -> None:
    slurm = {
        "partition": "gpu",
        "account": "ml",
        "mem": "0",
        "setup": ["module load cuda/12.4"],
        "sbatch_args": ["--mail-type=FAIL"],
        "exclusive": True,
    }
    stages = _stages(
        tmp_path, launcher="slurm", nnodes=4, device="cuda", devices_per_node=8, slurm=slurm
    )
    sft = stages["sft"]
    launcher = SlurmLauncher.from_infra(sft.infra)
    request = _request(sft, tmp_path, {"flow-run": "abc-123"})
    opts = launcher.sbatch_options(request)
    assert "--nodes=4" in opts and "--ntasks-per-node=1" in opts
    assert "--gpus-per-node=8" in opts and "--partition=gpu" in opts and "--account=ml" in opts
    assert "--mem=0" in opts and "--exclusive" in opts and opts[-1] == "--mail-type=FAIL"
    assert "--comment=posttrain-flow-run=abc-123" in opts and "--no-requeue" in opts
    # The Slurm limit is the stage timeout (default 86400 s for training) plus 5 minutes.
    assert f"--time={int(sft.timeout_s // 60) + 5}" in opts
    script = launcher.batch_script(request, tmp_path / "node.sh")
    assert script.index("module load cuda/12.4") < script.index("srun")
    # The options are in the script too: `sbatch <script>` by hand submits the same job.
    assert [line[8:] for line in script.splitlines() if line.startswith("#SBATCH ")] == opts
    assert "$((20000 + SLURM_JOB_ID % 20000))" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    # CPU: no GPU request.
    cpu = _stages(tmp_path / "c", launcher="slurm", nnodes=2)["sft"]
    assert not any(
        o.startswith("--gpus")
        for o in SlurmLauncher.from_infra(cpu.infra).sbatch_options(_request(cpu, tmp_path))
    )


def _ended(info: dict[str, str], cancelled: bool = False) -> SlurmLaunch:
    launch = SlurmLaunch("57", Path("/nonexistent"), 2, poll_s=1e9)
    launch.info, launch.read_at, launch.cancelled = info, time.monotonic(), cancelled
    return launch


def test_slurm_end_states_and_reasons() -> None:
    ok = _ended({"JobState": "COMPLETED", "ExitCode": "0:0"})
    assert ok.poll() == 0 and ok.engine_reason() is None and ok.started()
    failed = _ended({"JobState": "FAILED", "ExitCode": "1:0", "Reason": "NonZeroExitCode"})
    assert failed.poll() == 1 and failed.engine_reason() is None  # the ranks say why
    timeout = _ended({"JobState": "TIMEOUT", "ExitCode": "0:15", "TimeLimit": "00:06:00"})
    assert timeout.poll() == 128 + 15
    assert timeout.engine_reason() == (
        "Slurm: job 57 TIMEOUT, it reached its time limit (00:06:00; infra.slurm.time)"
    )
    node = _ended({"JobState": "NODE_FAIL", "ExitCode": "0:0", "NodeList": "n[1-2]"})
    assert (
        node.poll() == 1
        and "lost a node" in node.engine_reason()
        and "n[1-2]" in (node.engine_reason() or "")
    )
    # A cancel by someone else is the engine's doing; ours is not reported as a reason.
    assert "cancelled outside" in (_ended({"JobState": "CANCELLED"}).engine_reason() or "")
    assert _ended({"JobState": "CANCELLED"}, cancelled=True).engine_reason() is None
    pending = _ended({"JobState": "PENDING", "Reason": "Resources"})
    assert pending.poll() is None and not pending.started()
    assert pending.waiting_reason() == "Slurm: PENDING (Resources)"
    assert exit_status({"JobState": "OUT_OF_MEMORY", "ExitCode": "0:9"}) == 137


def test_output_is_followed_to_the_end_with_node_prefixes(tmp_path: Path) -> None:
    out = tmp_path / "slurm-57.out"
    launch = _ended({"JobState": "RUNNING"})

    def job() -> None:
        with open(out, "w") as f:
            f.write("posttrain: job 57 on n[1-2]\n0: step 1\n")
            f.flush()
            time.sleep(0.5)
            f.write("1: step 1\n 0: POSTTRAIN_ARTIFACT {}\n0: no newline")
        launch.info = {"JobState": "COMPLETED", "ExitCode": "0:0"}

    launch.output_path = out
    threading.Thread(target=job).start()
    lines = list(launch.output())
    assert lines == [
        "posttrain: job 57 on n[1-2]\n",
        "[node 0] step 1\n",
        "[node 1] step 1\n",
        "[node 0] POSTTRAIN_ARTIFACT {}\n",
        "[node 0] no newline\n",
    ]
    assert NODE_PREFIX.sub("", lines[3]).startswith("POSTTRAIN_ARTIFACT ")


def test_remote_orphan_beat(tmp_path: Path) -> None:
    beat = tmp_path / "logs" / "supervisor.beat"
    with SupervisorBeat(beat, every_s=0.05):
        reader = BeatReader(beat, silence_s=0.5)
        for _ in range(10):
            assert reader.alive()
            time.sleep(0.1)  # longer than a beat, so the content changes in between
    t0 = time.monotonic()
    while reader.alive():
        assert time.monotonic() - t0 < 3, "a silent supervisor must count as gone"
        time.sleep(0.05)
    assert time.monotonic() - t0 >= 0.3  # not before the silence limit (less the last beat)
    # The supervisor's clock is never compared with ours: an old timestamp in a changing file
    # is a live supervisor.
    reader = BeatReader(beat, silence_s=0.5)
    for n in range(5):
        beat.write_text(f"{n} 0.0 1\n")
        time.sleep(0.2)
        assert reader.alive()


@pytest.mark.parametrize(
    ("infra", "message"),
    [
        ({"launcher": "slurm"}, "infra.device set to cuda or cpu"),
        ({"launcher": "kubernetes", "device": "cpu", "devices_per_node": "auto"}, "a number"),
        ({"launcher": "slurm", "device": "cpu", "slurm": {"time": "4h"}}, "not a Slurm time"),
        ({"launcher": "slurm", "device": "cpu", "slurm": {"sbatch_args": ["-p gpu"]}}, "--name"),
        ({"launcher": "slurm", "device": "cpu", "slurm": {"partiton": "gpu"}}, "partiton"),
    ],
)
def test_launcher_settings_are_checked(tmp_path: Path, infra: dict, message: str) -> None:
    data = copy.deepcopy(TINY)
    data["infra"] = infra
    with pytest.raises((ValidationError, ValueError), match=message):
        load_recipe(write_recipe(tmp_path, data))


class _Queued:
    """An engine's launch, scripted: queued for `queued_s`, then running until stopped."""

    description = "job 7"
    record: dict[str, str] = {}

    def __init__(self, queued_s: float):
        self.t0, self.queued_s = time.monotonic(), queued_s

    def started(self) -> bool:
        return time.monotonic() - self.t0 >= self.queued_s

    def waiting_reason(self) -> str | None:
        return None if self.started() else "PENDING (Resources)"

    def wait(self, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.05))


def test_the_stage_timeout_counts_from_when_the_job_runs(tmp_path: Path, caplog) -> None:
    import logging

    from flows.stage.supervise import _wait

    sft = _stages(tmp_path, launcher="slurm")["sft"]
    sft.timeout_s = 0.3
    log = logging.getLogger("test.wait")
    with caplog.at_level(logging.INFO, logger="test.wait"):
        t0 = time.monotonic()
        waited = _wait(_Queued(1.0), sft, None, log)  # type: ignore[arg-type]
    assert waited.timeout == "run" and time.monotonic() - t0 >= 1.3
    assert "job 7 waits: PENDING (Resources)" in caplog.text and "job 7 is running" in caplog.text
    sft.infra["queue_timeout_s"] = 0.3
    waited = _wait(_Queued(10.0), sft, None, log)  # type: ignore[arg-type]
    assert waited.timeout == "queue" and waited.waiting == "PENDING (Resources)"


def test_a_local_supervisor_is_known_by_its_start_ticks_not_the_wall_clock(monkeypatch) -> None:
    """A clock step (NTP) moves psutil's boot time and so every create_time it reports; the
    identity the stage checks its supervisor by is the kernel's start ticks, which do not move:
    a live supervisor stays alive, an exited one is gone, another start time is another
    process."""
    import os
    import subprocess
    import sys

    import psutil

    from posttrain.runtime.orphan import process_start, supervisor_alive

    me, start = os.getpid(), process_start()
    assert supervisor_alive(me, start)
    before, real = psutil.Process(me).create_time(), psutil.boot_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real + 1.0)  # a 1 s clock step
    assert psutil.Process(me).create_time() - before == pytest.approx(1.0)  # psutil's moves...
    assert supervisor_alive(me, start)  # ...the identity does not
    assert not supervisor_alive(me, start + 1.0)  # another process that had this PID
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child_start = process_start(child.pid)
    child.wait()
    assert not supervisor_alive(child.pid, child_start)
