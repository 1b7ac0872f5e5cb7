"""Two ranks under torchrun meet a fault that only one of them sees, and still decide together:
the disk fills while rank 1 writes its checkpoint shard (both stop with the DiskFull verdict, none
waits in a barrier, the partial checkpoint is removed); then a checkpoint whose damage only rank
1's share of the hashing finds is skipped by both, and the run resumes from the older one."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.store.artifacts import verify
from posttrain.telemetry.records import read_metrics
from posttrain.train.checkpoint import complete_checkpoints
from posttrain.train.integrity import listing, my_share
from posttrain.train.resume import inspect_checkpoint
from tests.faults.fault_injection import (
    can_mount_tmpfs,
    flip_bytes,
    skip_without_tmpfs,
    small_disk,
)
from tests.stage_helpers import ROOT, TINY, planned_dir, planned_launch, run_inprocess, write_recipe

pytestmark = pytest.mark.slow

TWO = ("infra.devices_per_node=2", "sft.batch.micro_batch_size=4", "infra.pg_timeout_s=120")

# A stage module that runs the real sft stage, with rank $PT_FULL_RANK filling the disk at
# $PT_DISK the moment DCP opens its file of checkpoint step 6.
WRAPPER = """
import os
from pathlib import Path

from posttrain.stages.common import stage_main
from posttrain.stages.sft import run
from tests.faults.fault_injection import SmallDisk, disk_filled_when_dcp_writes

if os.environ.get("RANK") == os.environ["PT_FULL_RANK"]:
    # Kept referenced: a collected context manager would undo the patch at once.
    FILL = disk_filled_when_dcp_writes(SmallDisk(Path(os.environ["PT_DISK"])), "step_0000006.tmp")
    FILL.__enter__()
stage_main(run, kind="sft", distributed=True)
"""


def _torchrun(module: str, recipe: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    with planned_launch("sft", recipe, *TWO) as spec:
        cmd += ["-m", module, "--spec", str(spec)]
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    data = copy.deepcopy(TINY)
    data["infra"]["threads_per_rank"] = 1
    data["ingest"]["from_config"]["pretrain_steps"] = 10
    data["sft"].update(max_steps=8, checkpoint_every=2, keep_checkpoints=3)
    data["sft"]["data"]["synthetic"]["n_examples"] = 120
    path = write_recipe(tmp_path, data)
    run_inprocess("ingest", path)
    return path


def test_one_rank_meets_the_fault_both_decide(recipe: Path, tmp_path: Path, monkeypatch) -> None:
    if not can_mount_tmpfs(tmp_path / "probe"):
        skip_without_tmpfs("needs a real small filesystem (root and mount -t tmpfs)")
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "pt_sft_disk_fills.py").write_text(WRAPPER)
    out = planned_dir("sft", recipe, *TWO)
    root = out / "checkpoints"
    with small_disk(root, 40) as disk:
        monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'mods'}:{ROOT}")
        monkeypatch.setenv("PT_DISK", str(root))
        monkeypatch.setenv("PT_FULL_RANK", "1")
        t0 = time.monotonic()
        proc = _torchrun("pt_sft_disk_fills", recipe)
        took = time.monotonic() - t0
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0, text[-3000:]
        verdicts = [x for x in text.splitlines() if x.startswith("POSTTRAIN_ERROR stage sft")]
        assert len(verdicts) == 2, text[-4000:]  # both ranks, the same verdict
        for v in verdicts:
            assert v.startswith(
                "POSTTRAIN_ERROR stage sft failed: DiskFull: not enough disk space for "
                f"checkpoint step_0000006 in {root}"
            ), v
            assert "the disk filled while writing it" in v
        assert took < 120, f"{took:.0f} s: a rank waited for its peer instead of failing with it"
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
            "step_0000002",
            "step_0000004",
        ]
        disk.free_up()

        # Bit rot in the one file of step 4 that rank 1 hashes (rank 0 sees nothing wrong).
        step4 = root / "step_0000004"
        names = [n for n in my_share(listing(step4), 1, 2) if n.endswith(".distcp")]
        flip_bytes(step4 / names[0])
        proc = _torchrun("posttrain.stages.sft", recipe)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, text[-4000:]
        assert f"{names[0]}: sha256 differs from the one recorded at save" in text
        assert "resumed from step_0000002 at step 2" in text
        assert verify(out)[0]
        (resume,) = read_metrics(out / "metrics.jsonl", "resume")
        assert resume["rejected"][0]["checkpoint"] == "step_0000004"
        assert [p.name for p in complete_checkpoints(root)] == [
            "step_0000002",
            "step_0000004",
            "step_0000006",
        ]
        assert all(inspect_checkpoint(p) == (True, []) for p in complete_checkpoints(root))
        shutil.rmtree(root / "step_0000004.damaged")
